"""What no exception tells after a cell, sent with each telemetry payload: a group NCCL's watchdog
failed (it aborts the communicators and raises in no thread of the user's), and this rank's
counts of queued collectives per group and backend and of point-to-point transfers."""

from __future__ import annotations

import contextlib
from typing import Any

from nbdist.worker import flight_recorder, process_group, release
from nbdist.worker.collectives import TRACKER


def nccl_failures() -> dict[str, str]:
    """Group -> how its NCCL backend failed ("TIMEOUT", "COMM_ERROR", "REMOTE_ERROR"): the error
    state the watchdog sets before it aborts the group (`ProcessGroupNCCL::getError`)."""
    import torch

    found: dict[str, str] = {}
    for group, _name, label, _ranks, backend in process_group.groups():
        if not release.uses_nccl(backend):
            continue
        with contextlib.suppress(Exception):  # no NCCL backend on this group after all
            error = group._get_backend(torch.device("cuda")).get_error()
            if error.name != "SUCCESS":
                found[label] = str(error.name)
    return found


# group -> the collective found in flight when its failure was first seen, this generation: by
# the cell's end the GPU may have finished it late (a timeout), and the record no longer tells
_NAMED: dict[str, str] = {}
_NAMED_IN = [0.0]  # the generation _NAMED belongs to


def failed_collective(label: str) -> str:
    """The first collective of the group still in flight in NCCL's record ("all_reduce #3 of
    the default group") when its failure was first seen, or "" when the record cannot say."""
    if _NAMED_IN[0] != process_group.GENERATION_STARTED:
        _NAMED.clear()
        _NAMED_IN[0] = process_group.GENERATION_STARTED
    with contextlib.suppress(Exception):
        if label not in _NAMED and flight_recorder.available():
            stuck = [e for e in flight_recorder.entries() if e.group == label and not e.completed]
            if stuck:
                _NAMED[label] = min(stuck, key=lambda e: e.seq).title()
    return _NAMED.get(label, "")


def health() -> dict[str, Any] | None:
    """The telemetry provider: sequence numbers, point-to-point counts, NCCL failures, and when
    nbdist last aborted this rank's NCCL communicators."""
    if not process_group.is_initialized():
        return None
    failed = {label: {"error": error, "collective": failed_collective(label)}
              for label, error in nccl_failures().items()}
    return {"sequence": process_group.sequence_numbers(), "p2p": dict(TRACKER.p2p),
            "nccl_failed": failed, "nccl_aborted_at": release.NCCL_ABORTED_AT}
