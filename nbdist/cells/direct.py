"""A cell's messages from the direct channel (nbdist.cluster.cell_channel), kept as ipyparallel
keeps a cell's messages: one metadata dict per rank (stdout, stderr, outputs, execute_result,
error, data), so the runner reads a cell's outcome the same way whichever way it travelled.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

from nbdist.cluster.cell_channel import CELL_REPLY, ChannelMessage
from nbdist.worker.agent import TELEMETRY_KEY

_CR = re.compile(r".*\r(?=[^\n])")  # ipyparallel's: a carriage return rewrites its line


def new_metadata() -> dict[str, Any]:
    return {"stdout": "", "stderr": "", "outputs": [], "execute_result": None, "error": None,
            "data": {}}


def read_message(message: ChannelMessage, md: dict[str, Any]) -> tuple[str, Any] | None:
    """Record one message in its rank's metadata; the runner's event for it, if any:
    ("stream", content), ("display", content), ("telemetry", payload) or ("done", None)."""
    msg = message.msg
    msg_type = msg["header"]["msg_type"]
    content = msg["content"]
    if msg_type == "stream":
        text = md[content["name"]] + content["text"]
        md[content["name"]] = _CR.sub("", text) if "\r" in content["text"] else text
        return "stream", content
    if msg_type == "display_data":
        md["outputs"].append(content)
        return "display", content
    if msg_type == "execute_result":
        md["execute_result"] = content
    elif msg_type == "error":
        md["error"] = remote_error(content)
    elif msg_type == "data_message":
        from ipyparallel.serialize import deserialize_object

        data, _rest = deserialize_object(msg["buffers"])
        md["data"].update(data)
        payload = data.get(TELEMETRY_KEY)
        return ("telemetry", payload) if payload is not None else None
    elif msg_type == CELL_REPLY:
        if content.get("status") != "ok" and md["error"] is None:
            md["error"] = remote_error(content)
        return "done", None
    return None


def remote_error(content: dict[str, Any]) -> SimpleNamespace:
    """An error as ipyparallel's RemoteError carries it (ename, evalue, traceback text)."""
    traceback = content.get("traceback") or []
    return SimpleNamespace(ename=content.get("ename", "Exception"), evalue=content.get("evalue", ""),
                           traceback="\n".join(traceback) if isinstance(traceback, list) else str(traceback))
