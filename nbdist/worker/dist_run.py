"""`%dist_run script.py [args]` inside a rank: an existing torchrun script, unchanged.

It runs as `__main__` with its own `sys.argv` and torchrun's environment; its `sys.exit(0)` is
success, any other exit code an error; its globals stay in the rank's namespace afterwards.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from nbdist.worker.non_interactive import torchrun_environment
from nbdist.worker.setup_message import RankSpec


class ScriptExit(Exception):
    """The script ended with `sys.exit(code)` and a code other than 0 / None."""

    def __init__(self, path: str, code: object) -> None:
        super().__init__(f"{os.path.basename(path)} exited with code {code!r}")
        self.code = code


def run_script(path: str, argv: Sequence[str], namespace: dict[str, Any],
               spec: RankSpec | None = None) -> None:
    """Run the script at `path` in `namespace` (the rank's own, as IPython's `%run -i` does:
    functions the script defines are then `__main__.name` for pickle and RPC, as under torchrun)."""
    full_path = os.path.abspath(path)
    with open(full_path, encoding="utf-8") as f:
        code = compile(f.read(), full_path, "exec")
    if spec is not None:
        os.environ.update(torchrun_environment(spec))
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    saved_file = namespace.get("__file__")
    sys.argv = [full_path, *argv]
    sys.path.insert(0, os.path.dirname(full_path))  # as `python script.py` puts it first
    namespace["__file__"] = full_path
    try:
        exec(code, namespace)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise ScriptExit(full_path, exc.code) from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if saved_file is None:
            namespace.pop("__file__", None)
        else:
            namespace["__file__"] = saved_file


def run_rank_script(path: str, argv: Sequence[str], namespace: dict[str, Any]) -> None:
    """`run_script` with this rank's torchrun environment (the cell `%dist_run` sends)."""
    from nbdist.worker.bootstrap import RUNTIME

    run_script(path, argv, namespace, spec=RUNTIME.spec)
