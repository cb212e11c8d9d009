"""A rank's end of the cell channel: the one way the notebook talks to a rank's shell, on every
host. Cells, pdb answers and widget messages come in on a ROUTER; what a cell produces and the
rank's widget messages go out on a PUSH to the notebook (its end: nbdist.cluster.cell_channel).

A cell runs through the engine's own IPython shell (`run_cell`: history, hooks, tracebacks, the
stop button's SIGINT) on the engine's event loop, in the main thread, between ipyparallel's
messages; a cell with top-level await runs there as a task. Its output is the very messages
ipykernel publishes (stream, display_data, execute_result, error, data_message, comm_*): the
engine's IOPub thread hands them to the channel while a cell runs, and a widget's (comm)
messages at any time. Every message is signed with the cluster's key, both ways; across hosts
the sockets are also CurveZMQ-encrypted. Push and pull are calls on the channel too (`CALLS`);
ipyparallel still launches, registers and watches the engine, and carries the other calls
between cells (setup, process-group rebuilds, reports).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from nbdist import ipp_compat
from nbdist.worker.frames import pack, unpack

CELL_REQUEST = "nbdist_cell"
CELL_REPLY = "nbdist_reply"
CALL_REQUEST = "nbdist_call"
CALL_REPLY = "nbdist_call_reply"
PDB_ANSWER = "nbdist_pdb_answer"
COMM_TYPES = ("comm_open", "comm_msg", "comm_close")
NO_CELL = b""
"""The token of a message sent while no cell runs (a widget's)."""

CALLS: dict[str, Callable[..., Any]] = {}
"""The functions a call on the channel may name (push, pull: `nbdist.worker.bootstrap`)."""

ANSWER_POLL_MS = 1000
"""While pdb waits for an answer: how long one wait for the channel lasts (a SIGINT ends it)."""


@dataclass(frozen=True)
class ChannelSetup:
    """What the notebook tells a rank about the channel, in its (signed) setup call."""

    notebook_address: str
    """Where the rank's PUSH connects: the notebook's PULL ("tcp://10.0.0.1:41000")."""
    bind_host: str
    """The address the rank's ROUTER listens on: loopback on one host, else the rank's address
    on the network that reaches the notebook."""
    notebook_key: bytes | None = None
    """The notebook's CurveZMQ public key; None: signed, not encrypted."""


@dataclass(frozen=True)
class ChannelEndpoint:
    """Where a rank takes requests, as its setup reports it."""

    address: str
    """"tcp://HOST:PORT" of the rank's ROUTER."""
    public_key: bytes | None = None
    """The rank's CurveZMQ public key (None: not encrypted)."""


class _Locked:
    """The PUSH socket, sent on from several threads (main, IOPub, telemetry): one at a time,
    never blocking the rank (a notebook that stopped listening loses the message, not the rank)."""

    def __init__(self, socket: Any) -> None:
        import zmq

        self.socket = socket
        self.lock = threading.Lock()
        self.dropped = 0
        self._again = zmq.Again
        self._noblock = zmq.NOBLOCK

    def send_multipart(self, parts: list[Any], *_args: Any, **_kwargs: Any) -> None:
        with self.lock:
            try:
                # Session.send asks for no copy when a frame is large (a pulled tensor)
                self.socket.send_multipart(parts, flags=self._noblock,
                                           copy=_kwargs.get("copy", True))
            except self._again:
                self.dropped += 1

    def replace(self, socket: Any) -> None:
        with self.lock:
            self.socket.close(linger=0)
            self.socket = socket


class CellServer:
    """The engine's end of the channel (one per engine, made by :func:`open_channel`)."""

    def __init__(self, rank: int, setup: ChannelSetup) -> None:
        import zmq
        from IPython import get_ipython
        from jupyter_client.session import Session
        from tornado.ioloop import IOLoop
        from zmq.eventloop.zmqstream import ZMQStream

        self.shell = get_ipython()
        kernel_session = self.shell.kernel.session
        self.session = Session(key=kernel_session.key, signature_scheme=kernel_session.signature_scheme,
                               check_pid=False)
        self.rank = rank
        self.setup = setup
        self.context = zmq.Context.instance()
        self.public_key, self._secret_key = (zmq.curve_keypair() if setup.notebook_key
                                             else (None, None))
        self.requests = self._socket(zmq.ROUTER)
        if self._secret_key is not None:
            self.requests.curve_server = True
        port = self.requests.bind_to_random_port(f"tcp://{setup.bind_host}")
        self.endpoint = ChannelEndpoint(f"tcp://{setup.bind_host}:{port}", self.public_key)
        self.out = _Locked(self._push(setup))
        self.loop = IOLoop.current()
        self.idents: list[bytes] | None = None  # the running cell's token and rank
        self.waiting: list[dict[str, Any]] = []  # requests that came while a cell ran
        self.stream = ZMQStream(self.requests, self.loop)
        self.stream.on_recv(self._on_request, copy=False)
        self.iopub = ipp_compat.iopub_thread()
        ipp_compat.divert_iopub(self.iopub, self._forward)

    def _socket(self, kind: int) -> Any:
        socket = self.context.socket(kind)
        socket.linger = 0
        if self._secret_key is not None:
            socket.curve_publickey, socket.curve_secretkey = self.public_key, self._secret_key
        return socket

    def _push(self, setup: ChannelSetup) -> Any:
        import zmq

        out = self._socket(zmq.PUSH)
        out.sndhwm = 100_000
        if setup.notebook_key is not None:
            out.curve_serverkey = setup.notebook_key
        out.connect(setup.notebook_address)
        return out

    def compatible(self, setup: ChannelSetup) -> bool:
        """Whether this server can serve a new setup (same address, same encryption)."""
        return (setup.bind_host == self.setup.bind_host
                and (setup.notebook_key is None) == (self.public_key is None))

    def retarget(self, rank: int, setup: ChannelSetup) -> None:
        """A new cluster object in the notebook (a restart or an attach keeps this engine)."""
        self.rank = rank
        if setup != self.setup:
            self.out.replace(self._push(setup))
            self.setup = setup

    def close(self) -> None:
        ipp_compat.restore_iopub(self.iopub)
        self.stream.close(linger=0)
        with self.out.lock:
            self.out.socket.close(linger=0)

    # ------------------------------------------------------------------ requests
    def _parse(self, frames: list[Any]) -> dict[str, Any] | None:
        try:
            copy = isinstance(frames[0], bytes)  # zmq Frames: a pushed tensor is not copied
            _idents, msg_list = self.session.feed_identities(frames, copy=copy)
            return self.session.deserialize(msg_list, copy=copy)
        except Exception as exc:  # unsigned or malformed: not from this cluster's notebook
            print(f"nbdist: refused a request on the cell channel: {exc}", file=sys.__stderr__)
            return None

    def _on_request(self, frames: list[Any]) -> None:
        request = self._parse(frames)
        if request is not None:
            self._dispatch(request)

    def _dispatch(self, request: dict[str, Any]) -> None:
        kind = request["header"]["msg_type"]
        if kind in COMM_TYPES:
            _deliver_comm(kind, request)
        elif kind in (CELL_REQUEST, CALL_REQUEST) and self.idents is not None:
            self.waiting.append(request)  # an await cell still runs: this one goes next
        elif kind == CELL_REQUEST:
            self._start_cell(request["content"])
        elif kind == CALL_REQUEST:
            self._call(request)
        # a pdb answer nobody waits for any more (the cell ended): dropped

    def _start_cell(self, content: dict[str, Any]) -> None:
        self.idents = [str(content["token"]).encode(), str(self.rank).encode()]
        code = str(content["code"])
        transformed = self._needs_loop(code)
        if transformed is not None:  # top-level await: a task on the engine's loop
            asyncio.ensure_future(self._run_async(code, transformed))
            return
        try:
            with _interruptible(None):
                reply = _reply(self.shell.run_cell(code, store_history=True, silent=False), False)
        except BaseException as exc:  # nbdist's own failure, never the cell's (run_cell catches those)
            reply = _failed(exc)
        self._finish(reply)

    async def _run_async(self, code: str, transformed: str) -> None:
        try:
            with _interruptible(asyncio.current_task()) as interrupted:
                result = await self.shell.run_cell_async(
                    code, store_history=True, silent=False, transformed_cell=transformed,
                    preprocessing_exc_tuple=None)
            reply = _reply(result, interrupted[0])
        except BaseException as exc:
            reply = _failed(exc)
        self._finish(reply)

    def _call(self, request: dict[str, Any]) -> None:
        """A call between cells (push, pull): its result or error back, under its token."""
        content = request["content"]
        buffers: list[Any] = []
        try:
            buffers = pack(CALLS[str(content["name"])](*unpack(request["buffers"])))
            reply: dict[str, Any] = {"status": "ok"}
        except Exception as exc:
            reply = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc)}
        idents = [str(content["token"]).encode(), str(self.rank).encode()]
        self.session.send(self.out, CALL_REPLY, content=reply, buffers=buffers, ident=idents)

    def _needs_loop(self, code: str) -> str | None:
        """The transformed cell when it has top-level await (IPython's own test), else None."""
        try:
            transformed = self.shell.transform_cell(code)
            if self.shell.should_run_async(code, transformed_cell=transformed,
                                           preprocessing_exc_tuple=None):
                return str(transformed)
        except Exception:  # run_cell reports it
            pass
        return None

    def _finish(self, reply: dict[str, Any]) -> None:
        """Every output the cell made, then its reply (one socket: they arrive in that order)."""
        _flush()
        idents, self.idents = self.idents, None
        self.session.send(self.out, CELL_REPLY, content=reply, ident=idents)
        waiting, self.waiting = self.waiting, []
        for request in waiting:  # in order, each on a later turn of the loop
            self.loop.add_callback(self._dispatch, request)

    def wait_for_answer(self, seq: str) -> str:
        """The notebook's answer to pdb prompt `seq` (on the main thread, while the cell that
        stopped runs: the loop cannot read the channel, so this reads it itself)."""
        import zmq

        poller = zmq.Poller()
        poller.register(self.requests, zmq.POLLIN)
        while True:
            if not poller.poll(ANSWER_POLL_MS):
                continue
            frames = self.requests.recv_multipart(zmq.NOBLOCK)
            request = self._parse(frames)
            if request is None:
                continue
            content = request["content"]
            if request["header"]["msg_type"] != PDB_ANSWER:
                self.waiting.append(request)  # a widget's message: after the cell
            elif content.get("seq") == seq:
                return str(content.get("line", "c"))

    # ------------------------------------------------------------------ output
    def _forward(self, parts: list[Any], *args: Any, **kwargs: Any) -> None:
        """The IOPub thread's send: a cell's messages and any widget's to the notebook, the rest
        (output between cells, from threads a cell left behind) to ipyparallel as before."""
        idents = self.idents
        if idents is None and bytes(parts[0]).startswith(b"comm-"):
            idents = [NO_CELL, str(self.rank).encode()]
        if idents is None:
            ipp_compat.iopub_send(self.iopub, parts, *args, **kwargs)
            return
        self.out.send_multipart([*idents, *parts])


def _deliver_comm(kind: str, request: dict[str, Any]) -> None:
    """A message from the notebook's twin of a widget to the rank's own (as ipykernel would)."""
    from comm import get_comm_manager

    try:
        getattr(get_comm_manager(), kind)(None, None, request)
    except Exception as exc:
        print(f"nbdist: a widget message failed on this rank: {exc!r}", file=sys.__stderr__)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # ipykernel's OutStream waits for its IOPub thread to send
        except Exception:
            pass


@contextlib.contextmanager
def _interruptible(task: asyncio.Task[Any] | None) -> Iterator[list[bool]]:
    """As ipykernel does around each request: the stop button's SIGINT raises KeyboardInterrupt
    only while a cell runs. For a cell running as a task, only while that task runs Python; while
    it awaits (the loop waits in select), SIGINT cancels it, and the loop goes on."""
    interrupted = [False]

    def on_sigint(signum: int, frame: Any) -> None:
        if task is None or asyncio.current_task(task.get_loop()) is task:
            raise KeyboardInterrupt
        interrupted[0] = True
        task.get_loop().call_soon_threadsafe(task.cancel)

    saved = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, saved)


def _reply(result: Any, interrupted: bool) -> dict[str, Any]:
    error = result.error_before_exec or result.error_in_exec
    if error is None:
        return {"status": "ok"}
    if interrupted and isinstance(error, asyncio.CancelledError):  # the stop button, awaiting
        return {"status": "error", "ename": "KeyboardInterrupt", "evalue": "", "traceback": [],
                "interrupted": True}
    return {"status": "error", "ename": type(error).__name__, "evalue": str(error), "traceback": []}


def _failed(exc: BaseException) -> dict[str, Any]:
    return {"status": "error", "ename": "NbdistError", "traceback": [],
            "evalue": f"the cell channel failed: {type(exc).__name__}: {exc}"}


_SERVER: CellServer | None = None


def open_channel(rank: int, setup: ChannelSetup) -> ChannelEndpoint:
    """Listen for cells (once per engine, again when the address or encryption changes);
    returns where."""
    global _SERVER
    if _SERVER is not None and not _SERVER.compatible(setup):
        _SERVER.close()
        _SERVER = None
    if _SERVER is None:
        _SERVER = CellServer(rank, setup)
    else:
        _SERVER.retarget(rank, setup)
    return _SERVER.endpoint


def server() -> CellServer | None:
    """This engine's end of the channel, once set up."""
    return _SERVER
