"""Push and pull on a rank (%dist_push, %dist_pull): names bound and read in its namespace; the
frames carry every tensor on the CPU and place a pushed one on the rank's `device`."""

from __future__ import annotations

from typing import Any

from nbdist.worker.rank_service import command


@command("values.receive", main_thread=True)
def receive_values(values: dict[str, Any]) -> list[str]:
    from IPython import get_ipython

    get_ipython().user_ns.update(values)
    return sorted(values)


@command("values.send", main_thread=True)
def send_values(names: list[str]) -> dict[str, Any]:
    from IPython import get_ipython

    namespace = get_ipython().user_ns
    missing = [name for name in names if name not in namespace]
    if missing:
        raise NameError(f"not defined on this rank: {', '.join(missing)}")
    return {name: namespace[name] for name in names}
