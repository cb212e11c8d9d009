"""Every message on the cell channel as a small typed class, and the one codec between a class and
the signed wire (a jupyter_client Session message: its type tag, its plain fields as content, a
value as frames). ipykernel's own IOPub kinds keep their encoding and are read into classes here."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from nbdist.errors import NbdistError
from nbdist.protocol.frames import CellClassMissing, pack, unpack

VERSION = 1
"""Bumped whenever a message changes: notebook and rank compare it at set-up (`ProbeReply`)."""

TELEMETRY_KEY = "nbdist"  # a rank's telemetry, among what it publishes as data


class ProtocolError(NbdistError):
    """A signed message that this end cannot read: an unknown type or a missing field."""


class Message:
    """A message class: `TAG` names it on the wire, `VALUE` the field that travels as frames."""

    __slots__ = ()
    TAG: ClassVar[str]
    VALUE: ClassVar[str | None] = None

    def to_wire(self) -> tuple[str, dict[str, Any], list[Any]]:
        required, optional = _FIELDS[type(self)]
        content = {name: getattr(self, name) for name in (*required, *optional)}
        return self.TAG, content, pack(getattr(self, self.VALUE)) if self.VALUE else []

    @classmethod
    def from_wire(cls, content: dict[str, Any], buffers: list[Any], device: Any = None) -> Any:
        required, optional = _FIELDS[cls]
        try:  # the fields without a default come first in a dataclass: by position
            args = [content[name] for name in required]
        except KeyError as exc:
            raise ProtocolError(f"a {cls.TAG} message without its {exc.args[0]!r}") from None
        kwargs = {name: content[name] for name in optional if name in content}
        if cls.VALUE:
            kwargs[cls.VALUE] = unpack(buffers, device)
        return cls(*args, **kwargs)


M = TypeVar("M", bound=type[Message])
_TYPES: dict[str, type[Message]] = {}
_FIELDS: dict[type[Message], tuple[tuple[str, ...], tuple[str, ...]]] = {}
"""Per class: its plain fields without a default, then those with one."""


def message(*tags: str) -> Callable[[M], M]:
    """Register a message class under its tag (and any other tags it is read from)."""

    def register(cls: M) -> M:
        fields = [f for f in dataclasses.fields(cls) if f.name != cls.VALUE]
        no_default = (dataclasses.MISSING, dataclasses.MISSING)
        required = tuple(f.name for f in fields if (f.default, f.default_factory) == no_default)
        _FIELDS[cls] = (required, tuple(f.name for f in fields if f.name not in required))
        for tag in (cls.TAG, *tags):
            _TYPES[tag] = cls
        return cls

    return register


def decode(tag: str, content: dict[str, Any], buffers: list[Any], device: Any = None) -> Any:
    """The message a signed (tag, content, frames) holds; ProtocolError if this end cannot read
    it. `device`: where a value's tensors go (a rank's own)."""
    cls = _TYPES.get(tag)
    if cls is None:
        raise ProtocolError(f"an unknown message type {tag!r} (this end speaks protocol "
                            f"{VERSION})")
    try:
        return cls.from_wire(content, buffers, device)
    except (ProtocolError, CellClassMissing):
        raise
    except Exception as exc:
        raise ProtocolError(f"a {tag} message that does not decode: {exc!r}") from exc


# ---------------------------------------------------------------- to a rank
@message()
@dataclass(frozen=True, slots=True)
class Cell(Message):
    TAG: ClassVar[str] = "nbdist_cell"
    token: str
    code: str


@message()
@dataclass(frozen=True, slots=True)
class Call(Message):
    """A command of the rank's service (`nbdist.worker.rank_service`), by name."""

    TAG: ClassVar[str] = "nbdist_call"
    VALUE: ClassVar[str | None] = "args"
    token: str
    command: str
    args: tuple[Any, ...] = ()


@message()
@dataclass(frozen=True, slots=True)
class Answer(Message):
    """The notebook's answer to a rank's pdb `Prompt` of the same `seq`."""

    TAG: ClassVar[str] = "nbdist_pdb_answer"
    seq: str
    line: str


# ---------------------------------------------------------------- from a rank
@message()
@dataclass(frozen=True, slots=True)
class Stream(Message):
    TAG: ClassVar[str] = "stream"
    name: str
    text: str


@dataclass(frozen=True, slots=True)
class _Whole(Message):
    """An IOPub message kept as its whole content (a display's data, metadata, transient)."""

    content: dict[str, Any]

    def to_wire(self) -> tuple[str, dict[str, Any], list[Any]]:
        return self.TAG, self.content, []

    @classmethod
    def from_wire(cls, content: dict[str, Any], buffers: list[Any], device: Any = None) -> Any:
        return cls(content)


@message()
@dataclass(frozen=True, slots=True)
class Display(_Whole):
    TAG: ClassVar[str] = "display_data"


@message()
@dataclass(frozen=True, slots=True)
class Result(_Whole):
    TAG: ClassVar[str] = "execute_result"


@message("status", "execute_input", "clear_output", "update_display_data", "shutdown_reply")
@dataclass(frozen=True, slots=True)
class Unrendered(_Whole):
    """ipykernel's IOPub kinds a `%%distributed` cell shows nothing for."""

    TAG: ClassVar[str] = "nbdist_unrendered"


@message()
@dataclass(frozen=True, slots=True)
class Error(Message):
    TAG: ClassVar[str] = "error"
    ename: str = "Exception"
    evalue: str = ""
    traceback: Any = ()  # lines (ipykernel's) or one text (a call's)


@message()
@dataclass(frozen=True, slots=True)
class Telemetry(Message):
    """A rank's telemetry (`worker/agent.py`), sent straight from the thread that made it:
    `data` holds the payload under TELEMETRY_KEY."""

    TAG: ClassVar[str] = "nbdist_telemetry"
    VALUE: ClassVar[str | None] = "data"
    data: dict[str, Any]


@message()
@dataclass(frozen=True, slots=True)
class PublishedData(Message):
    """What a cell published itself with ipykernel's `publish_data` (IOPub's data_message)."""

    TAG: ClassVar[str] = "data_message"
    data: dict[str, Any]

    def to_wire(self) -> tuple[str, dict[str, Any], list[Any]]:
        from ipyparallel.serialize import serialize_object

        return self.TAG, {}, serialize_object(self.data)

    @classmethod
    def from_wire(cls, content: dict[str, Any], buffers: list[Any], device: Any = None) -> Any:
        # ipykernel's data_pub encodes with ipyparallel's serializer
        from ipyparallel.serialize import deserialize_object

        return cls(deserialize_object(buffers)[0])


@message()
@dataclass(frozen=True, slots=True)
class Prompt(Message):
    """What a rank stopped at `breakpoint()` printed; with `seq` and `prompt`, it waits for the
    `Answer` of that `seq`."""

    TAG: ClassVar[str] = "nbdist_pdb_prompt"
    text: str
    seq: str | None = None
    prompt: str | None = None


@message()
@dataclass(frozen=True, slots=True)
class CellDone(Message):
    """A rank's end of one cell: after every output of it (they share one socket)."""

    TAG: ClassVar[str] = "nbdist_reply"
    status: str
    ename: str = ""
    evalue: str = ""
    traceback: Any = ()
    interrupted: bool = False


@message()
@dataclass(frozen=True, slots=True)
class CallReply(Message):
    """A `Call`'s answer: its `value`, or the `error` it raised (`Error`: name, text, tail)."""

    TAG: ClassVar[str] = "nbdist_call_reply"
    VALUE: ClassVar[str | None] = "value"
    error: list[str] | None = None  # name, text, traceback tail
    value: Any = None


@dataclass(frozen=True, slots=True)
class Comm:
    """A widget's comm message, either way: Jupyter's own (`COMM_TAGS`), read whole by each end's
    channel and passed to the comm's owner."""

    kind: str
    msg: dict[str, Any]


COMM_TAGS = ("comm_open", "comm_msg", "comm_close")


@dataclass(frozen=True, slots=True)
class Malformed:
    """Not a wire message: what the receiving end hands on for one it could not read, so the
    party waiting for a reply hears why instead of waiting out its deadline."""

    tag: str
    reason: str
