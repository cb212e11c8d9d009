"""The ipyparallel configuration nbdist builds for each launcher (unit level: nothing starts),
the %dist_start flags that feed it, and one real attach to engines nbdist did not start.

There is no Slurm here: the Slurm tests check the Config and the batch script ipyparallel would
submit, not a real job. MPI and SSH run for real in tests/test_mpi.py and tests/test_multihost.py.
"""

from __future__ import annotations

import os
import sys

import psutil
import pytest
from IPython.core.error import UsageError

from nbdist import Cluster
from nbdist.cluster.launch_modes import AttachedMode, LaunchedMode, LocalMode, engines_started
from nbdist.cluster.launchers import (
    LAUNCHERS,
    MultiHostWarning,
    build_launcher_plan,
    engine_command,
    has_local_pid,
    ssh_engine_hosts,
)
from nbdist.errors import NbdistError
from nbdist.worker import net

ENGINE = [sys.executable, "-m", "nbdist.worker.engine"]
HOST_ADDRESS = "10.11.12.13"


@pytest.fixture(autouse=True)
def host_address(monkeypatch):
    """This host's address as batch launchers bind it (a machine with only loopback has none)."""
    monkeypatch.setattr(net, "host_address", lambda: HOST_ADDRESS)


def test_local_plan_stays_on_loopback():
    plan = build_launcher_plan("local")
    assert plan.cluster_kwargs["controller_ip"] == "127.0.0.1"
    assert "controller_location" not in plan.cluster_kwargs
    assert not plan.spans_hosts and plan.engine_pids_local
    assert plan.config.LocalEngineSetLauncher.engine_cmd == ENGINE
    assert plan.config.LocalEngineLauncher.engine_cmd == ENGINE
    assert plan.cluster_kwargs["engine_launcher_class"].endswith(".LocalEngineSetLauncher")
    # a short heartbeat (registration completes on one) with ipyparallel's 30 s tolerance
    assert plan.cluster_kwargs["controller_args"] == [
        "--log-level=40", "--HeartMonitor.period=100", "--HeartMonitor.max_heartmonitor_misses=300"]


def test_unknown_launcher_and_option_are_clear_errors():
    with pytest.raises(NbdistError, match="choose one of local, mpi, slurm, ssh"):
        build_launcher_plan("pbs")
    with pytest.raises(NbdistError, match="does not take option.*mpi_arg"):
        build_launcher_plan("mpi", {"mpi_arg": "-x"})
    with pytest.raises(NbdistError, match="needs hosts"):
        build_launcher_plan("ssh")
    with pytest.raises(NbdistError, match="does not take hosts"):
        build_launcher_plan("slurm", {"hosts": ["a"]})
    with pytest.raises(NbdistError, match="launcher"):
        Cluster(n=2, launcher="kubernetes")


def test_slurm_config_passes_options_through():
    plan = build_launcher_plan("slurm", {
        "partition": "gpu", "account": "proj42", "qos": "high", "timelimit": "2:00:00",
        "options": "--gpus-per-task=1 --cpus-per-task=8",
        "SlurmEngineSetLauncher.batch_file_name": "nbdist_engines.sbatch",
    }, n=8)
    slurm = plan.config.SlurmEngineSetLauncher
    assert slurm.queue == "gpu" and slurm.account == "proj42" and slurm.qos == "high"
    assert slurm.timelimit == "2:00:00"
    # ipyparallel 9.2 drops SlurmLauncher.options from its default script: nbdist writes them
    # as #SBATCH lines of the engine job's template instead
    assert "#SBATCH --gpus-per-task=1\n#SBATCH --cpus-per-task=8" in slurm.batch_template
    assert "options" not in slurm
    assert slurm.batch_file_name == "nbdist_engines.sbatch"  # "Class.trait" is verbatim
    assert slurm.engine_cmd == ENGINE
    assert plan.cluster_kwargs["engine_launcher_class"].endswith(".SlurmEngineSetLauncher")
    # engines land on nodes we cannot know in advance: the controller listens off loopback on
    # this host's one address they look it up by (never 0.0.0.0), advertises it, and finds dead
    # nodes by a short heartbeat
    assert plan.spans_hosts and not plan.engine_pids_local
    assert plan.cluster_kwargs["controller_ip"] == HOST_ADDRESS
    assert plan.cluster_kwargs["controller_location"] == HOST_ADDRESS
    assert "--HeartMonitor.period=1000" in plan.cluster_kwargs["controller_args"]


def test_slurm_batch_script_ipyparallel_would_submit(tmp_path):
    """Render the sbatch script through ipyparallel's own SlurmEngineSetLauncher (no sbatch)."""
    from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

    plan = build_launcher_plan("slurm", {"partition": "gpu", "account": "proj42",
                                         "timelimit": "30", "options": "--gpus-per-task=1 -c 8"})
    launcher = SlurmEngineSetLauncher(config=plan.config, work_dir=str(tmp_path),
                                      profile_dir=str(tmp_path), cluster_id="abc")
    launcher.write_batch_script(4)
    script = (tmp_path / launcher.batch_file_name).read_text()
    assert "#SBATCH --ntasks=4" in script
    assert "#SBATCH --partition=gpu" in script
    assert "#SBATCH --account=proj42" in script
    assert "#SBATCH --time=30" in script
    assert "#SBATCH --gpus-per-task=1\n#SBATCH -c 8\n" in script
    assert "#SBATCH --job-name=ipengine-abc" in script
    assert f"srun {sys.executable} -m nbdist.worker.engine" in script


def test_slurm_with_interface_binds_that_address_only(monkeypatch):
    plan = build_launcher_plan("slurm", {}, interface="lo")
    assert plan.cluster_kwargs["controller_ip"] == "127.0.0.1"  # lo's address, not 0.0.0.0
    with pytest.raises(NbdistError, match="no IPv4 address"):
        build_launcher_plan("slurm", {}, interface="no-such-if0")
    # no interface and no address of this host to bind: ask for one, never listen everywhere
    monkeypatch.setattr(net, "host_address", lambda: None)
    with pytest.raises(NbdistError, match="--interface IFACE .* or -o controller_ip=ADDR"):
        build_launcher_plan("slurm", {})


def test_mpi_config_and_when_it_spans_hosts():
    plan = build_launcher_plan("mpi", {"mpi_args": "--oversubscribe --bind-to none"})
    mpi = plan.config.MPIEngineSetLauncher
    assert mpi.mpi_args == ["--oversubscribe", "--bind-to", "none"]
    assert mpi.engine_cmd == ENGINE  # ipyparallel appends --mpi
    assert not plan.spans_hosts and plan.engine_pids_local
    assert plan.cluster_kwargs["controller_ip"] == "127.0.0.1"

    multi = build_launcher_plan("mpi", {"hosts": "node1,node2", "mpi_cmd": ["mpirun"]})
    assert multi.config.MPIEngineSetLauncher.mpi_args[:2] == ["--host", "node1,node2"]
    assert multi.config.MPIEngineSetLauncher.mpi_cmd == ["mpirun"]
    assert multi.spans_hosts and not multi.engine_pids_local
    assert build_launcher_plan("mpi", {"mpi_args": ["--hostfile", "hosts.txt"]}).spans_hosts


def test_ssh_config_hosts_python_and_no_key_files_copied():
    plan = build_launcher_plan("ssh", {
        "hosts": ["127.0.0.1", "localhost"], "ssh_args": "-p 2222 -i key",
        "remote_python": "/opt/venv/bin/python", "user": "me",
    }, n=4)
    ssh = plan.config.SSHEngineSetLauncher
    assert ssh.engines == {"127.0.0.1": 2, "localhost": 2}
    assert ssh.ssh_args == ["-p", "2222", "-i", "key"]
    assert ssh.user == "me"
    assert ssh.engine_cmd == ["/opt/venv/bin/python", "-m", "nbdist.worker.engine"]
    assert plan.config.SSHEngineLauncher.to_send == []  # connection info goes by env over stdin
    assert plan.spans_hosts and not plan.engine_pids_local
    # the controller binds the address this machine reaches the first host by
    assert plan.cluster_kwargs["controller_ip"] == "127.0.0.1"


def test_ssh_host_lists():
    assert ssh_engine_hosts(["a", "b"], 5) == {"a": 3, "b": 2}
    assert ssh_engine_hosts("a,b", None) == {"a": 1, "b": 1}
    assert ssh_engine_hosts("a*4,b*2", None) == {"a": 4, "b": 2}
    assert ssh_engine_hosts({"me@a:2222": 8}, None) == {"me@a:2222": 8}
    with pytest.raises(NbdistError, match="count"):
        ssh_engine_hosts("a*2,b", None)
    with pytest.raises(NbdistError, match="at least one"):
        ssh_engine_hosts({"a": 0}, None)


def test_curve_heartbeat_and_controller_passthrough():
    plan = build_launcher_plan("ssh", {"hosts": ["127.0.0.1"], "curve": True,
                                       "heartbeat_period_ms": 250, "heartbeat_misses": 4,
                                       "controller_ip": "10.0.0.5",
                                       "controller_args": ["--log-level=20"]})
    args = plan.cluster_kwargs["controller_args"]
    assert "--IPController.enable_curve=True" in args and "--log-level=20" in args
    assert "--HeartMonitor.period=250" in args
    assert "--HeartMonitor.max_heartmonitor_misses=4" in args
    assert plan.cluster_kwargs["controller_ip"] == "10.0.0.5"
    local_curve = build_launcher_plan("local", {"curve": True})
    assert "--IPController.enable_curve=True" in local_curve.cluster_kwargs["controller_args"]
    assert local_curve.cluster_kwargs["controller_ip"] == "127.0.0.1"
    assert plan.curve and local_curve.curve and not build_launcher_plan("local").curve


def test_where_each_end_of_the_cell_channel_listens():
    """Loopback on one host; across hosts a rank's address on --interface, else the one it
    reaches the notebook by, and the notebook's the controller's (when it runs here)."""
    from types import SimpleNamespace

    from nbdist.cluster.rendezvous import Rendezvous
    from nbdist.errors import ClusterStartError
    from nbdist.protocol.handshake import ProbeReply

    probe = ProbeReply(host="b", addresses={"eth9": ["10.9.0.2"]}, route_address="10.0.0.5")
    local = Rendezvous(None, None)
    assert local.channel_host(probe) == "127.0.0.1" and local.notebook_host(None, {}) == "127.0.0.1"
    pinned, routed = Rendezvous(None, "eth9"), Rendezvous(None, None)
    pinned.spans_hosts = routed.spans_hosts = True
    assert pinned.channel_host(probe) == "10.9.0.2" and routed.channel_host(probe) == "10.0.0.5"
    with pytest.raises(ClusterStartError, match="--interface"):
        routed.channel_host(ProbeReply(host="c"))
    here = next((a for addresses in net.ipv4_addresses().values() for a in addresses
                 if not net.is_loopback(a)), "127.0.0.1")
    client = SimpleNamespace(_config={"interface": f"tcp://{here}"})
    assert routed.notebook_host(client, {}) == here


def test_every_launcher_builds_an_ipyparallel_cluster():
    """ipyparallel accepts the class and config nbdist builds (constructing starts nothing)."""
    import logging

    import ipyparallel as ipp

    for name in LAUNCHERS:
        options = {"hosts": ["127.0.0.1"]} if name == "ssh" else {}
        plan = build_launcher_plan(name, options, n=2)
        cluster = ipp.Cluster(n=2, config=plan.config, log=logging.getLogger("t"),
                              shutdown_atexit=False, **plan.cluster_kwargs)
        assert cluster.engine_launcher_class.__name__.lower().startswith(name)
        assert engine_command()[-1] == "nbdist.worker.engine"


def test_has_local_pid_by_launcher_kind():
    from ipyparallel.cluster.launcher import (
        LocalEngineLauncher,
        MPIEngineSetLauncher,
        SlurmEngineSetLauncher,
        SSHEngineLauncher,
    )

    assert has_local_pid(LocalEngineLauncher()) and has_local_pid(MPIEngineSetLauncher())
    assert not has_local_pid(SSHEngineLauncher()) and not has_local_pid(SlurmEngineSetLauncher())


def test_cluster_constructor_validates_launcher_options_without_starting():
    cluster = Cluster(n=2, launcher="slurm", launcher_options={"partition": "gpu"})
    assert not cluster.running and cluster.launcher == "slurm"
    with pytest.raises(NbdistError, match="does not combine"):
        Cluster(profile="mine", launcher="ssh", launcher_options={"hosts": ["a"]})


def test_each_launch_mode_says_what_it_can_do_before_anything_starts():
    local, slurm = Cluster(n=2).launch_mode, Cluster(n=2, launcher="slurm").launch_mode
    attached = Cluster(n=2, profile="mine").launch_mode
    assert (type(local), type(slurm), type(attached)) == (LocalMode, LaunchedMode, AttachedMode)
    assert slurm.spans_hosts and not local.spans_hosts and not attached.spans_hosts
    assert local.owned_pids([]) == [] and attached.owned_pids([]) == []  # nothing started yet
    with pytest.raises(NbdistError, match="local engines only .this cluster's are slurm"):
        slurm.check_replaceable(controller_lost=False)
    with pytest.raises(NbdistError, match="local engines only .this cluster's are attached"):
        attached.check_replaceable(controller_lost=False)
    with pytest.raises(NbdistError, match="the controller is gone"):
        local.check_replaceable(controller_lost=True)


def test_dist_start_flags_reach_the_cluster(monkeypatch):
    from nbdist.notebook import magics

    seen: dict[str, object] = {}

    class Recorder:
        def __init__(self, **kwargs: object) -> None:
            seen.update(kwargs)
            raise NbdistError("recorded")

    monkeypatch.setattr(magics, "Cluster", Recorder)
    shell = _shell()
    with pytest.raises(UsageError, match="recorded"):
        shell.run_line_magic("dist_start", "-n 4 --launcher ssh --hosts a*2,b*2 --interface eth1 "
                             "--master-addr 10.0.0.2 --curve -o ssh_args='-p 2222'")
    assert seen["launcher"] == "ssh" and seen["interface"] == "eth1"
    assert seen["master_addr"] == "10.0.0.2"
    assert seen["launcher_options"] == {"ssh_args": "-p 2222", "hosts": "a*2,b*2", "curve": True}
    seen.clear()
    with pytest.raises(UsageError, match="recorded"):
        shell.run_line_magic("dist_start", "--profile mycluster")
    assert seen["profile"] == "mycluster" and "launcher" not in seen
    with pytest.raises(UsageError, match="KEY=VALUE"):
        shell.run_line_magic("dist_start", "--launcher slurm -o partition")


def _shell():
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "nbdist")
    return shell


def test_attach_uses_engines_it_did_not_start_and_never_kills_them(tmp_path, fast_config):
    """`ipcluster start` stand-in: an ipyparallel cluster started here, outside nbdist."""
    import logging

    import ipyparallel as ipp

    user_cluster = ipp.Cluster(n=2, profile_dir=str(tmp_path / "profile"), controller_ip="127.0.0.1",
                               log=logging.getLogger("user"), shutdown_atexit=False, delay=0)
    user_cluster.start_cluster_sync()
    try:
        user_pids = [la.pid for es in user_cluster.engines.values() for la in es.launchers.values()]
        user_pids.append(user_cluster.controller.pid)
        # start_cluster_sync returns before the engines register: attach waits for the two
        # the cluster file lists (CI once attached to the first one alone)
        target = {"profile_dir": str(tmp_path / "profile"), "cluster_id": user_cluster.cluster_id}
        assert engines_started(target) == 2
        cluster = Cluster.attach(profile_dir=str(tmp_path / "profile"),
                                 cluster_id=user_cluster.cluster_id, config=fast_config)
        try:
            assert cluster.world_size == 2 and cluster.all_pids() == []
            result = cluster.run("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nt.item()")
            assert result.raise_for_errors().grouped_values() == [([0, 1], "3.0")]
            assert {p.local for p in cluster.ranks} == {True}
            assert cluster.master_addr == "127.0.0.1"
            # restart keeps the user's engines: the same processes, a new process group
            engine_pids = sorted(p.pid for p in cluster.ranks)
            cluster.restart()
            assert sorted(p.pid for p in cluster.ranks) == engine_pids and cluster.generation == 1
            assert cluster.run("dist.all_reduce(torch.ones(1))").raise_for_errors()
        finally:
            stopped = cluster.stop()
        assert stopped == []
        assert all(psutil.pid_exists(pid) for pid in user_pids)
        # the engines are the user's again: a plain ipyparallel call still works
        client = user_cluster.connect_client_sync()
        assert client[:].apply_sync(os.getpid) and len(client.ids) == 2
        client.close()
    finally:
        user_cluster.stop_cluster_sync()


def test_multihost_warning_is_an_nbdist_warning():
    from nbdist import NbdistWarning

    assert issubclass(MultiHostWarning, NbdistWarning)


def test_curve_option_encrypts_a_real_local_cluster(cluster_factory):
    import json

    cluster = cluster_factory(2, launcher_options={"curve": True})
    security = os.path.join(cluster.workdir, "profile", "security")
    client_files = [f for f in os.listdir(security) if f.endswith("-client.json")]
    with open(os.path.join(security, client_files[0])) as f:
        info = json.load(f)
    assert info["curve_serverkey"] and info["key"] == ""  # CurveZMQ replaces the HMAC key
    result = cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()").raise_for_errors()
    assert result.grouped_values() == [([0, 1], "2.0")]
