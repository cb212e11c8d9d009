"""Time DDP's gradient all-reduces, which torch runs from C++ where no Python wrapper sees them.

DDP's communication is left exactly as torch does it (its fused C++ all-reduce: a Python comm
hook would cost a second pass over every bucket, ~5 % of a CPU step here). Instead ``install``
patches ``DistributedDataParallel.__init__`` to put a post-accumulate-grad hook on each of the
model's parameters: the last one to fire in a backward is when this rank's last bucket was handed
to the all-reduce (its arrival), and the next optimizer step begins after DDP has waited for every
bucket (everyone's arrival). The time between the two is this rank's wait; the rank that waited
least arrived last. On CUDA both times are host-side (kernels run asynchronously).
"""

from __future__ import annotations

import functools
import time
from typing import Any


def install(timing: Any) -> None:
    """Patch DDP once per process; ``timing`` has ``enabled`` and ``ddp_ready(group, t)``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if getattr(DDP, "__nbdist_timed__", False):
        return
    original_init = DDP.__init__

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if timing.enabled:
            watch(self, timing)

    DDP.__init__ = init  # type: ignore[method-assign]
    DDP.__nbdist_timed__ = True  # type: ignore[attr-defined]


def uninstall() -> None:
    """DDP's own ``__init__`` back (models built meanwhile keep their parameter hooks)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if getattr(DDP, "__nbdist_timed__", False):
        DDP.__init__ = DDP.__init__.__wrapped__  # type: ignore[attr-defined,method-assign]
        del DDP.__nbdist_timed__  # type: ignore[attr-defined]


def watch(ddp: Any, timing: Any) -> int:
    """Hook every trainable parameter of ``ddp``'s module; returns how many (never raises)."""
    group = getattr(ddp, "process_group", None)

    def ready(_param: Any) -> None:
        timing.ddp_ready(group, time.perf_counter())

    hooked = 0
    try:
        for param in ddp.module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(ready)
                hooked += 1
    except Exception:  # an older torch or an odd module: DDP trains on, untimed
        pass
    return hooked
