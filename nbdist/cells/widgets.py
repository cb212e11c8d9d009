"""A rank's own widgets in the notebook (an ipywidgets slider, a ``tqdm.notebook`` bar): each comm a
rank opens gets a twin in the notebook kernel with the same id, so the frontend draws the rank's
model; the rank's messages go out through the twin, and the frontend's come back over the cell
channel to the rank's comm, where its widget lives.

Twins are made with ``comm.create_comm``, the hook ipykernel fills in: outside a kernel (a plain
Python process) it makes comms that go nowhere, and the rank's widgets still work there.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from nbdist.cluster.cell_channel import ChannelMessage, NotebookChannel
from nbdist.cluster.ranks import RankProcess


class WidgetRelay:
    """The notebook's twins of the ranks' comms, for one channel (its `on_comm`)."""

    def __init__(self, channel: NotebookChannel, ranks: Sequence[RankProcess]) -> None:
        self.channel = channel
        self.ranks = ranks
        self.twins: dict[str, tuple[int, Any]] = {}
        """comm id -> (rank, the twin comm in this kernel)."""
        self.lock = threading.Lock()  # the channel's reader thread, and the kernel's own

    def __call__(self, message: ChannelMessage) -> None:
        msg = message.body.msg  # a protocol Comm: Jupyter's comm message, whole
        content = msg["content"]
        kind = message.body.kind
        comm_id = str(content.get("comm_id"))
        if kind == "comm_open":
            self._open(message.rank, comm_id, msg)
            return
        with self.lock:
            closing = kind == "comm_close"
            known = self.twins.pop(comm_id, None) if closing else self.twins.get(comm_id)
        if known is None:
            return
        twin = known[1]
        if kind == "comm_msg":
            twin.send(data=content.get("data"), metadata=msg.get("metadata"),
                      buffers=_buffers(msg))
        else:
            twin.close(data=content.get("data"), metadata=msg.get("metadata"))

    def _open(self, rank: int, comm_id: str, msg: dict[str, Any]) -> None:
        import comm

        content = msg["content"]
        twin = comm.create_comm(comm_id=comm_id, target_name=content.get("target_name", ""),
                                data=content.get("data"), metadata=msg.get("metadata"),
                                buffers=_buffers(msg))
        twin.on_msg(lambda reply: self._to_rank(rank, "comm_msg", comm_id, reply))
        twin.on_close(lambda reply: self._closed_here(rank, comm_id, reply))
        with self.lock:
            self.twins[comm_id] = (rank, twin)

    def _closed_here(self, rank: int, comm_id: str, reply: dict[str, Any]) -> None:
        with self.lock:
            self.twins.pop(comm_id, None)
        self._to_rank(rank, "comm_close", comm_id, reply)

    def _to_rank(self, rank: int, kind: str, comm_id: str, reply: dict[str, Any]) -> None:
        """A message the frontend sent to a twin, to the rank's comm of the same id."""
        endpoint = self.ranks[rank].endpoint if rank < len(self.ranks) else None
        if endpoint is None or self.ranks[rank].state != "alive":
            return
        data = (reply.get("content") or {}).get("data") or {}
        self.channel.send(rank, endpoint, kind, {"comm_id": comm_id, "data": data},
                          buffers=_buffers(reply))

    def close(self) -> None:
        """The ranks' widgets are gone (the cluster stopped): so are their twins."""
        with self.lock:
            twins, self.twins = list(self.twins.values()), {}
        for _rank, twin in twins:
            try:
                twin.close()
            except Exception:
                pass


def relay_widgets(channel: NotebookChannel, ranks: Sequence[RankProcess]) -> None:
    """Make `channel` relay the ranks' widgets (once per channel; `ranks` is the live table)."""
    relay = channel.on_comm
    if isinstance(relay, WidgetRelay):
        relay.ranks = ranks
    else:
        channel.on_comm = WidgetRelay(channel, ranks)


def _buffers(msg: dict[str, Any]) -> list[Any] | None:
    buffers = msg.get("buffers")
    return [bytes(b) for b in buffers] if buffers else None
