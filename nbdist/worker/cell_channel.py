"""A rank's direct cell channel: cells from the notebook straight to the engine, not through
ipyparallel's controller.

A cell sent through ipyparallel goes notebook -> controller -> engine, and its reply and every
output come back through the controller again; ipyparallel's execute machinery around it (busy,
execute_input, idle) is about 10 ms a no-op cell on 4 ranks here, against about 2 ms over a
socket straight to each engine (measured side by side). A local rank therefore also listens on a
ROUTER socket of its own, on loopback, handled on the engine's event loop (the main thread,
between ipyparallel's messages), and sends everything a cell produces on one PUSH socket to the
notebook.

Nothing about a cell changes: it runs through the engine's own IPython shell (`run_cell`, with
history, hooks, tracebacks and the stop button's SIGINT), and its output is the very messages
ipykernel would publish (stream, display_data, execute_result, error, data_message): while a
direct cell runs, the engine's IOPub thread hands them to the channel instead of the controller.
Every message is signed with the cluster's key, both ways: a local user who finds the port can
neither run code in the rank nor forge its output.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

CELL_REQUEST = "nbdist_cell"
CELL_REPLY = "nbdist_reply"


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
                self.socket.send_multipart(parts, flags=self._noblock, copy=True)
            except self._again:
                self.dropped += 1


class CellServer:
    """The engine's end of the channel (one per engine, made by :func:`open_channel`)."""

    def __init__(self, rank: int, notebook_address: str) -> None:
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
        context = zmq.Context.instance()
        self.requests = context.socket(zmq.ROUTER)
        self.requests.linger = 0
        self.port = self.requests.bind_to_random_port("tcp://127.0.0.1")
        out = context.socket(zmq.PUSH)
        out.linger = 0
        out.sndhwm = 100_000
        out.connect(notebook_address)
        self.out = _Locked(out)
        self.notebook_address = notebook_address
        self.iopub = sys.stdout.pub_thread  # the engine's IOPubThread: every publisher sends through it
        self._idents: list[bytes] | None = None
        self.stream = ZMQStream(self.requests, IOLoop.current())
        self.stream.on_recv(self._on_request)

    def retarget(self, notebook_address: str) -> None:
        """A new cluster object in the notebook (a restart keeps this engine): send there."""
        if notebook_address != self.notebook_address:
            self.out.socket.disconnect(self.notebook_address)
            self.out.socket.connect(notebook_address)
            self.notebook_address = notebook_address

    # ------------------------------------------------------------------ one cell
    def _on_request(self, frames: list[bytes]) -> None:
        try:
            _idents, msg_list = self.session.feed_identities(frames)
            request = self.session.deserialize(msg_list)
        except Exception as exc:  # unsigned or malformed: not from this cluster's notebook
            print(f"nbdist: refused a cell request on the direct channel: {exc}", file=sys.__stderr__)
            return
        if request["header"]["msg_type"] != CELL_REQUEST:
            return
        content = request["content"]
        idents = [str(content["token"]).encode(), str(self.rank).encode()]
        code = str(content["code"])
        self._tap(idents)
        transformed = self._needs_loop(code)
        if transformed is not None:  # top-level await: run on the engine's loop, reply when done
            asyncio.ensure_future(self._serve_async(idents, code, transformed))
            return
        try:
            with _interruptible():
                reply = _reply(self.shell.run_cell(code, store_history=True, silent=False))
        except BaseException as exc:  # nbdist's own failure, never the cell's (run_cell catches those)
            reply = _failed(exc)
        self._finish(idents, reply)

    async def _serve_async(self, idents: list[bytes], code: str, transformed: str) -> None:
        try:
            with _interruptible():
                reply = _reply(await self.shell.run_cell_async(
                    code, store_history=True, silent=False, transformed_cell=transformed,
                    preprocessing_exc_tuple=None))
        except BaseException as exc:
            reply = _failed(exc)
        self._finish(idents, reply)

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

    def _finish(self, idents: list[bytes], reply: dict[str, Any]) -> None:
        """Every output the cell made, then its reply (one socket: they arrive in that order)."""
        self._flush()
        self._untap()
        self.session.send(self.out, CELL_REPLY, content=reply, ident=idents)

    # ------------------------------------------------------------------ output
    def _tap(self, idents: list[bytes]) -> None:
        self._idents = idents
        self.iopub.send_multipart = self._forward  # an instance attribute: shadows the method

    def _untap(self) -> None:
        self.iopub.__dict__.pop("send_multipart", None)
        self._idents = None

    def _forward(self, parts: list[Any], *args: Any, **kwargs: Any) -> None:
        idents = self._idents
        if idents is None:  # the cell ended while this thread was on its way: as before
            type(self.iopub).send_multipart(self.iopub, parts, *args, **kwargs)
            return
        self.out.send_multipart([*idents, *parts])

    @staticmethod
    def _flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()  # ipykernel's OutStream waits for its IOPub thread to send
            except Exception:
                pass


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """As ipykernel does around each request: the stop button's SIGINT raises KeyboardInterrupt
    only while a cell runs."""
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, saved)


def _reply(result: Any) -> dict[str, Any]:
    error = result.error_before_exec or result.error_in_exec
    if error is None:
        return {"status": "ok"}
    return {"status": "error", "ename": type(error).__name__, "evalue": str(error), "traceback": []}


def _failed(exc: BaseException) -> dict[str, Any]:
    return {"status": "error", "ename": "NbdistError", "traceback": [],
            "evalue": f"the direct cell channel failed: {type(exc).__name__}: {exc}"}


_SERVER: CellServer | None = None


def open_channel(rank: int, notebook_address: str) -> int:
    """Listen for direct cells (once per engine); returns the port."""
    global _SERVER
    if _SERVER is None:
        _SERVER = CellServer(rank, notebook_address)
    else:
        _SERVER.rank = rank
        _SERVER.retarget(notebook_address)
    return _SERVER.port
