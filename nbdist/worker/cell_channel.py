"""A rank's end of the cell channel (the notebook's: nbdist.cluster.cell_channel): cells, calls,
pdb answers and widget messages (`nbdist.protocol`) come in on a signed ROUTER that the rank
service's thread reads; what a cell publishes on IOPub, its pdb prompts, call results and widget
messages go out on a PUSH. A cell runs through the engine's own shell, on the main thread."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

from nbdist import ipp_compat
from nbdist.protocol.handshake import ChannelEndpoint, ChannelSetup
from nbdist.protocol.wire import (
    COMM_TAGS,
    Answer,
    Call,
    CallReply,
    Cell,
    CellDone,
    Comm,
    Message,
    ProtocolError,
    Telemetry,
    decode,
)
from nbdist.worker import orphan_guard
from nbdist.worker.rank_service import (
    COMMANDS,
    UnknownCommand,
    lookup,
    no_tracing,
    untraced,
)

__all__ = ["CellServer", "ChannelEndpoint", "ChannelSetup", "open_channel"]

NO_CELL = b""  # the token of a message sent while no cell runs (a widget's)
ANSWER_POLL_MS = 1000  # one wait for a pdb answer (a SIGINT ends it)
STOP_TIMEOUT = 5.0  # seconds for the service thread to stop


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
        self.requests = context.socket(zmq.ROUTER)  # cells, pdb answers, widgets: main thread
        self.calls = context.socket(zmq.ROUTER)  # the rank service's: its thread's alone
        self.out = context.socket(zmq.PUSH)
        for socket in (self.requests, self.calls, self.out):
            socket.linger = 0
            if secret is not None:
                socket.curve_publickey, socket.curve_secretkey = public, secret
        if secret is not None:
            self.requests.curve_server = self.calls.curve_server = True
            self.out.curve_serverkey = setup.notebook_key
        where = f"tcp://{setup.bind_host}"
        self.endpoint = ChannelEndpoint(
            f"{where}:{self.requests.bind_to_random_port(where)}", public,
            f"{where}:{self.calls.bind_to_random_port(where)}",
            tuple(sorted(name for name, c in COMMANDS.items() if c.main_thread)))
        self.out.sndhwm = 100_000
        if setup.notebook_process is not None:  # watched from before its first connection
            orphan_guard.guard(self.out, setup.notebook_process, orphan_grace)
        self.out.connect(setup.notebook_address)
        self.out_lock = threading.Lock()
        self.loop = IOLoop.current()
        self.idents: list[bytes] | None = None  # the running cell's token and rank
        self.waiting: list[Any] = []  # cells and calls that came while an await cell ran
        self.stream = ZMQStream(self.requests, self.loop)
        self.stream.on_recv(lambda frames: self._on_request(self._parse(frames)), copy=False)
        self._wake = context.socket(zmq.PAIR)
        wake_address = f"inproc://nbdist-rank-service-{id(self):x}"
        self._wake.bind(wake_address)
        woken = context.socket(zmq.PAIR)
        woken.connect(wake_address)
        self.service = untraced(threading.Thread(target=self._serve, args=(woken,),
                                                 name="nbdist-rank-service", daemon=True))
        self.service.start()
        self.iopub = ipp_compat.iopub_thread()
        ipp_compat.divert_iopub(self.iopub, self._forward)

    def close(self) -> None:
        ipp_compat.restore_iopub(self.iopub)
        self.stream.close(linger=0)
        self._wake.send(b"stop")
        self.service.join(STOP_TIMEOUT)
        self._wake.close(linger=0)
        with self.out_lock:
            self.out.disable_monitor()  # closed here on purpose: the guard (if any) stops first
            self.out.close(linger=0)

    def send_multipart(self, parts: list[Any], copy: bool = True) -> None:
        """The PUSH, from the main, IOPub, service and telemetry threads: one at a time, never
        blocking (a notebook that stopped listening loses the message, not the rank)."""
        import zmq

        with self.out_lock, contextlib.suppress(zmq.Again):
            # Session.send asks for no copy when a frame is large (a pulled tensor)
            self.out.send_multipart(parts, flags=zmq.NOBLOCK, copy=copy)

    def send(self, message: Message, token: bytes | str | None = None,
             wire: tuple[str, dict[str, Any], list[Any]] | None = None) -> None:
        """One protocol message (or its `wire` form, encoded already) to the notebook, under the
        running cell's token (or `token`)."""
        tag, content, buffers = wire or message.to_wire()
        if token is None:
            idents = self.idents or [NO_CELL, str(self.rank).encode()]
        else:
            idents = [token.encode() if isinstance(token, str) else token,
                      str(self.rank).encode()]
        self.session.send(self, tag, content=content, buffers=buffers, ident=idents)

    def _parse(self, frames: list[Any]) -> dict[str, Any] | None:
        try:  # zmq Frames: a pushed tensor is not copied
            _idents, msg_list = self.session.feed_identities(frames, copy=False)
            return self.session.deserialize(msg_list, copy=False)
        except Exception as exc:  # unsigned or malformed: not from this cluster's notebook
            print(f"nbdist: refused a request on the cell channel: {exc}", file=sys.__stderr__)
            return None

    # ------------------------------------------------------------ the service thread
    def _serve(self, woken: Any) -> None:
        """Reads the calls: answers service commands here, hands main-thread ones to the loop."""
        import zmq

        no_tracing()
        poller = zmq.Poller()
        poller.register(self.calls, zmq.POLLIN)
        poller.register(woken, zmq.POLLIN)
        try:
            while woken not in dict(poller.poll()):
                while True:
                    try:
                        request = self._parse(self.calls.recv_multipart(zmq.NOBLOCK, copy=False))
                    except zmq.Again:
                        break
                    try:
                        if request is not None:
                            self._route_call(request)
                    except Exception as exc:  # the service must outlive one bad request
                        print(f"nbdist: rank {self.rank}'s service failed on a request: {exc!r}",
                              file=sys.__stderr__)
        finally:
            self.calls.close(linger=0)
            woken.close(linger=0)

    def _route_call(self, request: dict[str, Any]) -> None:
        tag = request["header"]["msg_type"]
        if tag != Call.TAG:
            self._refuse(tag, request["content"], f"a {tag} message is not a call")
            return
        try:
            main_thread = lookup(str(request["content"].get("command"))).main_thread
        except LookupError:
            main_thread = False  # refused here, at once
        if main_thread:
            self.loop.add_callback(self._dispatch, request)
        else:
            self._call(request)

    def _refuse(self, tag: str, content: Any, reason: str) -> None:
        """A request this rank cannot read: said on stderr, and to whoever waits for its reply."""
        print(f"nbdist: rank {self.rank} could not read a request: {reason}", file=sys.__stderr__)
        token = content.get("token") if isinstance(content, dict) else None
        if token is not None:
            error = ["ProtocolError", f"rank {self.rank} could not read the request: {reason}"]
            reply: Message = (CellDone("error", *error) if tag == Cell.TAG
                              else CallReply([*error, ""]))
            self.send(reply, str(token))

    # ------------------------------------------------------------ the engine's loop
    def _read_request(self, request: dict[str, Any]) -> Any:
        """A request to the main thread as its protocol class (a call stays whole: it is read
        where it runs); None for one refused."""
        tag, content = request["header"]["msg_type"], request["content"]
        if tag in COMM_TAGS:  # from the notebook's twin of a widget to the rank's own
            return Comm(tag, request)
        if tag == Call.TAG:
            return request
        try:
            message = decode(tag, content, request["buffers"])
            if not isinstance(message, (Cell, Answer)):
                raise ProtocolError(f"a {tag} message is not a request")
            return message
        except ProtocolError as exc:
            self._refuse(tag, content, str(exc))
            return None

    def _on_request(self, request: dict[str, Any] | None) -> None:
        message = None if request is None else self._read_request(request)
        if message is not None and not isinstance(message, Answer):
            self._dispatch(message)  # a pdb answer nobody waits for any more: dropped

    def _dispatch(self, request: Any) -> None:
        if isinstance(request, Comm):
            from comm import get_comm_manager

            try:
                getattr(get_comm_manager(), request.kind)(None, None, request.msg)
            except Exception as exc:
                print(f"nbdist: a widget message failed on this rank: {exc!r}",
                      file=sys.__stderr__)
        elif self.idents is not None:
            self.waiting.append(request)  # an await cell still runs: this one goes next
        elif isinstance(request, Cell):
            self._start_cell(request)
        else:
            self._call(request)

    def _start_cell(self, cell: Cell) -> None:
        self.idents = [cell.token.encode(), str(self.rank).encode()]
        code = cell.code
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
        """A command, by name: its value or its error back under the call's token."""
        content = request["content"]
        try:
            # a pushed tensor goes to the rank's device (`device`, as its cells see it)
            call = decode(Call.TAG, content, request["buffers"], self.shell.user_ns.get("device"))
            reply = CallReply(value=lookup(call.command).function(*call.args))
            wire = reply.to_wire()  # a value that does not pickle is the call's error
        except UnknownCommand as exc:  # refused: no traceback of nbdist's own to show
            reply = CallReply([type(exc).__name__, str(exc.args[0]), ""])
            wire = reply.to_wire()
        except Exception as exc:
            reply = CallReply([type(exc).__name__, str(exc), traceback.format_exc(limit=-6)])
            wire = reply.to_wire()
        self.send(reply, str(content.get("token", "")), wire)

    def _finish(self, reply: CellDone) -> None:
        """Every output the cell made, then its reply (one socket: they arrive in that order)."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()  # ipykernel's OutStream waits for its IOPub thread to send
        idents, self.idents = self.idents, None
        self.session.send(self, *reply.to_wire()[:2], ident=idents)
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
            message = None if request is None else self._read_request(request)
            if isinstance(message, Answer) and message.seq == seq:
                return message.line
            if message is not None and not isinstance(message, Answer):
                self.waiting.append(message)  # a widget's message, a cell: after this one

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


def _reply(result: Any, interrupted: bool) -> CellDone:
    error = result.error_before_exec or result.error_in_exec
    if error is None:
        return CellDone("ok")
    if interrupted and isinstance(error, asyncio.CancelledError):  # the stop button, awaiting
        return CellDone("error", "KeyboardInterrupt", interrupted=True)
    return CellDone("error", type(error).__name__, str(error))


def _failed(exc: BaseException) -> CellDone:
    return CellDone("error", "NbdistError",
                    f"the cell channel failed: {type(exc).__name__}: {exc}")


SERVER: CellServer | None = None  # this engine's, once a setup opened it


def send_telemetry(data: dict[str, Any]) -> None:
    """The telemetry agent's publish, from any thread: under the running cell's token (between
    cells the notebook drops it)."""
    server = SERVER
    if server is not None:
        server.send(Telemetry(data))


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
