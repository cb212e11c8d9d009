"""A throwaway one-node Slurm cluster on this machine (munged, slurmctld, slurmd), for the `slurm`
test suite and for trying ``%dist_start --launcher slurm`` without a real cluster.

Needs root and Debian's ``slurm-wlm`` and ``munge`` (``apt-get install slurm-wlm munge``). Every
file (config, munge key and socket, state, spool, logs) lives in DIR; no cgroups or systemd are
used (proctrack/linuxproc, task/none); the node declares more CPUs than the machine has
(``SlurmdParameters=config_overrides``) so several tasks fit on two cores. The daemons are
stopped by the PIDs recorded in DIR/pids.json, never by name::

    python -m tests.slurm_cluster up /tmp/slurm      # prints the line to export SLURM_CONF
    export SLURM_CONF=/tmp/slurm/slurm.conf
    sinfo; squeue                                    # partition "debug", 8 CPUs
    python -m tests.slurm_cluster down /tmp/slurm

In a notebook, after the export (before starting Jupyter):
``%dist_start --launcher slurm -n 4 -o partition=debug -o timelimit=10 -o controller_ip=127.0.0.1
-o spans_hosts=false``. Slurm's daemons listen on the ports in DIR/slurm.conf (Slurm 22.05 has no
option to bind them to loopback; every message is munge-authenticated with DIR's own key).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

PARTITION = "debug"
CPUS = 8
_DAEMONS = ("munged", "slurmctld", "slurmd")


@dataclass(frozen=True)
class SlurmCluster:
    """A running one-node cluster: where its config is, its partition and daemons' PIDs."""

    root: str
    conf: str
    partition: str
    cpus: int
    pids: dict[str, int]

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, nbdist's kernel) needs in its environment."""
        return {"SLURM_CONF": self.conf}

    def log_tail(self, daemon: str, lines: int = 20) -> str:
        try:
            with open(os.path.join(self.root, f"{daemon}.log"), errors="replace") as f:
                return "\n".join(f.read().splitlines()[-lines:])
        except OSError:
            return ""


def missing() -> str | None:
    """Why this machine cannot run the cluster, or None."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as their user)"
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"{tool} not installed (apt-get install slurm-wlm munge)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _write_config(root: str, cpus: int, partition: str) -> str:
    node = socket.gethostname()
    conf = os.path.join(root, "slurm.conf")
    lines = {
        "ClusterName": "nbdist", "SlurmctldHost": "localhost(127.0.0.1)",
        "SlurmUser": "root", "SlurmdUser": "root",
        "SlurmctldPort": _free_port(), "SlurmdPort": _free_port(),
        "AuthType": "auth/munge", "CredType": "cred/munge",
        "AuthInfo": f"socket={root}/munge/munge.socket",
        "StateSaveLocation": f"{root}/state", "SlurmdSpoolDir": f"{root}/spool",
        "SlurmctldPidFile": f"{root}/slurmctld.pid", "SlurmdPidFile": f"{root}/slurmd.pid",
        "SlurmctldLogFile": f"{root}/slurmctld.log", "SlurmdLogFile": f"{root}/slurmd.log",
        "ProctrackType": "proctrack/linuxproc", "TaskPlugin": "task/none",
        "SelectType": "select/cons_tres", "SelectTypeParameters": "CR_CPU",
        "SlurmdParameters": "config_overrides", "ReturnToService": 2, "MpiDefault": "none",
        "JobAcctGatherType": "jobacct_gather/none", "AccountingStorageType": "accounting_storage/none",
        "JobCompType": "jobcomp/none", "SlurmctldDebug": "info", "SlurmdDebug": "info",
        # short grace between SIGTERM and SIGKILL at scancel / time limit; ended jobs stay
        # visible to squeue -t all for 5 minutes (what nbdist reads their final state from)
        "KillWait": 2, "MinJobAge": 300, "OverTimeLimit": 0, "InactiveLimit": 0,
        "SchedulerParameters": "sched_interval=1",
    }
    text = "".join(f"{k}={v}\n" for k, v in lines.items())
    text += f"NodeName={node} NodeAddr=127.0.0.1 NodeHostname={node} CPUs={cpus} State=UNKNOWN\n"
    text += f"PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP\n"
    with open(conf, "w") as f:
        f.write(text)
    return conf


def _spawn(root: str, name: str, argv: list[str]) -> int:
    out = open(os.path.join(root, f"{name}.stdout"), "ab")  # noqa: SIM115 - handed to the daemon
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    out.close()
    return proc.pid


def _wait(what: str, check, root: str, timeout: float, pids: dict[str, int]) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        dead = [n for n, p in pids.items() if not _alive(p)]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(f"--- {n} ---\n{SlurmCluster(root, '', '', 0, pids).log_tail(n)}"
                             for n in _DAEMONS)
            why = f"{', '.join(dead)} exited" if dead else f"not within {timeout:.0f} s"
            raise RuntimeError(f"slurm cluster in {root}: waiting for {what}: {why}\n{logs}")
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def up(root: str, cpus: int = CPUS, partition: str = PARTITION, timeout: float = 30.0) -> SlurmCluster:
    """Start munged, slurmctld and slurmd with everything under `root`; return once the node is
    idle. On failure the daemons started so far are stopped and the error carries their logs."""
    for sub in ("munge", "state", "spool"):
        os.makedirs(os.path.join(root, sub), mode=0o700, exist_ok=True)
    os.chmod(root, 0o700)
    key = os.path.join(root, "munge", "munge.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400), "wb") as f:
        f.write(os.urandom(1024))
    conf = _write_config(root, cpus, partition)
    env = {**os.environ, "SLURM_CONF": conf}
    pids: dict[str, int] = {}
    try:
        m = f"{root}/munge"
        pids["munged"] = _spawn(root, "munged", [
            "munged", "-F", "--force", f"--socket={m}/munge.socket", f"--key-file={key}",
            f"--pid-file={m}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={m}/seed"])
        _record(root, pids)
        _wait("munged's socket", lambda: os.path.exists(f"{m}/munge.socket"), root, timeout, pids)
        pids["slurmctld"] = _spawn(root, "slurmctld", ["slurmctld", "-D", "-i", "-f", conf])
        _record(root, pids)
        pids["slurmd"] = _spawn(root, "slurmd", ["slurmd", "-D", "-f", conf])
        _record(root, pids)
        _wait("the node to be idle", lambda: _node_idle(env), root, timeout, pids)
    except BaseException:
        down(root)
        raise
    return SlurmCluster(root, conf, partition, cpus, pids)


def _node_idle(env: dict[str, str]) -> bool:
    out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip() in ("idle", "mix", "alloc")


def _record(root: str, pids: dict[str, int]) -> None:
    with open(os.path.join(root, "pids.json"), "w") as f:
        json.dump(pids, f)


def down(root: str, grace: float = 10.0) -> None:
    """Stop the daemons recorded in root/pids.json (SIGTERM, then SIGKILL after `grace`)."""
    try:
        with open(os.path.join(root, "pids.json")) as f:
            pids: dict[str, int] = json.load(f)
    except OSError:
        return
    for name in reversed(_DAEMONS):  # slurmd first: it ends its job steps
        pid = pids.get(name)
        if pid is None or not _alive(pid):
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(pid, os.WNOHANG)  # our child when started by this process
        except ChildProcessError:
            pass
    os.remove(os.path.join(root, "pids.json"))


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print("usage: python -m tests.slurm_cluster up|down DIR", file=sys.stderr)
        return 2
    command, root = argv[0], os.path.abspath(argv[1])
    if command == "down":
        down(root)
        return 0
    reason = missing()
    if reason:
        print(f"cannot start a Slurm cluster: {reason}", file=sys.stderr)
        return 1
    cluster = up(root)
    print(f"slurm is up: partition {cluster.partition!r}, {cluster.cpus} CPUs, pids {cluster.pids}")
    print(f"export SLURM_CONF={cluster.conf}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
