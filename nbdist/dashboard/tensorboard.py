"""``nbdist.log`` values as TensorBoard scalars: one run directory, one tag per metric and rank.

A TelemetryHub listener in the notebook kernel, which already receives every rank's metrics: the
event file lands where the user looks (not on each rank's host), and a rank that dies loses only
what it had not yet sent (≤ ``telemetry_log_spacing``). Tags are ``loss/rank0``, ``loss/rank1``;
steps and wall times are the ranks' own. Written with the ``tensorboard`` package's record writer
(no TensorFlow, no torch in the kernel), flushed after every payload, no thread of its own.
"""

from __future__ import annotations

import math
import os
import socket
import time
from pathlib import Path
from typing import Any

from nbdist.errors import NbdistError

INSTALL_HINT = "pip install tensorboard"


def _protos() -> tuple[Any, Any, Any]:
    try:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter
    except ImportError as exc:
        raise NbdistError(f"--tensorboard needs the tensorboard package ({exc}): "
                          f"{INSTALL_HINT}") from None
    return Event, Summary, RecordWriter


class TensorBoardWriter:
    """Subscribe to a TelemetryHub; ``run_dir`` is what ``tensorboard --logdir`` shows as a run."""

    def __init__(self, log_dir: str | os.PathLike[str], run_name: str | None = None) -> None:
        self._event, self._summary, self._record_writer = _protos()  # fail now, not mid-cell
        name = run_name or time.strftime("nbdist-%Y%m%d-%H%M%S")
        self.run_dir = Path(log_dir).expanduser().resolve() / name
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise NbdistError(f"--tensorboard {str(log_dir)!r}: cannot create {self.run_dir} "
                              f"({exc.strerror})") from None
        self._file: Any = None
        self._writer: Any = None
        self._files = 0
        self.scalars = 0
        """Scalars written so far (every rank, every metric)."""

    # -- TelemetryListener ---------------------------------------------------------------------
    def on_telemetry(self, rank: int, payload: dict[str, Any]) -> None:
        metrics = payload.get("metrics")
        if not isinstance(metrics, dict) or not metrics.get("step"):
            return
        writer = self._open()
        for event in self._events(int(rank), metrics):
            writer.write(event.SerializeToString())
        writer.flush()

    def on_rank_state(self, rank: int, state: str, detail: str = "") -> None:
        pass  # everything a rank sent is on disk already

    def _events(self, rank: int, metrics: dict[str, Any]) -> list[Any]:
        times = list(metrics.get("t") or [])
        steps = list(metrics.get("step") or [])
        events = []
        for index, step in enumerate(steps):
            values = []
            for name, column in (metrics.get("values") or {}).items():
                value = column[index] if index < len(column) else None
                if isinstance(value, int | float) and not isinstance(value, bool):
                    values.append(self._summary.Value(tag=f"{name}/rank{rank}",
                                                      simple_value=float(value)))
            if not values:
                continue
            wall = times[index] if index < len(times) else time.time()
            events.append(self._event(wall_time=float(wall), step=_whole(step),
                                      summary=self._summary(value=values)))
            self.scalars += len(values)
        return events

    # -- the event file ------------------------------------------------------------------------
    def _open(self) -> Any:
        if self._writer is None:
            # TensorBoard's own naming; a new file after close() (the run goes on in it)
            self._files += 1
            path = self.run_dir / (f"events.out.tfevents.{time.time():.6f}."
                                   f"{socket.gethostname()}.{os.getpid()}.{self._files}")
            self._file = open(path, "wb")  # noqa: SIM115 -- closed by close()
            self._writer = self._record_writer(self._file)
            header = self._event(wall_time=time.time(), step=0, file_version="brain.Event:2")
            self._writer.write(header.SerializeToString())
        return self._writer

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer = None
        self._file = None


def _whole(step: Any) -> int:
    value = float(step)
    return int(value) if math.isfinite(value) else 0
