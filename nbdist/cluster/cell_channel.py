"""The notebook's end of the cell channel: one PULL for what every rank sends, one DEALER per
rank; a reader thread hands widget messages to `on_comm` at once and the rest to the cell runner.
Messages carry the cell's token and the rank, so a given-up cell's late output is dropped."""

from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from nbdist.cluster.gather import Gathered, rank_error
from nbdist.cluster.ranks import RankProcess
from nbdist.errors import NbdistError
from nbdist.worker.cell_channel import (
    CALL_REQUEST,
    CELL_REPLY,
    CELL_REQUEST,
    COMM_TYPES,
    PDB_ANSWER,
    ChannelEndpoint,
    ChannelSetup,
)
from nbdist.worker.frames import CellClassMissing, pack, unpack

__all__ = ["CELL_REPLY", "COMM_TYPES", "ChannelEndpoint", "ChannelMessage", "NotebookChannel"]

SEND_TIMEOUT_MS = 1000
CLOSE_TIMEOUT = 5.0  # seconds for the reader thread to stop (unless a widget handler hangs)


@dataclass(frozen=True, slots=True)
class ChannelMessage:
    token: str  # the cell's ("" between cells)
    rank: int
    msg: dict[str, Any]


class NotebookChannel:
    def __init__(self, key: bytes, signature_scheme: str, bind_host: str, curve: bool) -> None:
        import zmq
        from jupyter_client.session import Session

        self._zmq = zmq
        self._kernel = (os.getpid(), psutil.Process().create_time())  # this process, for good
        self.session = Session(key=key, signature_scheme=signature_scheme, check_pid=False)
        self.context = zmq.Context()
        self.bind_host = bind_host
        self.public_key, self._secret_key = zmq.curve_keypair() if curve else (None, None)
        pull = self.context.socket(zmq.PULL)
        pull.linger = 0
        pull.rcvhwm = 0  # never drop a rank's output on the notebook side
        if self._secret_key is not None:
            pull.curve_secretkey = self._secret_key
            pull.curve_server = True
        port = pull.bind_to_random_port(f"tcp://{bind_host}")
        self.address = f"tcp://{bind_host}:{port}"
        self._pull = pull  # the reader thread's, or the main thread's while it holds it
        self._held = 0  # holders on the main thread: a cell, and a call it makes meanwhile
        self._holds = 0
        self._aside: list[ChannelMessage] = []  # a running cell's, read by a call it made
        self.inbox: queue.SimpleQueue[ChannelMessage] = queue.SimpleQueue()
        self.on_comm: Any = None  # a rank's widget messages go to it (cells.widgets.WidgetRelay)
        self._dealers: dict[int, tuple[ChannelEndpoint, Any]] = {}
        self._send_lock = threading.Lock()  # the main thread, and a widget's twin from any thread
        self._tokens = itertools.count(1)
        self._prefix = f"{os.getpid()}-{id(self):x}"
        wake_address = f"inproc://nbdist-channel-{self._prefix}"
        self._wake = self.context.socket(zmq.PAIR)
        self._wake.bind(wake_address)
        woken = self.context.socket(zmq.PAIR)
        woken.connect(wake_address)
        self._reader = threading.Thread(target=self._read, args=(woken,),
                                        name="nbdist-cell-channel", daemon=True)
        self._reader.start()

    def setup_for(self, bind_host: str, ends_with_kernel: bool) -> ChannelSetup:
        """`ends_with_kernel`: the rank ends itself once this process is gone (engines nbdist
        started; never an attached cluster's)."""
        kernel = self._kernel if ends_with_kernel else None
        return ChannelSetup(self.address, bind_host, self.public_key, kernel)

    def new_token(self) -> str:
        return f"{self._prefix}-{next(self._tokens)}"

    def send_cell(self, rank: int, endpoint: ChannelEndpoint, token: str, code: str) -> None:
        """Send one cell to a rank; raises zmq.Again if the rank has stopped taking them."""
        self.send(rank, endpoint, CELL_REQUEST, {"token": token, "code": code})

    def send_answer(self, rank: int, endpoint: ChannelEndpoint, seq: str, line: str) -> None:
        self.send(rank, endpoint, PDB_ANSWER, {"seq": seq, "line": line})

    def send(self, rank: int, endpoint: ChannelEndpoint, msg_type: str, content: dict[str, Any],
             buffers: list[Any] | None = None) -> None:
        with self._send_lock:
            self.session.send(self._dealer(rank, endpoint), msg_type, content=content,
                              buffers=buffers)

    def _dealer(self, rank: int, endpoint: ChannelEndpoint) -> Any:
        known = self._dealers.get(rank)
        if known is not None and known[0] == endpoint:
            return known[1]
        if known is not None:
            known[1].close(linger=0)
        dealer = self.context.socket(self._zmq.DEALER)
        dealer.linger = 0
        dealer.sndtimeo = SEND_TIMEOUT_MS
        if endpoint.public_key is not None:
            dealer.curve_publickey, dealer.curve_secretkey = self.public_key, self._secret_key
            dealer.curve_serverkey = endpoint.public_key
        dealer.connect(endpoint.address)
        self._dealers[rank] = (endpoint, dealer)
        return dealer

    def call(self, ranks: Sequence[RankProcess], function: Callable[..., Any],
             args: tuple[Any, ...], timeout: float) -> Gathered[int]:
        """`function(*args)` (importable: it travels by name) on each rank, under one deadline;
        never raises for a rank's failure or silence. Made while a cell waits (the fault policy's
        calls to ranks done with it), it leaves the cell's messages to the cell's runner."""
        missing = [p.spec.rank for p in ranks if p.endpoint is None]
        if missing:
            raise NbdistError(f"rank(s) {missing} have no cell channel (their setup did not "
                              "finish)")
        endpoints = {p.spec.rank: p.endpoint for p in ranks}
        token = self.new_token()
        buffers = pack((function, args))
        for rank, endpoint in endpoints.items():
            self.send(rank, endpoint, CALL_REQUEST, {"token": token}, buffers)
        try:
            self.hold()
            return self._answers(token, set(endpoints), timeout)
        finally:
            self.release()

    def _answers(self, token: str, waiting: set[int], timeout: float) -> Gathered[int]:
        out: Gathered[int] = Gathered()
        deadline = time.monotonic() + timeout
        cells, aside = self._held > 1, []  # a cell waits too: its messages are kept for it
        try:
            while waiting and time.monotonic() < deadline:
                for message in self.receive(max(0.0, deadline - time.monotonic())):
                    if message.token == token and message.rank in waiting:
                        waiting.discard(message.rank)
                        self._answer(message, out)
                    elif message.token != token and cells:
                        aside.append(message)
        finally:
            self._aside = aside + self._aside
        out.failures.update({rank: f"no answer within {timeout:g} s" for rank in waiting})
        return out

    @staticmethod
    def _answer(message: ChannelMessage, out: Gathered[int]) -> None:
        content = message.msg["content"]
        if content.get("status") != "ok":
            out.failures[message.rank] = rank_error(
                content.get("ename"), content.get("evalue"), content.get("traceback"))
            return
        try:
            out.results[message.rank] = unpack(message.msg["buffers"])
        except CellClassMissing as exc:
            out.failures[message.rank] = (
                f"the value holds {exc.name}, defined in a cell on the ranks, which the notebook "
                "does not define: it could not rebuild the value. Run the same definition in a "
                "plain notebook cell too, or pull plain types (dicts, lists, tuples, tensors).")
        except Exception as exc:
            out.failures[message.rank] = f"could not rebuild the answer here: {exc!r}"

    def hold(self) -> None:
        """Read the PULL on this thread until `release` (no thread wake-up per message while a
        cell or a call waits); what the reader thread took before is in `inbox`."""
        if self._held:  # a call while a cell waits: this thread reads the PULL already
            self._held += 1
            return
        self._holds += 1
        tag = str(self._holds).encode()
        self._wake.send(b"hold " + tag)
        interrupted = False
        while True:  # the stop button waits for the answer: it comes at once
            try:
                if self._wake.recv() == tag:
                    break
            except KeyboardInterrupt:
                interrupted = True
        self._held = 1
        if interrupted:
            raise KeyboardInterrupt

    def release(self) -> None:
        self._held = max(0, self._held - 1)  # 0 too after a hold interrupted as it began
        if not self._held:
            self._wake.send(b"read")

    def receive(self, timeout: float) -> list[ChannelMessage]:
        """Whatever arrived for the cell runner within `timeout` s (as soon as something did)."""
        messages, self._aside = [*self._aside, *self._inbox()], []
        if not self._held:
            if messages or timeout <= 0:
                return messages
            try:
                return [self.inbox.get(timeout=timeout), *self.receive(0)]
            except queue.Empty:
                return []
        wait = 0 if messages else max(0, int(timeout * 1000))
        if self._pull.poll(wait):
            self._drain(messages.append)
        return messages

    def _inbox(self) -> list[ChannelMessage]:
        return [self.inbox.get_nowait() for _ in range(self.inbox.qsize())]  # one reader

    def _read(self, woken: Any) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(woken, zmq.POLLIN)
        try:
            order = b""
            while order != b"stop":
                order = woken.recv() if woken in dict(poller.poll()) else b""
                while order.startswith(b"hold "):  # the socket is the main thread's meanwhile
                    woken.send(order[5:])
                    order = woken.recv()
                self._drain(self.inbox.put)
        finally:
            self._pull.close(linger=0)
            woken.close(linger=0)

    def _drain(self, deliver: Callable[[ChannelMessage], None]) -> None:
        """Every message waiting on the PULL: a widget's to `on_comm`, a cell's to `deliver`."""
        zmq = self._zmq
        while True:
            try:
                frames = self._pull.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:  # zmq Frames, not bytes: a pulled tensor keeps the frame's memory, uncopied
                idents, msg_list = self.session.feed_identities(frames, copy=False)
                msg = self.session.deserialize(msg_list, content=True, copy=False)
                message = ChannelMessage(idents[0].decode(), int(idents[1]), msg)
            except Exception:  # unsigned, replayed or malformed: not from this cluster's ranks
                continue
            if msg["header"]["msg_type"] not in COMM_TYPES:
                if message.token:
                    deliver(message)
            elif (handler := self.on_comm) is not None:
                try:
                    handler(message)
                except Exception as exc:  # a widget's trouble never stops the channel
                    print(f"nbdist: rank {message.rank}'s widget message failed here: {exc!r}",
                          file=sys.__stderr__)

    def close(self) -> None:
        """Close it after the ranks stopped: those nbdist started end themselves once the PULL
        is gone (and, on this machine, the kernel)."""
        self._wake.send(b"stop")
        self._reader.join(CLOSE_TIMEOUT)
        if self.on_comm is not None:
            self.on_comm.close()
        for _endpoint, dealer in self._dealers.values():
            dealer.close(linger=0)
        self._dealers.clear()
        self._wake.close(linger=0)
        if not self._reader.is_alive():
            self.context.term()


def open_channel(channel: NotebookChannel | None, client: Any, bind_host: str,
                 curve: bool) -> NotebookChannel:
    """`channel` if it listens on `bind_host` with that encryption, else a new one signed with
    the ipyparallel client's key."""
    if channel is not None:
        if channel.bind_host == bind_host and (channel.public_key is not None) == curve:
            return channel
        channel.close()
    return NotebookChannel(client.session.key, client.session.signature_scheme, bind_host, curve)

