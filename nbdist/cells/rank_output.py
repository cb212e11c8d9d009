"""What one rank's cell produced, read from its channel messages (`nbdist.protocol` classes, by
type): its streams, displays, result, error and data, and which of them the runner acts on too.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from nbdist.protocol.wire import (
    TELEMETRY_KEY,
    CellDone,
    Display,
    Error,
    Malformed,
    Message,
    Prompt,
    ProtocolError,
    PublishedData,
    Result,
    Stream,
    Telemetry,
    Unrendered,
)

_CR = re.compile(r".*\r(?=[^\n])")  # a carriage return rewrites its line, as ipyparallel keeps it


@dataclass
class RankOutput:
    """One rank's part of one cell."""

    stdout: str = ""
    stderr: str = ""
    outputs: list[dict[str, Any]] = field(default_factory=list)
    """display_data contents, in order."""
    execute_result: dict[str, Any] | None = None
    error: SimpleNamespace | None = None
    """The cell's exception as ename, evalue, traceback (text)."""
    data: dict[str, Any] = field(default_factory=dict)
    """What the rank published as data (telemetry)."""


def read_message(body: Message | Malformed, out: RankOutput) -> Message | Malformed | None:
    """Record one message in its rank's output; the message again when the runner acts on it
    too (a stream, display, telemetry, pdb prompt, the cell's end, one that could not be read)."""
    reader = _READERS.get(type(body))
    if reader is None:
        raise ProtocolError(f"a {type(body).__name__} has no place in a cell's output")
    return reader(body, out)


def _stream(body: Stream, out: RankOutput) -> Stream:
    name = "stderr" if body.name == "stderr" else "stdout"
    text = getattr(out, name) + body.text
    setattr(out, name, _CR.sub("", text) if "\r" in body.text else text)
    return body


def _display(body: Display, out: RankOutput) -> Display:
    out.outputs.append(body.content)
    return body


def _result(body: Result, out: RankOutput) -> None:
    out.execute_result = body.content


def _error(body: Error, out: RankOutput) -> None:
    out.error = remote_error(body)


def _telemetry(body: Telemetry | PublishedData, out: RankOutput) -> Telemetry | None:
    out.data.update(body.data)
    return body if isinstance(body, Telemetry) and TELEMETRY_KEY in body.data else None


def _done(body: CellDone, out: RankOutput) -> CellDone:
    if body.status != "ok" and (out.error is None or body.interrupted):
        out.error = _interrupted(out.error) if body.interrupted else remote_error(body)
    return body


def _malformed(body: Malformed, out: RankOutput) -> Malformed:
    if body.tag == CellDone.TAG:  # the cell's end, unreadable: the rank is done all the same
        out.error = SimpleNamespace(ename="ProtocolError", evalue=body.reason, traceback="")
    return body


_READERS: dict[type, Callable[[Any, RankOutput], Any]] = {
    Stream: _stream, Display: _display, Result: _result, Error: _error, Telemetry: _telemetry,
    PublishedData: _telemetry, CellDone: _done, Prompt: lambda body, _out: body,
    Malformed: _malformed, Unrendered: lambda _body, _out: None,
}


def remote_error(error: Error | CellDone) -> SimpleNamespace:
    """An error as a rank reports it (ename, evalue, traceback text)."""
    traceback = error.traceback or []
    text = "\n".join(traceback) if isinstance(traceback, (list, tuple)) else str(traceback)
    return SimpleNamespace(ename=error.ename or "Exception", evalue=error.evalue, traceback=text)


def _interrupted(error: SimpleNamespace | None) -> SimpleNamespace:
    """The stop button cancelled a cell that was awaiting: a KeyboardInterrupt, where it stopped."""
    return SimpleNamespace(ename="KeyboardInterrupt", evalue="",
                           traceback=error.traceback if error is not None else "")
