"""The NCCL environment every NCCL rank runs with, so that a stuck or failed collective comes
back as an error in the cell instead of ending the engine (docs/NCCL.md says why, per variable).

ProcessGroupNCCL reads these when a group is created, so they are set before the first one.
"""

from __future__ import annotations

from collections.abc import Mapping

NCCL_ENVIRONMENT: dict[str, str] = {
    # 2 = CleanUpOnly: on an error or timeout the watchdog aborts the communicators and the
    # next wait or collective raises; torch's default (3) ends the process
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    # the heartbeat monitor ends the process once the watchdog is stuck or after a timeout dump:
    # in a notebook the interrupt ladder and the user decide when an engine dies
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    # the flight recorder's dump on a timeout or error runs in the monitor thread, which runs
    # (and, with monitoring off, only logs where it would have ended the process) either way
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    # after any failed or timed-out collective the watchdog sleeps 4 times this before it aborts
    # and the cell sees the error (torch's 15 s: a minute); the dump gets this long, twice
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "2000",
}
"""Variable -> the value nbdist sets on an NCCL rank unless the user set it already."""


def nccl_environment(current: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """What to set (variables the user left unset) and one note per variable the user set to
    something else (theirs wins)."""
    to_set: dict[str, str] = {}
    notes: list[str] = []
    for name, value in NCCL_ENVIRONMENT.items():
        theirs = current.get(name)
        if theirs is None:
            to_set[name] = value
        elif theirs.strip() != value:
            notes.append(f"{name}={theirs} is yours and kept (nbdist would set {value}: "
                         "see docs/NCCL.md)")
    return to_set, notes
