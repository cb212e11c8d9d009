"""What libraries see of a rank: a torchrun worker, not an interactive session.

IPython sets `sys.ps1` when its shell starts, and libraries read that as "a person is typing
here": Lightning then refuses its multi-process strategies. A rank is one of N processes started
for it, so it looks like what torchrun starts; the notebook's own kernel is left as it is.
"""

from __future__ import annotations

import os
import sys

from nbdist.worker.setup_message import RankSpec

PROMPTS = ("ps1", "ps2", "ps3")
"""The `sys` attributes only an interactive interpreter has (IPython sets all three)."""


def torchrun_environment(spec: RankSpec, run_id: str = "nbdist") -> dict[str, str]:
    """The variables torchrun sets for a worker that are not already the rank's own (RANK,
    LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set at start).
    TORCHELASTIC_RUN_ID is what `torch.distributed.is_torchelastic_launched()` looks for."""
    world_size, local_world_size = spec.world_size, spec.local_world_size
    return {
        "GROUP_RANK": str(spec.rank // max(local_world_size, 1)),
        "GROUP_WORLD_SIZE": str(max(world_size // max(local_world_size, 1), 1)),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(spec.rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
    }


def present_as_torchrun_worker(spec: RankSpec) -> None:
    """No prompts, torchrun's environment, and an argv without the engine's own options (a
    pasted `parser.parse_args()` sees what a script started without arguments sees)."""
    for name in PROMPTS:
        if hasattr(sys, name):
            delattr(sys, name)
    os.environ.update(torchrun_environment(spec))
    sys.argv[1:] = []
