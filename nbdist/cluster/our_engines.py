"""Which of the engines registered with nbdist's controller are the processes it just started.

An engine killed at the moment it registers (the stop button during `%dist_restart`, a restart
that stops the engines an interrupted one had started) can still be given an id by the
controller, which only drops it once its heartbeats stop. Counted as new, it would fail the
first call sent to it ("engine 17 died while running task").
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from nbdist.cluster.gather import gather

_ANSWER_SECONDS = 10.0
"""How long a registered engine gets to tell its PID; a live one answers in milliseconds, a dead
one never does (ipyparallel reports it dead once its heartbeats stop, in about this time)."""


def strangers(client: Any, engine_ids: Iterable[int], our_pids: set[int]) -> list[int]:
    """The engines among `engine_ids` that are not one of `our_pids`, or do not answer."""
    ids = list(engine_ids)
    answers = gather({eid: client[eid].apply_async(os.getpid) for eid in ids}, _ANSWER_SECONDS)
    return [eid for eid in ids if answers.results.get(eid) not in our_pids]
