"""Merged output as properties: whatever the ranks print, however their text is chunked and
interleaved, and however the clock moves, every line reaches the notebook exactly once, each rank's
lines in its own order, a line several ranks print alike is shown once with their ranks, and no
line waits longer than the live-output interval, or than the hold for a late rank. The sink is the one the magic uses (no IPython
here, so its labels are plain); the head/tail bound and the logs are `CellOutput`'s own."""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nbdist.cells.output import CellOutput
from nbdist.cells.output_log import read_log
from nbdist.cells.result import CellResult, RankError
from nbdist.cluster.ranks import parse_ranks
from nbdist.config import NbdistConfig
from nbdist.errors import DistributedCellError, NbdistError
from nbdist.notebook.merge import LineMerger, ranks_of
from nbdist.notebook.noise import LIBAIO_NOTE
from nbdist.notebook.progress import render_loop, visible_text
from nbdist.notebook.rank_board import RankBoard, static_bundle
from nbdist.notebook.sink import NotebookSink
from tests.sinks import RecordingSink


@pytest.fixture(autouse=True, scope="module")
def _plain_terminal() -> Iterator[None]:
    """These tests read what a terminal gets (no colour), whatever IPython shell an earlier test
    in this process left behind: get_ipython() stays set once a shell was made."""
    from nbdist.notebook import sink

    original = sink._in_ipython
    sink._in_ipython = lambda: False
    yield
    sink._in_ipython = original

INTERVAL = 0.1
HOLD = 0.25
_LABEL = re.compile(r"^\[ranks? ([\d,-]+)\] (.*)$")

# a small alphabet, so that ranks often print the same line; some lines are progress bars
_TEXT = st.sampled_from(["same", "loss 0.5", "epoch 1", "", "x" * 30, "done"])
_BAR = st.lists(st.sampled_from(["10%", "50%", "100%"]), min_size=1, max_size=3).map(
    lambda parts: "".join(f"\r{p}" for p in parts))
_LINE = st.one_of(_TEXT, _TEXT, _BAR)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Timed(io.StringIO):
    """stdout that stamps each written line with the clock."""

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.clock = clock
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.lines.extend((self.clock.now, line) for line in text.splitlines())
        return len(text)


def _visible(line: str) -> str:
    return visible_text(line) if "\r" in line else line


@st.composite
def _runs(draw: st.DrawFn) -> tuple[list[list[str]], list[tuple[int, int, float]]]:
    """Each rank's lines, and a schedule: (rank, chunk length, seconds before it arrives)."""
    ranks = draw(st.integers(1, 5))
    common = draw(st.lists(_LINE, max_size=6))
    lines = [common + draw(st.lists(_LINE, max_size=3)) if draw(st.booleans()) else
             draw(st.lists(_LINE, max_size=8)) for _ in range(ranks)]
    texts = ["".join(f"{line}\n" for line in rank_lines) for rank_lines in lines]
    steps, left = [], [len(t) for t in texts]
    while any(left):
        rank = draw(st.sampled_from([r for r in range(ranks) if left[r]]))
        size = draw(st.integers(1, left[rank]))
        steps.append((rank, size, draw(st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.15]))))
        left[rank] -= size
    return lines, steps


def _play(lines: list[list[str]], steps: list[tuple[int, int, float]]
          ) -> tuple[_Timed, dict[tuple[int, int], float]]:
    """Feed the schedule to a sink as the cell's loop would (a turn whenever output is due)."""
    clock = _Clock()
    out = _Timed(clock)
    texts = ["".join(f"{line}\n" for line in rank_lines) for rank_lines in lines]
    config = NbdistConfig(output_interval=INTERVAL, output_hold_max=HOLD)
    sink = NotebookSink(ranks=range(len(lines)), config=config, clock=clock)
    arrived: dict[tuple[int, int], float] = {}
    sent = [0] * len(lines)
    with redirect_stdout(out):
        for rank, size, delay in steps:
            target = clock.now + delay
            while (due := sink.tick()) is not None and clock.now + due <= target:
                clock.now += due  # the runner waits at most until something is due
            clock.now = target
            sink.tick()
            chunk = texts[rank][sent[rank]:sent[rank] + size]
            for number in range(texts[rank].count("\n", 0, sent[rank]),
                                texts[rank].count("\n", 0, sent[rank] + size)):
                arrived[(rank, number)] = clock.now
            sent[rank] += size
            sink.on_stream(rank, "stdout", chunk)
        for rank in range(len(lines)):
            sink.on_rank_done(rank, "finished")
        sink.close(None)
    return out, arrived


@settings(max_examples=300, deadline=None)
@given(_runs())
def test_every_line_once_in_rank_order_merged_and_never_late(run) -> None:
    lines, steps = run
    out, arrived = _play(lines, steps)
    seen: dict[int, list[tuple[float, str]]] = {rank: [] for rank in range(len(lines))}
    for at, shown in out.lines:
        match = _LABEL.match(shown)
        assert match, shown
        for rank in parse_ranks(match.group(1), len(lines)):
            seen[rank].append((at, match.group(2)))
    for rank, rank_lines in enumerate(lines):
        assert [text for _at, text in seen[rank]] == [_visible(line) for line in rank_lines]
        for number, (at, _text) in enumerate(seen[rank]):
            assert at - arrived[(rank, number)] <= HOLD + 1e-9, (rank, number, at)


@settings(max_examples=150, deadline=None)
@given(st.lists(_LINE, min_size=1, max_size=8), st.integers(2, 6), st.randoms())
def test_alike_output_on_every_rank_is_shown_once(lines, ranks, random) -> None:
    """Every rank prints the same lines and no interval passes: one line each, all ranks."""
    texts = {rank: "".join(f"{line}\n" for line in lines) for rank in range(ranks)}
    steps = []
    for rank, text in texts.items():
        cuts = sorted(random.sample(range(1, len(text)), min(3, len(text) - 1)))
        steps += [(rank, b - a, 0.0) for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    random.shuffle(steps)
    steps = _keep_rank_order(steps)
    out, _arrived = _play([lines] * ranks, steps)
    everyone = f"[ranks 0-{ranks - 1}]"
    assert [line for _at, line in out.lines] == [f"{everyone} {_visible(ln)}" for ln in lines]


def _shown(merger: LineMerger, now: float) -> list[tuple[list[int], str]]:
    return [(ranks_of(mask), text) for mask, text in merger.due(now)]


def test_a_late_rank_holds_the_line_it_has_not_printed_yet() -> None:
    """Copies of a line further apart than the interval still merge while the late rank printed
    the lines before it alike; the hold ends at `hold_max`, or once the rank is done."""
    merger = LineMerger(range(3), INTERVAL, HOLD)
    merger.add(0, ["a", "b"], 0.0)
    merger.add(1, ["a", "b"], 0.0)
    assert _shown(merger, 0.2) == [] and merger.next_due(0.2) == pytest.approx(HOLD - 0.2)
    merger.add(2, ["a"], 0.2)  # late: every rank's "a" at once, "b" still waits for rank 2
    assert _shown(merger, 0.2) == [([0, 1, 2], "a")]
    assert _shown(merger, HOLD - 0.01) == []
    assert _shown(merger, HOLD) == [([0, 1], "b")]  # rank 2 is late by more than the hold
    merger.add(0, ["c"], 1.0)
    merger.rank_done(1)
    merger.add(2, ["b", "c"], 1.0)  # its "c" comes after rank 0's: it cannot join it
    assert _shown(merger, 1.0) == []
    # nobody waits for rank 0, which printed more lines than rank 2 had with its "b"
    assert _shown(merger, 1.0 + INTERVAL) == [([0], "c"), ([2], "b"), ([2], "c")]


def test_a_line_the_other_ranks_print_differently_waits_only_the_interval() -> None:
    merger = LineMerger(range(3), INTERVAL, HOLD)
    merger.add(0, ["only rank 0"], 0.0)
    merger.add(1, ["rank 1's own"], 0.0)
    merger.add(2, ["rank 2's own"], 0.0)
    assert _shown(merger, INTERVAL) == [([0], "only rank 0"), ([1], "rank 1's own"),
                                        ([2], "rank 2's own")]
    merger.add(0, ["next"], 0.2)  # its last line was its own: no other rank is late for it
    assert _shown(merger, 0.2 + INTERVAL) == [([0], "next")]


def _keep_rank_order(steps: list[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
    """The shuffled chunks, but each rank's in its own order (the schedule only interleaves)."""
    by_rank: dict[int, list[tuple[int, int, float]]] = {}
    for step in sorted(steps, key=lambda s: s[0]):
        by_rank.setdefault(step[0], []).append(step)
    order = [step[0] for step in steps]
    return [by_rank[rank].pop(0) for rank in order]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 6),
       st.integers(1, 40))
def test_the_head_is_shown_the_end_follows_and_the_log_keeps_everything(
        tmp_path_factory, sizes, max_lines, chunk) -> None:
    workdir = tmp_path_factory.mktemp("cell")
    text = "".join(f"line {i}\n" + "-" * size for i, size in enumerate(sizes))
    sink = RecordingSink()
    config = NbdistConfig(max_output_lines=max_lines, output_tail_chars=20)
    output = CellOutput(sink, config, str(workdir))
    for start in range(0, len(text), chunk):
        output.stream(0, "stdout", text[start:start + chunk])
    output.finish_stream(0, "stdout", text)
    result = CellResult(code="", ranks=[0])
    output.close(result)
    shown = sink.text(0, "stdout")
    head = "".join(text.splitlines(keepends=True)[:max_lines])
    assert shown.startswith(head)
    cut = len(text) > len(head)
    assert any("more than" in s for s in sink.statuses) == cut
    if cut:
        tail = shown[len(head):]
        whole = text if text.endswith("\n") else text + "\n"  # a last line is ended when shown
        assert whole.endswith(tail) and len(tail) <= 20 + len(max(whole.splitlines(), key=len)) + 1
    assert result.output(0) == text
    assert (read_log(result.output_dir, 0) == text) == cut  # a file only for a long output


def test_a_flood_note_names_all_cut_ranks_at_once(tmp_path: Path) -> None:
    sink = RecordingSink()
    output = CellOutput(sink, NbdistConfig(max_output_lines=2), str(tmp_path))
    for rank in range(16):
        output.stream(rank, "stderr", "a\nb\nc\n")
    output.tick()
    assert len(sink.statuses) == 1 and "rank(s) 0-15 stderr: more than 2 lines" in sink.statuses[0]
    for rank in range(16):
        output.finish_stream(rank, "stderr", "a\nb\nc\n")
    output.close(CellResult(code="", ranks=list(range(16))))
    assert len(sink.statuses) == 2
    assert "rank(s) 0-15 stderr: 0 characters left out" in sink.statuses[1]
    assert all(sink.text(rank) == "a\nb\nc\n" for rank in range(16))


def test_one_aggregated_bar_names_the_slowest_rank() -> None:
    texts = {rank: f"epoch: {10 * rank}%| | {rank}/10 [00:01<00:02]" for rank in range(8)}
    text = render_loop(texts, finished=set(), ranks=8)
    assert text.splitlines()[0] == "[ranks 0-7] slowest rank 0, mean 35%, 0 of 8 ranks done"
    assert text.splitlines()[1] == f"[rank 0] {texts[0]}"
    uncounted = render_loop({rank: "spinning" for rank in range(12)}, finished={1}, ranks=12)
    assert "1 of 12 ranks done" in uncounted and uncounted.count("spinning") == 8
    assert uncounted.endswith("... and 4 more ranks")


def test_the_saved_view_puts_errors_first_and_groups_alike_ranks() -> None:
    board = RankBoard(range(8))
    for rank in range(8):
        board.add_lines(rank, ["same everywhere"])
    board.add_lines(3, ["<about to fail>"])
    result = CellResult(code="", ranks=list(range(8)),
                        errors={3: RankError(rank=3, kind="root", ename="ValueError",
                                             evalue="bad")})
    board.finish(result)
    bundle = static_bundle(board, "_dist_result.output(rank)")
    html = bundle["text/html"]
    assert html.index("rank 3") < html.index("ranks 0-2,4-7")
    assert "<details open><summary><b>rank 3</b> · failed" in html
    assert "&lt;about to fail&gt;" in html
    assert bundle["text/plain"].splitlines()[0] == "nbdist: 8 ranks: 1 failed (rank 3), 7 finished"


def test_a_failure_reads_as_plain_text_and_renders_in_colour() -> None:
    coloured = "\x1b[31mValueError\x1b[39m: bad"
    ranks = list(range(8))
    errors = {rank: RankError(rank=rank, kind="root", ename="ValueError", evalue="bad",
                              traceback=coloured) for rank in ranks[:6]}
    errors.update({rank: RankError(rank=rank, kind="collective", where="barrier at cell line 2")
                   for rank in ranks[6:]})
    try:
        CellResult(code="", ranks=ranks, errors=errors).raise_for_errors()
    except DistributedCellError as exc:
        message = str(exc)
        assert "\x1b" not in message and "ValueError: bad" in message
        assert coloured in exc._render_traceback_()
        # six ranks that failed alike: one headline, one traceback; two alike: one line
        assert message.count("ValueError: bad") == 2 and "ranks 0-5 raised ValueError" in message
        assert "ranks 6-7: was waiting in barrier" in message and "rank 7" not in message


def test_two_ranks_that_failed_alike_share_one_traceback_different_ones_keep_theirs() -> None:
    def traceback(cell: int, name: str) -> str:
        return (f"\x1b[36mCell\x1b[39m \x1b[32mIn[{cell}]\x1b[39m, line 1\n"
                f"----> 1 x = {name}\n\nNameError: name '{name}' is not defined")

    def error(rank: int, cell: int, name: str) -> RankError:
        return RankError(rank=rank, kind="root", ename="NameError",
                         evalue=f"name '{name}' is not defined", traceback=traceback(cell, name))

    # rank 1 ran one cell more than rank 0 (--ranks 1): its cell number differs, not its error
    alike = CellResult(code="", ranks=[0, 1], errors={0: error(0, 5, "x"), 1: error(1, 6, "x")})
    message = alike.failure_message()
    assert "── ranks 0-1 raised NameError: name 'x' is not defined ──" in message
    assert message.count("----> 1 x = x") == 1 and "In[5]" in message, message
    assert alike.errors[1].traceback.count("In[6]") == 1  # each rank's own, kept
    apart = CellResult(code="", ranks=[0, 1], errors={0: error(0, 5, "x"), 1: error(1, 5, "y")})
    message = apart.failure_message()
    assert "── rank 0 raised NameError: name 'x'" in message
    assert "── rank 1 raised NameError: name 'y'" in message


def test_deepspeeds_libaio_check_reads_as_one_note_and_other_link_errors_stay() -> None:
    libaio = ("/usr/bin/ld: cannot find -laio: No such file or directory\n"
              "collect2: error: ld returned 1 exit status\n")
    other = ("/usr/bin/ld: cannot find -lfoo: No such file or directory\n"
             "collect2: error: ld returned 1 exit status\n")
    for mode, expected in (("merged", [f"[ranks 0-1] {LIBAIO_NOTE}",
                                       "[ranks 0-1] /usr/bin/ld: cannot find -lfoo: No such file "
                                       "or directory",
                                       "[ranks 0-1] collect2: error: ld returned 1 exit status"]),
                           ("raw", None)):
        err = io.StringIO()
        sink = NotebookSink(ranks=range(2), output=mode)
        with redirect_stdout(io.StringIO()), redirect_stderr(err):
            for rank in range(2):  # cut mid-line, checked twice (once per DeepSpeed engine)
                sink.on_stream(rank, "stderr", libaio[:30])
                sink.on_stream(rank, "stderr", libaio[30:] + libaio + other)
                sink.on_rank_done(rank, "finished")
            sink.close(None)
        shown = err.getvalue().splitlines()
        if expected is None:  # raw: every line as it came
            assert len(shown) == 12 and shown[0].endswith(libaio.splitlines()[0]), shown
        else:
            assert shown == expected, shown


def test_the_output_mode_is_checked_where_it_is_set() -> None:
    with pytest.raises(NbdistError, match="output_mode 'loud': one of merged, ranks, raw"):
        NbdistConfig(output_mode="loud")
    with pytest.raises(NbdistError, match=r"output_hold_max=0.1: at least output_interval \(0.3\)"):
        NbdistConfig(output_hold_max=0.1)


def test_raw_output_holds_nothing_back_and_ranks_output_writes_blocks() -> None:
    for mode, expected in (("raw", ["[rank 0] same", "[rank 1] same"]),
                           ("ranks", ["── ranks 0-1 (finished) ──", "same"])):
        clock = _Clock()
        out = io.StringIO()
        sink = NotebookSink(ranks=[0, 1], output=mode, clock=clock)
        with redirect_stdout(out), redirect_stderr(io.StringIO()):
            sink.on_stream(0, "stdout", "same\n")
            sink.on_stream(1, "stdout", "same\n")
            live = out.getvalue()
            sink.close(CellResult(code="", ranks=[0, 1]))
        assert live == ("".join(f"{line}\n" for line in expected) if mode == "raw" else "")
        assert out.getvalue().splitlines() == expected
