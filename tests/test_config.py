"""NbdistConfig in sections: the flat spelling users and tests/conftest.py write keeps working,
every field is checked when its section is made, and the internal section warns when its knobs
are set by their old flat names."""

from __future__ import annotations

import dataclasses
import pickle
import warnings

import pytest

from nbdist.config import DEFAULT, FaultConfig, NbdistConfig, StartConfig
from nbdist.errors import NbdistError
from nbdist.worker.cell_channel import ChannelEndpoint, ChannelSetup
from nbdist.worker.setup_message import RankReady, RankSetup, RankSpec


def test_flat_names_and_sections_make_the_same_config() -> None:
    flat = NbdistConfig(stop_timeout=3.0, cell_timeout=60, memory_limit="1GiB")
    by_section = NbdistConfig(start=StartConfig(stop_timeout=3.0, memory_limit=2**30),
                              faults=FaultConfig(cell_timeout=60))
    assert flat == by_section
    assert flat.stop_timeout == flat.start.stop_timeout == 3.0
    assert flat.memory_limit == 2**30  # kept as bytes


def test_replace_and_flat_assignment_leave_other_configs_alone() -> None:
    base = NbdistConfig(teardown_grace=2.0)
    changed = base.replace(fork_server=False, faults=FaultConfig(cell_timeout=5))
    assert (changed.fork_server, changed.cell_timeout, changed.teardown_grace) == (False, 5, 3.0)
    assert base.fork_server and base.teardown_grace == 2.0
    assert dataclasses.replace(base, max_output_chars=50_000).output.max_output_chars == 50_000
    saved = DEFAULT.cell_timeout
    try:
        DEFAULT.cell_timeout = 30
        assert DEFAULT.faults.cell_timeout == 30 and base.cell_timeout is None
    finally:
        DEFAULT.cell_timeout = saved


@pytest.mark.parametrize("changes,message", [
    ({"stop_timeout": -1}, "stop_timeout -1: must be a finite number of seconds"),
    ({"cell_timeout": 0}, "more than 0"),
    ({"process_group_timeout": float("inf")}, "finite"),
    ({"fork_server": 1}, "True or False"),
    ({"flight_recorder_entries": 1.5}, "whole number, 0 or more"),
    ({"max_output_chars": 10}, "at most max_output_chars"),
    ({"memory_limit": "1 parsec"}, "not a size"),
    ({"engine_start_timeout": None}, "number of seconds"),
    ({"faults": "fast"}, "give an nbdist.config.FaultConfig"),
])
def test_bad_values_are_refused_naming_the_field(changes: dict, message: str) -> None:
    with pytest.raises(NbdistError, match=message):
        NbdistConfig(**changes)
    with pytest.raises(NbdistError, match=message):
        DEFAULT.replace(**changes)


def test_zero_where_it_means_something() -> None:
    config = NbdistConfig(batch_queue_timeout=0, fault_settle=0, cell_end_collective_wait=0)
    assert config.batch.batch_queue_timeout == 0 and config.faults.fault_settle == 0


def test_unknown_names_are_errors_not_silently_kept() -> None:
    with pytest.raises(TypeError, match="bogus"):
        NbdistConfig(bogus=1)
    with pytest.raises(AttributeError, match="bogus"):
        DEFAULT.bogus = 1  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT.faults.cell_timeout = 1  # type: ignore[misc]


def test_internal_knobs_warn_by_their_flat_name_only() -> None:
    with pytest.warns(DeprecationWarning, match="internal.poll_interval"):
        config = NbdistConfig(poll_interval=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config.internal.poll_interval == 0.01
        NbdistConfig(stop_timeout=1.0, telemetry_interval=0.2).replace(cell_timeout=3)


def test_the_setup_message_crosses_pickling_as_it_is() -> None:
    spec = RankSpec(1, 1, 2, 2, "host", 7, "gloo", ())
    setup = RankSetup(spec=spec, master_addr="127.0.0.1", port=1234, generation=0,
                      store_path=None, threads=1, cwd="/", interface=None, private_dir=None,
                      channel=ChannelSetup("tcp://127.0.0.1:41000", "127.0.0.1"),
                      config=NbdistConfig(process_group_timeout=7.0))
    again = pickle.loads(pickle.dumps(setup))
    assert again == setup and again.process_group_timeout == 7.0
    nccl = dataclasses.replace(setup, spec=dataclasses.replace(spec, backend="nccl"))
    assert nccl.process_group_timeout == DEFAULT.faults.nccl_process_group_timeout
    ready = RankReady("cpu", 1, ChannelEndpoint("tcp://127.0.0.1:41001"))
    assert pickle.loads(pickle.dumps(ready)) == ready
