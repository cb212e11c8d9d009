"""The notebook's end of the cell channel: one PULL for what every rank sends, one DEALER per
rank; a reader thread hands widget messages to `on_comm` at once and the rest to the cell runner,
each read into its `nbdist.protocol` class. Messages carry the cell's token and the rank, so a
given-up cell's late output is dropped."""

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
from nbdist.protocol.frames import CellClassMissing
from nbdist.protocol.handshake import ChannelEndpoint, ChannelSetup
from nbdist.protocol.wire import (
    COMM_TAGS,
    Call,
    CallReply,
    Comm,
    Malformed,
    Message,
    ProtocolError,
    decode,
)

__all__ = ["ChannelEndpoint", "ChannelMessage", "NotebookChannel"]

SEND_TIMEOUT_MS = 1000
CLOSE_TIMEOUT = 5.0  # seconds for the reader thread to stop (unless a widget handler hangs)


@dataclass(frozen=True, slots=True)
class ChannelMessage:
    token: str  # the cell's ("" between cells)
    rank: int
    body: Any  # a protocol message (`nbdist.protocol.wire`), a `Comm`, or `Malformed`


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
        self._dealers: dict[tuple[int, bool], tuple[ChannelEndpoint, Any]] = {}
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

    def send_message(self, rank: int, endpoint: ChannelEndpoint, message: Message) -> None:
        """One protocol message to a rank; raises zmq.Again if the rank has stopped taking them
        (a cell: `Cell`; a pdb answer: `Answer`)."""
        self.send(rank, endpoint, *message.to_wire())

    def send(self, rank: int, endpoint: ChannelEndpoint, msg_type: str, content: dict[str, Any],
             buffers: list[Any] | None = None, service: bool = False) -> None:
        """Encoded already: a protocol message's wire form, or a widget's comm message; a call
        (`service`) to the rank service's own socket."""
        with self._send_lock:
            self.session.send(self._dealer(rank, endpoint, service), msg_type, content=content,
                              buffers=buffers)

    def _dealer(self, rank: int, endpoint: ChannelEndpoint, service: bool) -> Any:
        known = self._dealers.get((rank, service))
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
        dealer.connect(endpoint.service_address if service and endpoint.service_address
                       else endpoint.address)
        self._dealers[rank, service] = (endpoint, dealer)
        return dealer

    def call(self, ranks: Sequence[RankProcess], command: str, args: tuple[Any, ...],
             timeout: float) -> Gathered[int]:
        """The rank service's `command` with `args` on each rank, under one deadline; never
        raises for a rank's failure, refusal or silence. Made while a cell waits (the fault
        policy's calls to ranks done with it), it leaves the cell's messages to the cell's
        runner."""
        missing = [p.spec.rank for p in ranks if p.endpoint is None]
        if missing:
            raise NbdistError(f"rank(s) {missing} have no cell channel (their setup did not "
                              "finish)")
        endpoints = {p.spec.rank: p.endpoint for p in ranks}
        token = self.new_token()
        wire = Call(token, command, tuple(args)).to_wire()
        for rank, endpoint in endpoints.items():
            service = command not in endpoint.main_thread_commands  # unknown: refused at once
            self.send(rank, endpoint, *wire, service=service)
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
        reply = message.body
        if isinstance(reply, CallReply) and reply.error is None:
            out.results[message.rank] = reply.value
        elif isinstance(reply, CallReply):
            out.failures[message.rank] = rank_error(*reply.error)
        elif isinstance(reply, Malformed):
            out.failures[message.rank] = reply.reason
        else:
            out.failures[message.rank] = (f"the rank answered the call with a "
                                          f"{type(reply).__name__}, not a CallReply")

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
                token, rank = idents[0].decode(), int(idents[1])
            except Exception:  # unsigned, replayed or malformed: not from this cluster's ranks
                continue
            message = ChannelMessage(token, rank, _read(msg))
            if not isinstance(message.body, Comm):
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


def _read(msg: dict[str, Any]) -> Any:
    """A signed message as its protocol class; one this end cannot read as `Malformed`, handed
    on like the rest so that whoever waits for it hears why."""
    tag = msg["header"]["msg_type"]
    if tag in COMM_TAGS:
        return Comm(tag, msg)
    try:
        return decode(tag, msg["content"], msg["buffers"])
    except CellClassMissing as exc:
        return Malformed(tag, (
            f"the value holds {exc.name}, defined in a cell on the ranks, which the notebook "
            "does not define: it could not rebuild the value. Run the same definition in a "
            "plain notebook cell too, or pull plain types (dicts, lists, tuples, tensors)."))
    except ProtocolError as exc:
        return Malformed(tag, f"the notebook could not read the rank's message: {exc}")


def open_channel(channel: NotebookChannel | None, client: Any, bind_host: str,
                 curve: bool) -> NotebookChannel:
    """`channel` if it listens on `bind_host` with that encryption, else a new one signed with
    the ipyparallel client's key."""
    if channel is not None:
        if channel.bind_host == bind_host and (channel.public_key is not None) == curve:
            return channel
        channel.close()
    return NotebookChannel(client.session.key, client.session.signature_scheme, bind_host, curve)

