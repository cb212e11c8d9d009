"""The protocol's codec and the env feature's table, without a cluster: every message class
through the wire and back, an unknown or malformed message as a clear error, the marks."""

from __future__ import annotations

import timeit

import pytest

from nbdist.features.env.env_table import EnvTable, RankEnv
from nbdist.protocol.wire import (
    Answer,
    Call,
    CallReply,
    Cell,
    CellDone,
    Error,
    Prompt,
    ProtocolError,
    PublishedData,
    Stream,
    Telemetry,
    decode,
)

MESSAGES = [
    Cell("t-1", "x = 1"), Call("t-2", "values.send", (["x"],)), Answer("7-1", "p x"),
    Stream("stdout", "hi\n"), Error("ValueError", "boom", ["line"]), Prompt("> x", "7-1", "(pdb) "),
    CellDone("error", "KeyboardInterrupt", interrupted=True),
    CallReply(value={"x": [1, 2]}), CallReply(["UnknownCommand", "no such", ""]),
    Telemetry({"nbdist": {"rank": 1, "memory": {"peak": 3}}}), PublishedData({"loss": 0.5}),
]


def _through_json(content: dict) -> dict:
    import json

    return json.loads(json.dumps(content))  # what the Session does to the plain fields


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_crosses_the_wire_as_it_is(message) -> None:
    tag, content, buffers = message.to_wire()
    back = decode(tag, _through_json(content), [bytes(b) for b in buffers])
    assert type(back) is type(message)
    for name in message.__dataclass_fields__:
        got, sent = getattr(back, name), getattr(message, name)
        assert got == sent or (list(got) == list(sent)), name  # JSON makes a tuple a list


def test_an_unknown_or_malformed_message_is_a_clear_error() -> None:
    with pytest.raises(ProtocolError, match="unknown message type 'nbdist_undo'"):
        decode("nbdist_undo", {}, [])
    with pytest.raises(ProtocolError, match="nbdist_cell message without its 'code'"):
        decode("nbdist_cell", {"token": "t"}, [])
    with pytest.raises(ProtocolError, match="does not decode"):
        decode("nbdist_call", {"token": "t", "command": "c"}, [b"not a pickle"])


def test_encode_and_decode_cost_microseconds_per_message() -> None:
    """Printed for the record (pytest -s): the codec's share of a message, Session's signing and
    JSON aside. Bounded loosely: a shared machine's timings are noisy."""
    for message in (Cell("t-1", "pass"), Stream("stdout", "x\n"), CellDone("ok")):
        tag, content, buffers = message.to_wire()
        loops = 20_000
        encode = timeit.timeit(message.to_wire, number=loops) / loops
        decoded = timeit.timeit(lambda tag=tag, content=content, buffers=buffers:
                                decode(tag, content, buffers), number=loops) / loops
        print(f"{type(message).__name__}: encode {encode * 1e6:.2f} us, "
              f"decode {decoded * 1e6:.2f} us")
        assert encode + decoded < 200e-6


def _env(rank: int, **environ: str) -> RankEnv:
    return RankEnv(rank, "h", 100 + rank, "3.11", "2.13.0", "", "", "CPU only",
                   {"PATH": "/bin", "RANK": str(rank), **environ})


def test_the_table_marks_only_what_differs_and_hides_secrets() -> None:
    table = EnvTable([_env(0, FOO="1"), _env(1, FOO="2", API_TOKEN="s3"), _env(2, FOO="1")],
                     {3: "rank 3 is dead (signal 9)"})
    assert table.differing == ["API_TOKEN", "FOO"]  # RANK differs by design; PATH does not
    header, rows = table.rows()
    assert header[-2:] == ["API_TOKEN", "FOO"]
    assert rows[1][-1] == ("2", True) and rows[0][-1] == ("1", False)
    assert rows[1][-2] == ("(hidden)", True) and rows[0][-2] == ("(unset)", False)
    text = str(table)
    assert "2*" in text and "s3" not in text and "rank 3: no answer" in text
    html = table._repr_html_()
    assert html.count("background:#ffe08a") == 2 and "s3" not in html


def test_two_ranks_that_differ_are_both_marked() -> None:
    _header, rows = EnvTable([_env(0, FOO="a"), _env(1, FOO="b")]).rows()
    assert rows[0][-1] == ("a", True) and rows[1][-1] == ("b", True)
