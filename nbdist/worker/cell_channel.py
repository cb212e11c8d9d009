"""A rank's end of the cell channel (the notebook's: nbdist.cluster.cell_channel): cells, calls,
pdb answers and widget messages come in on a signed ROUTER; what a cell publishes on IOPub, call
results and widget messages go out on a PUSH. A cell runs through the engine's own shell."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from nbdist import ipp_compat
from nbdist.worker import orphan_guard
from nbdist.worker.frames import pack, unpack

CELL_REQUEST = "nbdist_cell"
CELL_REPLY = "nbdist_reply"
CALL_REQUEST = "nbdist_call"
CALL_REPLY = "nbdist_call_reply"
PDB_ANSWER = "nbdist_pdb_answer"
COMM_TYPES = ("comm_open", "comm_msg", "comm_close")
NO_CELL = b""  # the token of a message sent while no cell runs (a widget's)
ANSWER_POLL_MS = 1000  # one wait for a pdb answer (a SIGINT ends it)


@dataclass(frozen=True)
class ChannelSetup:
    """What the notebook tells a rank about the channel, in its (signed) setup call."""

    notebook_address: str  # the notebook's PULL, where the rank's PUSH connects
    bind_host: str  # where the rank's ROUTER listens: loopback on one host, else its address
    notebook_key: bytes | None = None  # the notebook's CurveZMQ public key; None: not encrypted
    notebook_process: tuple[int, float] | None = None
    """The kernel's (pid, create time): the rank ends itself once it is gone (orphan_guard).
    None for engines nbdist did not start: they live on."""


@dataclass(frozen=True)
class ChannelEndpoint:
    """Where a rank takes requests, as its setup reports it."""

    address: str  # "tcp://HOST:PORT" of the rank's ROUTER
    public_key: bytes | None = None  # its CurveZMQ public key (None: not encrypted)


class CellServer:
    def __init__(self, rank: int, setup: ChannelSetup, orphan_grace: float) -> None:
        import zmq
        from IPython import get_ipython
        from jupyter_client.session import Session
        from tornado.ioloop import IOLoop
        from zmq.eventloop.zmqstream import ZMQStream

        self.shell = get_ipython()
        kernel = self.shell.kernel.session
        self.session = Session(key=kernel.key, signature_scheme=kernel.signature_scheme,
                               check_pid=False)
        self.rank = rank
        self.setup = setup
        context = zmq.Context.instance()
        public, secret = zmq.curve_keypair() if setup.notebook_key else (None, None)
        self.requests = context.socket(zmq.ROUTER)
        self.out = context.socket(zmq.PUSH)
        for socket in (self.requests, self.out):
            socket.linger = 0
            if secret is not None:
                socket.curve_publickey, socket.curve_secretkey = public, secret
        if secret is not None:
            self.requests.curve_server = True
            self.out.curve_serverkey = setup.notebook_key
        port = self.requests.bind_to_random_port(f"tcp://{setup.bind_host}")
        self.endpoint = ChannelEndpoint(f"tcp://{setup.bind_host}:{port}", public)
        self.out.sndhwm = 100_000
        if setup.notebook_process is not None:  # watched from before its first connection
            orphan_guard.guard(self.out, setup.notebook_process, orphan_grace)
        self.out.connect(setup.notebook_address)
        self.out_lock = threading.Lock()
        self.loop = IOLoop.current()
        self.idents: list[bytes] | None = None  # the running cell's token and rank
        self.waiting: list[dict[str, Any]] = []  # requests that came while a cell ran
        self.stream = ZMQStream(self.requests, self.loop)
        self.stream.on_recv(lambda frames: self._dispatch(self._parse(frames)), copy=False)
        self.iopub = ipp_compat.iopub_thread()
        ipp_compat.divert_iopub(self.iopub, self._forward)

    def close(self) -> None:
        ipp_compat.restore_iopub(self.iopub)
        self.stream.close(linger=0)
        with self.out_lock:
            self.out.disable_monitor()  # closed here on purpose: the guard (if any) stops first
            self.out.close(linger=0)

    def send_multipart(self, parts: list[Any], copy: bool = True) -> None:
        """The PUSH, from the main, IOPub and telemetry threads: one at a time, never blocking (a
        notebook that stopped listening loses the message, not the rank)."""
        import zmq

        with self.out_lock, contextlib.suppress(zmq.Again):
            # Session.send asks for no copy when a frame is large (a pulled tensor)
            self.out.send_multipart(parts, flags=zmq.NOBLOCK, copy=copy)

    def _parse(self, frames: list[Any]) -> dict[str, Any] | None:
        try:  # zmq Frames: a pushed tensor is not copied
            _idents, msg_list = self.session.feed_identities(frames, copy=False)
            return self.session.deserialize(msg_list, copy=False)
        except Exception as exc:  # unsigned or malformed: not from this cluster's notebook
            print(f"nbdist: refused a request on the cell channel: {exc}", file=sys.__stderr__)
            return None

    def _dispatch(self, request: dict[str, Any] | None) -> None:
        kind = request["header"]["msg_type"] if request is not None else None
        if kind in COMM_TYPES:  # from the notebook's twin of a widget to the rank's own
            from comm import get_comm_manager

            try:
                getattr(get_comm_manager(), kind)(None, None, request)
            except Exception as exc:
                print(f"nbdist: a widget message failed on this rank: {exc!r}",
                      file=sys.__stderr__)
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
        with contextlib.suppress(Exception):  # run_cell reports a cell that does not transform
            transformed = self.shell.transform_cell(code)
            if self.shell.should_run_async(code, transformed_cell=transformed,
                                           preprocessing_exc_tuple=None):
                asyncio.ensure_future(self._run_async(code, transformed))  # top-level await
                return
        try:
            with _interruptible(None):
                reply = _reply(self.shell.run_cell(code, store_history=True, silent=False), False)
        except BaseException as exc:  # nbdist's own failure (run_cell catches the cell's)
            reply = _failed(exc)
        self._finish(reply)

    async def _run_async(self, code: str, transformed: str) -> None:
        result = None
        try:
            with _interruptible(asyncio.current_task()) as interrupted:
                try:
                    result = await self.shell.run_cell_async(
                        code, store_history=True, silent=False, transformed_cell=transformed,
                        preprocessing_exc_tuple=None)
                finally:  # run_cell triggers these around run_cell_async: the rank's hooks
                    self.shell.events.trigger("post_execute")
                    self.shell.events.trigger("post_run_cell", result)
            reply = _reply(result, interrupted[0])
        except BaseException as exc:
            reply = _failed(exc)
        self._finish(reply)

    def _call(self, request: dict[str, Any]) -> None:
        content = request["content"]
        buffers: list[Any] = []
        try:
            # a pushed tensor goes to the rank's device (`device`, as its cells see it)
            function, args = unpack(request["buffers"], self.shell.user_ns.get("device"))
            buffers = pack(function(*args))
            reply: dict[str, Any] = {"status": "ok"}
        except Exception as exc:
            reply = {"status": "error", "ename": type(exc).__name__, "evalue": str(exc),
                     "traceback": traceback.format_exc(limit=-6)}
        idents = [str(content["token"]).encode(), str(self.rank).encode()]
        self.session.send(self, CALL_REPLY, content=reply, buffers=buffers, ident=idents)

    def _finish(self, reply: dict[str, Any]) -> None:
        """Every output the cell made, then its reply (one socket: they arrive in that order)."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()  # ipykernel's OutStream waits for its IOPub thread to send
        idents, self.idents = self.idents, None
        self.session.send(self, CELL_REPLY, content=reply, ident=idents)
        waiting, self.waiting = self.waiting, []
        for request in waiting:  # in order, each on a later turn of the loop
            self.loop.add_callback(self._dispatch, request)

    def wait_for_answer(self, seq: str) -> str:
        """The notebook's answer to pdb prompt `seq`, read here on the main thread: the loop
        that would read it is the one the stopped cell holds."""
        import zmq

        while True:
            if not self.requests.poll(ANSWER_POLL_MS):
                continue
            request = self._parse(self.requests.recv_multipart(zmq.NOBLOCK, copy=False))
            if request is None:
                continue
            if request["header"]["msg_type"] != PDB_ANSWER:
                self.waiting.append(request)  # a widget's message: after the cell
            elif request["content"].get("seq") == seq:
                return str(request["content"].get("line", "c"))

    def _forward(self, parts: list[Any], *args: Any, **kwargs: Any) -> None:
        """The IOPub thread's send: a cell's messages and any widget's to the notebook, the rest
        (output between cells, from threads a cell left behind) to ipyparallel as before."""
        idents = self.idents
        if idents is None and bytes(parts[0]).startswith(b"comm-"):
            idents = [NO_CELL, str(self.rank).encode()]
        if idents is None:
            ipp_compat.iopub_send(self.iopub, parts, *args, **kwargs)
            return
        self.send_multipart([*idents, *parts])


@contextlib.contextmanager
def _interruptible(task: asyncio.Task[Any] | None) -> Iterator[list[bool]]:
    """As ipykernel does around each request: SIGINT raises KeyboardInterrupt only while a cell
    runs Python; while a cell's task awaits (the loop waits in select), it cancels the task."""
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


SERVER: CellServer | None = None  # this engine's, once a setup opened it


def open_channel(rank: int, setup: ChannelSetup, orphan_grace: float) -> ChannelEndpoint:
    """Listen for cells: once per engine, anew for a new setup (a new notebook-side cluster)."""
    global SERVER
    if SERVER is not None and SERVER.setup != setup:
        SERVER.close()
        SERVER = None
    if SERVER is None:
        SERVER = CellServer(rank, setup, orphan_grace)
    SERVER.rank = rank
    return SERVER.endpoint
