"""The engines' Slurm job, as ipyparallel's SlurmEngineSetLauncher submitted it (ipyparallel has no
job state): its state (scontrol), sbatch's own error, the job's end in words, its cancel."""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nbdist.cluster.launchers import ENGINE_LOG_NOISE
from nbdist.config import BatchConfig
from nbdist.errors import ClusterStartError
from nbdist.text import tail

QUEUED = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED")

HOPELESS_REASONS = ("PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit",
                    "BadConstraints", "InvalidAccount", "InvalidQOS", "PartitionDown",
                    "PartitionInactive", "JobHeldAdmin", "DependencyNeverSatisfied")
"""Pending reasons Slurm gives a job that will not start without a change (cancelled at once)."""

ENDING_REASONS = {"TimeLimit": "TIMEOUT", "NodeDown": "NODE_FAIL", "NonZeroExitCode": "FAILED",
                  "JobLaunchFailure": "FAILED"}
"""The reason Slurm gives a COMPLETING job -> the state it ends in."""

_FIELDS = re.compile(r"(?:^|\s)(JobState|Reason|ExitCode|TimeLimit)=(\S*)")


@dataclass(frozen=True)
class JobState:
    """One `scontrol show job` answer about a job."""

    state: str = ""  # PENDING, RUNNING, COMPLETING, CANCELLED...; "" once Slurm forgot the job
    reason: str = ""  # why it waits or ended (Resources, TimeLimit, NodeDown, None...)
    time_limit: str = ""  # as Slurm writes it (00:10:00, UNLIMITED)
    exit_signal: int = 0  # the signal that ended the batch script (ExitCode=0:15: 15), else 0

    @property
    def ended(self) -> bool:
        """No step or process of the job is left."""
        return self.state not in (*QUEUED, "RUNNING", "COMPLETING")

    @property
    def why(self) -> str:
        return f" ({self.reason})" if self.reason and self.reason != "None" else ""

    @property
    def ending_as(self) -> str:
        """The state the job ends in, "" while it runs or waits: Slurm shows COMPLETING until its
        steps are gone, but the reason or exit code tells already (a signal alone: scancel)."""
        if self.state != "COMPLETING":
            return self.state if self.ended else ""
        if self.reason in ENDING_REASONS:
            return ENDING_REASONS[self.reason]
        return "CANCELLED" if self.reason == "None" and self.exit_signal else ""


def query(job_id: str, timeout: float = BatchConfig.batch_command_timeout) -> JobState | None:
    """`scontrol show job -o ID` (unlike squeue it gives the exit code, which tells a cancelled
    COMPLETING job); state "" once Slurm forgot the job, None when Slurm could not be asked."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    fields = dict(_FIELDS.findall(out.stdout))
    if out.returncode != 0 or "JobState" not in fields:
        return JobState() if "Invalid job id" in out.stderr else None
    signal = fields.get("ExitCode", "0:0").partition(":")[2]
    return JobState(fields["JobState"], fields.get("Reason", ""), fields.get("TimeLimit", ""),
                    int(signal) if signal.isdigit() else 0)


def job_launcher(engine_sets: Any) -> Any:
    """The Slurm engine-set launcher among ipyparallel's engine sets (with a job id), or None."""
    from ipyparallel.cluster.launcher import SlurmLauncher

    return next((launcher for launcher in engine_sets
                 if isinstance(launcher, SlurmLauncher) and getattr(launcher, "job_id", "")), None)


def prepare_submission(config: Any, profile_dir: str) -> None:
    """The job script in the cluster's profile, not the notebook's directory; --no-requeue, so a
    node failure ends the job (NODE_FAIL, ranks dead) instead of starting engines nobody awaits."""
    slurm = config.SlurmEngineSetLauncher
    slurm.setdefault("batch_file_name", os.path.join(profile_dir, "slurm_engine.sbatch"))
    slurm.setdefault("submit_command", ["sbatch", "--no-requeue"])


def submit_error(exc: BaseException, engine_sets: Any, timeout: float) -> ClusterStartError:
    """sbatch refused the job: Slurm's own message in one line (asked again with --test-only,
    which submits nothing: the first went to the kernel's stderr)."""
    from ipyparallel.cluster.launcher import SlurmLauncher

    message = ""
    for launcher in engine_sets:
        if isinstance(launcher, SlurmLauncher) and os.path.exists(launcher.batch_file):
            out = subprocess.run([*launcher.submit_command, "--test-only", launcher.batch_file],
                                 capture_output=True, text=True, timeout=timeout)
            lines = [ln.strip() for ln in out.stderr.splitlines() if "error" in ln.lower()]
            message = "; ".join(lines) or out.stderr.strip().replace("\n", "; ")
    return ClusterStartError(f"sbatch refused the engines' job: {message or exc}")


class SlurmJob:
    """The engines' job: its state (throttled scontrol), start-up progress, end and log."""

    def __init__(self, launcher: Any, config: BatchConfig) -> None:
        self.launcher = launcher
        self.config = config
        self.job_id = str(launcher.job_id)
        self._last: JobState | None = None
        self._asked = 0.0
        self._said = ""
        self._submitted = time.monotonic()

    def state(self, fresh: bool = False) -> JobState:
        # scontrol asks slurmctld: a busy poll loop reuses the last answer for a while
        if (fresh or self._last is None
                or time.monotonic() - self._asked >= self.config.batch_query_interval):
            self._asked = time.monotonic()
            answer = query(self.job_id, self.config.batch_command_timeout)
            # Slurm not answering says nothing about the job: keep the last answer
            self._last = answer or self._last or JobState()
        return self._last

    def while_starting(self, say: Callable[[str], None]) -> bool:
        """One turn of waiting for the engines: report a change of state; True while queued (the
        engines' start-up deadline does not run then). Raises once the job cannot start, or has
        been queued past NbdistConfig.batch_queue_timeout (0: no limit)."""
        job = self.state()
        line = f"Slurm job {self.job_id}: {job.state or 'gone'}{job.why}"
        if line != self._said:
            self._said = line
            say(line)
        if job.state == "PENDING" and job.reason in HOPELESS_REASONS:
            hint = ("The partition has fewer CPUs/nodes or a shorter time limit than asked "
                    "(sinfo)." if job.reason.startswith("Partition")
                    else f"See scontrol show job {self.job_id}")
            raise ClusterStartError(f"Slurm job {self.job_id} cannot start: PENDING "
                                    f"({job.reason}); it was cancelled. {hint}")
        if job.ended:
            raise ClusterStartError(f"{self.end_detail(job)} before the engines registered.\n"
                                    + self.log_tail())
        limit = self.config.batch_queue_timeout
        if job.state in QUEUED and limit and time.monotonic() - self._submitted > limit:
            raise ClusterStartError(
                f"Slurm job {self.job_id} still {job.state}{job.why} after {limit:.0f} s "
                "(NbdistConfig.batch_queue_timeout); it was cancelled")
        return job.state in QUEUED

    def summary(self) -> str:
        """One line for %dist_status: state and reason, time limit, log."""
        job = self.state()
        return (f"Slurm job {self.job_id}: {job.ending_as or job.state or 'gone'}{job.why}, "
                f"time limit {job.time_limit or '?'}, log {self.launcher.output_file}")

    def end_detail(self, job: JobState) -> str:
        """The job's end in words, with its time limit when that is what ended it."""
        state = job.ending_as or job.state
        ends = {"TIMEOUT": f"reached its time limit ({job.time_limit}) and was ended (TIMEOUT)",
                "CANCELLED": "was cancelled (CANCELLED: scancel)",
                "NODE_FAIL": f"lost a node (NODE_FAIL, {job.reason}): the engines there are gone",
                "": "is no longer known to Slurm"}
        return f"Slurm job {self.job_id} {ends.get(state, f'ended: {state}{job.why}')}"

    def ended_detail(self, fresh: bool = False) -> str | None:
        """end_detail if the job has ended or is ending, else None; a COMPLETING job that does
        not tell why yet gets up to batch_end_settle s to say."""
        job = self.state(fresh)
        deadline = time.monotonic() + self.config.batch_end_settle
        while job.state == "COMPLETING" and not job.ending_as:
            if time.monotonic() > deadline:
                return (f"Slurm job {self.job_id} is ending (COMPLETING, reason {job.reason}; "
                        "Slurm names why once its steps are gone)")
            time.sleep(0.2)
            job = self.state(fresh=True)
        return self.end_detail(job) if job.ended or job.ending_as else None

    def log_tail(self, lines: int = 20) -> str:
        """The end of the job's output file, where every task's engine writes."""
        path = self.launcher.output_file
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            text = ""
        return (f"--- Slurm job {self.job_id} log {path} (last {lines} lines) ---\n"
                + tail(text, lines, skip=ENGINE_LOG_NOISE))

    def cancel(self, timeout: float) -> bool:
        """scancel the job (again: harmless) and wait until Slurm lists it as ended, so no step
        or engine is left; False if it is still there after `timeout`."""
        subprocess.run([*self.launcher.delete_command, self.job_id], capture_output=True,
                       timeout=self.config.batch_command_timeout)
        deadline = time.monotonic() + timeout
        while not self.state(fresh=True).ended:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True
