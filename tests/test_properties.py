"""Bad input at the edges, by property (hypothesis): whatever a user types after a magic or passes
to the Python API, nbdist answers with its own error and a message (UsageError in the notebook,
NbdistError from the API), never a traceback from its internals, and never leaves a process.

Arguments are checked before anything starts, so almost every example needs no engines: the
magics run against a stand-in cluster, and `Cluster.start` is replaced by a sentinel that records
what would have started. The few lines that do reach start-up run for real at the end of the
module, each checked to leave no child process behind.
"""

from __future__ import annotations

import math
import os
import string
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError
from IPython.testing import globalipapp

from nbdist import Cluster
from nbdist.cells.result import CellResult
from nbdist.cluster.launchers import LAUNCHERS
from nbdist.config import NbdistConfig
from nbdist.errors import ClusterNotRunningError, NbdistError
from nbdist.notebook import magics

# deadline=None: a slow example on this shared 2-core machine is not a bug; few examples each,
# so the whole module's hypothesis part stays well under a minute. NBDIST_PROPERTY_SCALE=20
# explores 20 times as many (a deeper search before a release).
_SCALE = int(os.environ.get("NBDIST_PROPERTY_SCALE", "1"))
FAST = settings(max_examples=60 * _SCALE, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FEW = settings(FAST, max_examples=25 * _SCALE)


@pytest.fixture(scope="module")
def ip() -> Any:
    shell = globalipapp.start_ipython() or globalipapp.get_ipython()
    shell.run_line_magic("load_ext", "nbdist")
    return shell


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# --- what users type ------------------------------------------------------------------------

NUMBERS = st.sampled_from([
    "0", "1", "2", "3", "-1", "-0", "2.5", "1e309", "-1e309", "nan", "inf", "-inf", "0x10",
    "99999999999999999999", "1_000", "٣", "", " ", "two", "1,2", "0-1", "1-0", "-", "--",
])
WORD = st.text(alphabet=string.ascii_letters + string.digits + "._-/:@*,=~ ", max_size=12)
ODD = st.text(max_size=10)  # anything, unicode and control characters included
VALUE = st.one_of(NUMBERS, WORD, ODD,
                  WORD.map(lambda w: f'"{w}'),  # an unclosed quote
                  WORD.map(lambda w: f"'{w} x'"))


def _line(flags: list[str], values: st.SearchStrategy[str] = VALUE) -> st.SearchStrategy[str]:
    """A line of options: known flags (with or without a value), unknown ones, loose words."""
    flag = st.sampled_from([*flags, "--bogus", "-x", "--"])
    token = st.one_of(flag, st.tuples(flag, values).map(" ".join), values)
    return st.one_of(st.lists(token, max_size=6).map(" ".join), ODD)


OPTION_KEYS = [
    "partition", "timelimit", "account", "heartbeat_period_ms", "heartbeat_misses", "curve",
    "environment", "controller_ip", "controller_location", "controller_args", "hosts", "mpi_args",
    "mpi_cmd", "options", "spans_hosts", "engine_python", "ssh_args", "user",
    "SlurmEngineSetLauncher.batch_file_name", ".", "a.", ".b", "", "bogus",
]
OPTION = st.one_of(st.tuples(st.sampled_from(OPTION_KEYS), VALUE).map("=".join), VALUE)
START_LINE = st.one_of(
    _line(["-n", "--backend", "--gpus-per-rank", "--threads", "--timeout", "--launcher",
           "--profile", "--master-addr", "--interface", "--hosts", "--mpi-args", "--curve"]),
    st.lists(st.one_of(
        st.tuples(st.sampled_from(["-n", "--threads", "--gpus-per-rank", "--timeout"]), NUMBERS),
        st.tuples(st.sampled_from(["--launcher"]), st.sampled_from([*LAUNCHERS, "pbs", ""])),
        st.tuples(st.sampled_from(["-o", "--launcher-option"]), OPTION),
        st.tuples(st.sampled_from(["--hosts", "--mpi-args", "--interface", "--master-addr"]), VALUE),
    ), max_size=5).map(lambda pairs: " ".join(f"{flag} {value!r}" for flag, value in pairs)),
)


class _WouldStart(Exception):
    """Raised instead of starting: every argument was accepted."""


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> list[Cluster]:
    """Cluster.start records the cluster it was called on and starts nothing."""
    started: list[Cluster] = []

    def start(self: Cluster, progress: Any = None) -> Cluster:
        started.append(self)
        raise _WouldStart

    monkeypatch.setattr(Cluster, "start", start)
    return started


def _assert_sane(cluster: Cluster) -> None:
    """What an accepted %dist_start line configured can be started (nothing nonsensical got past
    the checks): a rank count, threads, a finite deadline, an address."""
    n, threads, gpus = cluster.requested_n, cluster.requested_threads, cluster.gpus_per_rank
    assert n is None or (type(n) is int and n >= 1), n
    assert threads is None or (type(threads) is int and threads >= 1), threads
    assert type(gpus) is int and gpus >= 0, gpus
    timeout = cluster.config.cell_timeout
    assert timeout is None or (math.isfinite(timeout) and timeout > 0), timeout
    for address in (cluster._rendezvous.requested_master_addr, cluster.interface):
        assert address is None or (address and address.strip() == address), address
    assert cluster.launcher in LAUNCHERS


def _usage_error_or_start(call: Any, started: list[Cluster]) -> None:
    before = _children()
    try:
        call()
    except UsageError as exc:
        assert str(exc).strip(), "a UsageError without a message"
        assert not started, "an error after Cluster.start was reached"
    except _WouldStart:
        _assert_sane(started[-1])
    assert _children() <= before, "a process was left behind"
    assert magics.current_cluster() is None


@FAST
@given(line=START_LINE)
# the bugs this test found, kept as fixed examples
@example(line="--timeout nan").via("discovered failure")
@example(line="--timeout inf").via("discovered failure")
@example(line="-o heartbeat_period_ms=2.5").via("discovered failure")
@example(line="-o .=x").via("discovered failure")
@example(line="-o environment=x").via("discovered failure")
@example(line="--launcher ssh --hosts 'a*x'").via("discovered failure")
@example(line="--launcher ssh --hosts ,").via("discovered failure")
@example(line="-o 'controller_args=\"x'").via("discovered failure")
@example(line="--launcher slurm -o 'options=-c \"8'").via("discovered failure")
@example(line="--master-addr ' '").via("discovered failure")
def test_dist_start_line_is_a_usage_error_or_a_sane_start(ip, no_start, line):
    no_start.clear()
    _usage_error_or_start(lambda: ip.run_line_magic("dist_start", line), no_start)


# --- the other magics, against a stand-in cluster --------------------------------------------


class StandInCluster:
    """What the magics call on a running cluster, recorded instead of done."""

    running = True
    world_size = 4
    ranks: list[Any] = []
    start_seconds = 0.0
    generation = 0
    backend = "gloo"
    requested_threads = None

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def _record(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))

    def run(self, code: str, ranks: Any = None, timeout: Any = None, sink: Any = None) -> CellResult:
        self._record("run", ranks, timeout)
        return CellResult(code=code, ranks=list(range(self.world_size)))

    def run_script(self, path: str, args: Any = (), ranks: Any = None, timeout: Any = None,
                   sink: Any = None) -> CellResult:
        self._record("run_script", path, list(args), ranks, timeout)
        return CellResult(code=path, ranks=list(range(self.world_size)))

    def mark_setup_cell(self, code: str) -> None:
        self._record("mark_setup_cell")

    def dashboard(self) -> None:
        self._record("dashboard")

    def push(self, values: dict[str, Any], ranks: Any = None) -> None:
        self._record("push", values)

    def pull(self, name: str, ranks: Any = None) -> dict[int, Any]:
        self._record("pull", name, ranks)
        return {}

    def diff(self, expr: str, ranks: Any = None, full: bool = False) -> str:
        self._record("diff", expr, ranks)
        return ""

    def debug(self, rank: Any = None, ask: Any = None, show: Any = None) -> int:
        self._record("debug", rank)
        return 0

    def restart(self, progress: Any = None) -> StandInCluster:
        self._record("restart")
        return self

    def stop(self) -> list[int]:
        self._record("stop")
        return []

    def status(self) -> Any:
        self._record("status")
        return type("Status", (), {"table": lambda _self: ""})()


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandInCluster]:
    cluster = StandInCluster()
    monkeypatch.setattr(magics, "_CURRENT", cluster)
    yield cluster


def _usage_error_or_call(call: Any, cluster: StandInCluster) -> list[tuple[str, tuple[Any, ...]]]:
    """The magic either refused with a UsageError (calling nothing on the cluster) or made its
    calls; returns them."""
    cluster.calls.clear()
    try:
        call()
    except UsageError as exc:
        assert str(exc).strip(), "a UsageError without a message"
        assert not [c for c in cluster.calls if c[0] not in ("mark_setup_cell", "dashboard")], (
            f"refused, yet it called {cluster.calls}")
        return []
    return list(cluster.calls)


def _check_ranks(ranks: Any, world_size: int) -> None:
    assert ranks is None or (ranks and all(type(r) is int and 0 <= r < world_size for r in ranks))


def _check_timeout(timeout: Any) -> None:
    assert timeout is None or (math.isfinite(timeout) and timeout > 0), timeout


RANKS_VALUE = st.one_of(NUMBERS, st.lists(st.integers(-2, 5).map(str), min_size=1, max_size=4).map(",".join),
                        st.tuples(st.integers(-3, 6), st.integers(-3, 6)).map(lambda t: f"{t[0]}-{t[1]}"),
                        st.just("0-99999999999"), VALUE)
CELL_LINE = st.one_of(
    _line(["--ranks", "--timeout", "--rank0", "--setup", "--no-lint"]),
    st.lists(st.tuples(st.sampled_from(["--ranks", "--timeout"]), RANKS_VALUE), max_size=3)
    .map(lambda pairs: " ".join(f"{flag} {value!r}" for flag, value in pairs)),
)


@FAST
@given(line=CELL_LINE)
@example(line="--ranks 0-99999999999").via("discovered failure")
@example(line="--timeout nan").via("discovered failure")
def test_distributed_line_is_a_usage_error_or_a_checked_run(ip, stand_in, line):
    for name, args in _usage_error_or_call(lambda: ip.run_cell_magic("distributed", line, "x = 1"),
                                           stand_in):
        if name == "run":
            _check_ranks(args[0], stand_in.world_size)
            _check_timeout(args[1])


@FEW
@given(line=st.one_of(_line(["--ranks", "--timeout", "--rank0"]), VALUE))
def test_dist_run_line_is_a_usage_error_or_a_checked_run(ip, stand_in, line):
    for name, args in _usage_error_or_call(lambda: ip.run_line_magic("dist_run", line), stand_in):
        if name == "run_script":
            _check_ranks(args[2], stand_in.world_size)
            _check_timeout(args[3])


@FEW
@given(magic=st.sampled_from(["dist_restart", "dist_stop", "dist_status", "dist_dashboard"]),
       line=st.one_of(st.just(""), VALUE, _line(["-n", "--now", "--force"])))
@example(magic="dist_restart", line="0").via("discovered failure")
@example(magic="dist_stop", line="now").via("discovered failure")
def test_argumentless_magics_refuse_arguments(ip, stand_in, magic, line):
    """A command that takes no arguments does nothing with some: `%dist_stop now` must not be
    taken as a stop, nor `%dist_restart -n 4` as a restart of the old size."""
    calls = _usage_error_or_call(lambda: ip.run_line_magic(magic, line), stand_in)
    if line.strip():
        assert calls == [], f"%{magic} {line!r} ignored its arguments and ran"


NAME = st.one_of(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True), WORD, ODD)


@FEW
@given(line=st.one_of(_line(["--ranks"], RANKS_VALUE), NAME,
                      st.tuples(NAME, st.sampled_from(["", " --ranks 1", " --ranks 9"])).map("".join)))
def test_dist_pull_line_is_a_usage_error_or_a_pull(ip, stand_in, line):
    # the name itself is the API's to check (test_push_and_pull_check_names_before_sending)
    for name, args in _usage_error_or_call(lambda: ip.run_line_magic("dist_pull", line), stand_in):
        if name == "pull":
            assert isinstance(args[0], str)
            _check_ranks(args[1], stand_in.world_size)


PUSH_ITEM = st.one_of(NAME, st.tuples(NAME, st.sampled_from(["1", "'a'", "[1, 2]", "", "1 +"]))
                      .map("=".join))


@FEW
@given(items=st.lists(PUSH_ITEM, max_size=4))
@example(items=["A=B"]).via("discovered failure")
@example(items=["x=1 +"]).via("discovered failure")
def test_dist_push_line_is_a_usage_error_or_valid_names(ip, stand_in, items):
    ip.user_ns["defined_in_notebook"] = 1
    line = " ".join(["defined_in_notebook", *items])
    for name, args in _usage_error_or_call(lambda: ip.run_line_magic("dist_push", line), stand_in):
        if name == "push":
            assert args[0] and all(key.isidentifier() for key in args[0]), args[0]


@FEW
@given(line=st.one_of(_line(["-c", "--command"]), NUMBERS, VALUE))
def test_dist_debug_line_is_a_usage_error_or_a_rank_number(ip, stand_in, line):
    # whether that rank exists is the API's to check (Cluster.debug -> targets)
    for name, args in _usage_error_or_call(lambda: ip.run_line_magic("dist_debug", line), stand_in):
        if name == "debug":
            assert args[0] is None or type(args[0]) is int, args[0]


@FEW
@given(line=st.one_of(VALUE, _line(["on", "off", "ON"])))
def test_autodist_line_is_a_usage_error_or_on_off(ip, line):
    try:
        ip.run_line_magic("autodist", line)
    except UsageError as exc:
        assert str(exc).strip()
    finally:
        ip.run_line_magic("autodist", "off")


# --- the Python API ---------------------------------------------------------------------------

ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**12), st.floats(allow_nan=True),
                st.text(max_size=8), st.lists(st.integers(-1, 3), max_size=3),
                st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
CLUSTER_KWARGS = st.fixed_dictionaries({}, optional={
    "n": st.one_of(st.integers(-2, 8), ANY),
    "backend": st.one_of(st.sampled_from(["auto", "gloo", "nccl", "mpi", "GLOO", ""]), ANY),
    "gpus_per_rank": st.one_of(st.integers(-2, 4), ANY),
    "threads": st.one_of(st.integers(-2, 4), ANY),
    "config": st.one_of(st.just(NbdistConfig()), ANY),
    "master_addr": st.one_of(st.sampled_from(["127.0.0.1", "localhost", "::1", "", " ", "a b"]), ANY),
    "launcher": st.one_of(st.sampled_from([*LAUNCHERS, "pbs"]), ANY),
    "launcher_options": st.one_of(
        st.dictionaries(st.sampled_from(OPTION_KEYS), st.one_of(VALUE, ANY), max_size=3), ANY),
    "profile": st.one_of(st.sampled_from(["default", ""]), ANY),
    "interface": st.one_of(st.sampled_from(["lo", "no-such-if0", ""]), ANY),
})


@FAST
@given(kwargs=CLUSTER_KWARGS)
@example(kwargs={"interface": []}).via("discovered failure")
@example(kwargs={"launcher_options": {"heartbeat_misses": "2.5"}}).via("discovered failure")
@example(kwargs={"launcher_options": {".": None}}).via("discovered failure")
@example(kwargs={"launcher_options": "0"}).via("discovered failure")
@example(kwargs={"master_addr": True}).via("discovered failure")
@example(kwargs={"config": True}).via("discovered failure")
@example(kwargs={"threads": ""}).via("discovered failure")
@example(kwargs={"n": True}).via("discovered failure")
@example(kwargs={"gpus_per_rank": None}).via("discovered failure")
@example(kwargs={"launcher": "ssh", "launcher_options": {"hosts": 5}}).via("discovered failure")
def test_cluster_arguments_are_an_nbdist_error_or_a_sane_cluster(kwargs):
    """Cluster(...) checks every argument (it starts nothing); start() begins only with sane ones."""
    before = _children()
    try:
        cluster = Cluster(**kwargs)
    except NbdistError as exc:
        assert str(exc).strip()
    else:
        assert not cluster.running
        _assert_sane(cluster)
    assert _children() <= before


RUN_RANKS = st.one_of(st.none(), st.lists(st.integers(-2, 5), max_size=4), st.sets(st.integers(0, 3)),
                      st.integers(-1, 3), st.text(max_size=4), st.lists(st.booleans(), max_size=2),
                      st.lists(st.floats(0, 3), max_size=2), st.just(range(0, 2)))
RUN_TIMEOUT = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-2, 10),
                        st.text(max_size=4), st.booleans())
CODE = st.one_of(st.just("x = rank"), st.just("1 +"), st.text(max_size=10), ANY)


def _is_rank_list(ranks: Any) -> bool:
    if ranks is None:
        return True
    if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
        return False
    items = list(ranks)
    return bool(items) and all(type(r) is int for r in items)


@FAST
@given(code=CODE, ranks=RUN_RANKS, timeout=RUN_TIMEOUT)
@example(code="x = 1", ranks=[True], timeout=None).via("discovered failure")
@example(code="x = 1", ranks="01", timeout=None).via("discovered failure")
@example(code="x = 1", ranks=5, timeout=None).via("discovered failure")
@example(code="x = 1", ranks=[1.0], timeout=None).via("discovered failure")
@example(code="x = 1", ranks=[], timeout=None).via("discovered failure")
@example(code="x = 1", ranks=None, timeout="5").via("discovered failure")
@example(code="x = 1", ranks=None, timeout=math.nan).via("discovered failure")
@example(code="x = 1", ranks=None, timeout=True).via("discovered failure")
@example(code=5, ranks=None, timeout=None).via("discovered failure")
def test_run_arguments_are_checked_before_the_cluster_is(code, ranks, timeout):
    """On a cluster that is not running, a bad argument is named (it is checked first: the same
    call would fail the same way on a running one); good ones get "no cluster is running"."""
    good = (isinstance(code, str) and _is_rank_list(ranks) and (timeout is None or (
        type(timeout) in (int, float) and math.isfinite(timeout) and timeout > 0)))
    with pytest.raises(NbdistError) as raised:
        Cluster(n=2).run(code, ranks=ranks, timeout=timeout)
    assert str(raised.value).strip()
    assert isinstance(raised.value, ClusterNotRunningError) == good, raised.value


@FEW
@given(values=st.one_of(st.dictionaries(NAME, st.integers(), max_size=2), ANY), name=st.one_of(NAME, ANY),
       ranks=RUN_RANKS)
def test_push_and_pull_check_names_before_sending(cluster2, values, name, ranks):
    """Real ranks: a value pushed under a name that is not one, a pull of a non-name, bad ranks:
    an NbdistError; good arguments do the round trip."""
    try:
        cluster2.push(values, ranks=ranks)
    except NbdistError as exc:
        assert str(exc).strip()
    else:
        assert isinstance(values, dict) and values and all(k.isidentifier() for k in values)
    try:
        pulled = cluster2.pull(name, ranks=ranks)
    except NbdistError as exc:
        assert str(exc).strip()
    else:
        assert isinstance(name, str) and name.isidentifier() and pulled
    assert [p.state for p in cluster2.ranks] == ["alive", "alive"]


def _not_a_short_deadline(timeout: Any) -> bool:
    # a real deadline of a few ms is valid, and its interrupt ladder is the fault tests' business
    number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    return not (number and math.isfinite(timeout) and 0 < timeout < 5)


@FEW
@given(code=st.sampled_from(["value = rank", "1 +"]), ranks=RUN_RANKS,
       timeout=RUN_TIMEOUT.filter(_not_a_short_deadline))
def test_run_on_real_ranks_runs_or_refuses_and_the_cluster_carries_on(cluster2, code, ranks, timeout):
    """The same arguments against two real ranks: refused with an NbdistError (or the cell's own
    SyntaxError) before anything is sent, or run on exactly the ranks asked for."""
    try:
        result = cluster2.run(code, ranks=ranks, timeout=timeout)
    except (NbdistError, SyntaxError) as exc:
        assert str(exc).strip()
    else:
        expected = [0, 1] if ranks is None else sorted(set(ranks))
        assert result.ranks == expected and result.ok
    assert [p.state for p in cluster2.ranks] == ["alive", "alive"]


# --- the few lines that reach start-up: real processes, none left behind ---------------------


@pytest.mark.parametrize("line", [
    "-n 1 --backend nccl",  # no GPU here: refused after the engines started (bootstrap)
    "-n 1 -o engine_python=/nonexistent/python3",  # the engines cannot start at all
    "-n 1 --launcher mpi -o mpi_cmd=/nonexistent/mpiexec",  # the launcher's command is missing
])
def test_start_that_fails_leaves_nothing_running(ip, line, assert_all_gone):
    before = _children()
    with pytest.raises(UsageError, match=r"(?s)%dist_start failed: .+Nothing is left running"):
        ip.run_line_magic("dist_start", line)
    assert magics.current_cluster() is None
    assert_all_gone(sorted(_children() - before), within=10)
