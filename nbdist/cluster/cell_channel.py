"""The notebook's end of the direct cell channel (the engine's end: nbdist.worker.cell_channel).

One PULL socket, on loopback, receives what every local rank's cells produce; one DEALER per rank
sends it cells. Used from the notebook's main thread only (the cell runner), so no lock. Every
message is signed and checked with the cluster's key (ipyparallel's own), and each carries the
cell's token and the rank as identities: output of an earlier cell (one that was given up on)
is told apart and dropped.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

from nbdist.worker.cell_channel import CELL_REPLY, CELL_REQUEST

__all__ = ["CELL_REPLY", "ChannelMessage", "NotebookChannel"]

SEND_TIMEOUT_MS = 1000


@dataclass(frozen=True, slots=True)
class ChannelMessage:
    """One message from a rank: its cell token, rank and the Jupyter message itself."""

    token: str
    rank: int
    msg: dict[str, Any]


class NotebookChannel:
    def __init__(self, key: bytes, signature_scheme: str) -> None:
        import zmq
        from jupyter_client.session import Session

        self._zmq = zmq
        self.session = Session(key=key, signature_scheme=signature_scheme, check_pid=False)
        self.context = zmq.Context()
        self.pull = self.context.socket(zmq.PULL)
        self.pull.linger = 0
        self.pull.rcvhwm = 0  # never drop a rank's output on the notebook side
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)
        self._dealers: dict[int, tuple[int, Any]] = {}
        self._tokens = itertools.count(1)
        self._prefix = f"{os.getpid()}-{id(self):x}"

    def new_token(self) -> str:
        return f"{self._prefix}-{next(self._tokens)}"

    def send_cell(self, rank: int, port: int, token: str, code: str) -> None:
        """Send one cell to a rank; raises zmq.Again if the rank has stopped taking them."""
        self.session.send(self._dealer(rank, port), CELL_REQUEST, content={"token": token, "code": code})

    def receive(self, timeout: float) -> list[ChannelMessage]:
        """Whatever arrived within `timeout` seconds (returns as soon as something did)."""
        zmq = self._zmq
        if not self.poller.poll(max(0, int(timeout * 1000))):
            return []
        messages = []
        while True:
            try:
                frames = self.pull.recv_multipart(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return messages
            message = self._parse(frames)
            if message is not None:
                messages.append(message)

    def _parse(self, frames: list[bytes]) -> ChannelMessage | None:
        try:
            idents, msg_list = self.session.feed_identities(frames)
            msg = self.session.deserialize(msg_list, content=True)
            return ChannelMessage(idents[0].decode(), int(idents[1]), msg)
        except Exception:  # unsigned, replayed or malformed: not from this cluster's ranks
            return None

    def _dealer(self, rank: int, port: int) -> Any:
        known = self._dealers.get(rank)
        if known is not None and known[0] == port:
            return known[1]
        if known is not None:
            known[1].close(linger=0)
        dealer = self.context.socket(self._zmq.DEALER)
        dealer.linger = 0
        dealer.sndtimeo = SEND_TIMEOUT_MS
        dealer.connect(f"tcp://127.0.0.1:{port}")
        self._dealers[rank] = (port, dealer)
        return dealer

    def close(self) -> None:
        for _port, dealer in self._dealers.values():
            dealer.close(linger=0)
        self._dealers.clear()
        self.pull.close(linger=0)
        self.context.term()


def open_channel(client: Any, enabled: bool) -> NotebookChannel | None:
    """The channel for a cluster whose ipyparallel client is `client` (its key signs every
    message), or None when direct cells are off."""
    if not enabled or client is None:
        return None
    return NotebookChannel(client.session.key, client.session.signature_scheme)


def close_channel(channel: NotebookChannel | None) -> None:
    if channel is not None:
        channel.close()
