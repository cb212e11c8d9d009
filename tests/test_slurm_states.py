"""How nbdist reads a Slurm job's end from `scontrol show job -o` (lines as Slurm 22.05 printed them
for the engines' job under tests/slurm_cluster.py). No scheduler needed: the live runs are in
test_slurm.py (pytest -m slurm)."""

from __future__ import annotations

import subprocess

import pytest

from nbdist.cluster import slurm

# a real line, the fields around the ones nbdist reads cut short
LINE = ("JobId=12 JobName=ipengine-1795445126-3ck1 UserId=root(0) Priority=4294901748 Nice=0 "
        "Account=(null) QOS=(null) JobState={state} Reason={reason} Dependency=(null) Requeue=0 "
        "Restarts=0 BatchFlag=1 Reboot=0 ExitCode={exit_code} RunTime=00:00:24 "
        "TimeLimit=00:10:00 TimeMin=N/A Command=/tmp/nbdist-s5so5g7l/profile/slurm_engine.sbatch "
        "WorkDir=/work/a dir with spaces StdOut=/tmp/nbdist-s5so5g7l/profile/log/ipengine.log")


def _answer(monkeypatch: pytest.MonkeyPatch, stdout: str, stderr: str = "", rc: int = 0) -> None:
    def run(argv: list[str], **_kwargs: object) -> subprocess.CompletedProcess[str]:
        assert argv[:4] == ["scontrol", "show", "job", "-o"]
        return subprocess.CompletedProcess(argv, rc, stdout, stderr)
    monkeypatch.setattr(slurm.subprocess, "run", run)


@pytest.mark.parametrize(("state", "reason", "exit_code", "ending_as"), [
    ("RUNNING", "None", "0:0", ""),
    ("PENDING", "Resources", "0:0", ""),
    # scancel: COMPLETING for ~7 s; the batch script's SIGTERM is already in the exit code
    ("COMPLETING", "None", "0:15", "CANCELLED"),
    ("COMPLETING", "None", "0:0", ""),  # the instant before that signal lands: not known yet
    ("CANCELLED", "None", "0:15", "CANCELLED"),
    ("COMPLETING", "TimeLimit", "0:15", "TIMEOUT"),
    ("TIMEOUT", "TimeLimit", "0:15", "TIMEOUT"),
    ("NODE_FAIL", "NodeDown", "0:0", "NODE_FAIL"),
    ("COMPLETING", "NonZeroExitCode", "3:0", "FAILED"),
    ("COMPLETING", "JobLaunchFailure", "0:15", "FAILED"),  # batch script killed, not scancel
])
def test_ending_state_from_scontrol(monkeypatch, state, reason, exit_code, ending_as) -> None:
    _answer(monkeypatch, LINE.format(state=state, reason=reason, exit_code=exit_code))
    job = slurm.query("12")
    assert job is not None
    assert (job.state, job.reason, job.time_limit) == (state, reason, "00:10:00")
    assert job.ending_as == ending_as


def test_unknown_job_and_unreachable_slurm_differ(monkeypatch) -> None:
    _answer(monkeypatch, "", "slurm_load_jobs error: Invalid job id specified\n", rc=1)
    assert slurm.query("12") == slurm.JobState("", "", "")
    _answer(monkeypatch, "", "slurm_load_jobs error: Unable to contact slurm controller\n", rc=1)
    assert slurm.query("12") is None
