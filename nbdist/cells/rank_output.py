"""What one rank's cell produced, read from its channel messages (nbdist.cluster.cell_channel):
its streams, displays, result, error and data, and the event each message is for the runner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from nbdist.cluster.cell_channel import CELL_REPLY, ChannelMessage
from nbdist.worker.agent import TELEMETRY_KEY

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


def read_message(message: ChannelMessage, out: RankOutput) -> tuple[str, Any] | None:
    """Record one message in its rank's output; the runner's event for it, if any:
    ("stream", content), ("display", content), ("telemetry", payload) or ("done", None)."""
    msg = message.msg
    msg_type = msg["header"]["msg_type"]
    content = msg["content"]
    if msg_type == "stream":
        name = "stderr" if content["name"] == "stderr" else "stdout"
        text = getattr(out, name) + content["text"]
        setattr(out, name, _CR.sub("", text) if "\r" in content["text"] else text)
        return "stream", content
    if msg_type == "display_data":
        out.outputs.append(content)
        return "display", content
    if msg_type == "execute_result":
        out.execute_result = content
    elif msg_type == "error":
        out.error = remote_error(content)
    elif msg_type == "data_message":
        from ipyparallel.serialize import deserialize_object

        data, _rest = deserialize_object(msg["buffers"])
        out.data.update(data)
        payload = data.get(TELEMETRY_KEY)
        return ("telemetry", payload) if payload is not None else None
    elif msg_type == CELL_REPLY:
        if content.get("status") != "ok" and (out.error is None or content.get("interrupted")):
            interrupted = content.get("interrupted")
            out.error = _interrupted(out.error) if interrupted else remote_error(content)
        return "done", None
    return None


def remote_error(content: dict[str, Any]) -> SimpleNamespace:
    """An error as a rank reports it (ename, evalue, traceback text)."""
    traceback = content.get("traceback") or []
    text = "\n".join(traceback) if isinstance(traceback, list) else str(traceback)
    return SimpleNamespace(ename=content.get("ename", "Exception"),
                           evalue=content.get("evalue", ""), traceback=text)


def _interrupted(error: SimpleNamespace | None) -> SimpleNamespace:
    """The stop button cancelled a cell that was awaiting: a KeyboardInterrupt, where it stopped."""
    return SimpleNamespace(ename="KeyboardInterrupt", evalue="",
                           traceback=error.traceback if error is not None else "")
