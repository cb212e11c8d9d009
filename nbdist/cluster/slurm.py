"""Slurm specifics of engines submitted by ipyparallel's SlurmEngineSetLauncher: the job id, its
state and reason (squeue), sbatch's own error, the end of a job in words, cancelling it for good.

nbdist starts no Slurm process of its own beyond these queries; ipyparallel submits and cancels.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nbdist.cluster.launchers import ENGINE_LOG_NOISE
from nbdist.config import NbdistConfig
from nbdist.errors import ClusterStartError
from nbdist.text import tail

QUEUED = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED")
"""Job states in which the engines have not started (yet)."""

HOPELESS_REASONS = ("PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit",
                    "BadConstraints", "InvalidAccount", "InvalidQOS", "PartitionDown",
                    "PartitionInactive", "JobHeldAdmin", "DependencyNeverSatisfied")
"""Pending reasons Slurm gives a job that will not start without a change (cancelled at once)."""


@dataclass(frozen=True)
class JobState:
    """One squeue answer about a job."""

    state: str
    """PENDING, RUNNING, CANCELLED, TIMEOUT...; "" once Slurm no longer knows the job."""

    reason: str
    """Why it waits or ended (squeue's %r: Resources, Priority, TimeLimit, None...)."""

    time_limit: str
    """The job's time limit as squeue writes it (1:00, UNLIMITED)."""

    @property
    def ended(self) -> bool:
        return self.state not in QUEUED and self.state not in ("RUNNING", "COMPLETING")


def query(job_id: str, timeout: float = NbdistConfig.batch_command_timeout) -> JobState:
    """`squeue -j ID -h -t all -o "%T|%r|%l"` (ended jobs stay listed for Slurm's MinJobAge)."""
    try:
        out = subprocess.run(["squeue", "-j", job_id, "-h", "-t", "all", "-o", "%T|%r|%l"],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return JobState("", "", "")
    fields = out.stdout.strip().splitlines()[0].split("|") if out.stdout.strip() else []
    if out.returncode != 0 or len(fields) != 3:
        return JobState("", "", "")
    return JobState(*fields)


def job_launcher(engine_sets: Any) -> Any:
    """The Slurm engine-set launcher among ipyparallel's engine sets (with a job id), or None."""
    from ipyparallel.cluster.launcher import SlurmLauncher

    for launcher in engine_sets:
        if isinstance(launcher, SlurmLauncher) and getattr(launcher, "job_id", ""):
            return launcher
    return None


def place_batch_script(config: Any, profile_dir: str) -> None:
    """Write the job script into the cluster's profile, not the notebook's working directory
    (ipyparallel joins its name onto '.')."""
    slurm = config.SlurmEngineSetLauncher
    if "batch_file_name" not in slurm:
        slurm.batch_file_name = os.path.join(profile_dir, "slurm_engine.sbatch")


def submit_error(exc: BaseException, engine_sets: Any, timeout: float) -> ClusterStartError:
    """sbatch refused the job: Slurm's own message in one line (sbatch wrote it to the kernel's
    stderr, so it is asked again with --test-only, which submits nothing)."""
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
    """The engines' job: its state (throttled squeue), start-up progress, end and log."""

    def __init__(self, launcher: Any, config: NbdistConfig,
                 query_job: Callable[[str, float], JobState] = query) -> None:
        self.launcher = launcher
        self.config = config
        self.job_id = str(launcher.job_id)
        self._query = query_job
        self._last: JobState | None = None
        self._asked = 0.0
        self._said = ""

    def state(self, fresh: bool = False) -> JobState:
        # squeue asks slurmctld: a busy poll loop reuses the last answer for a while
        if (fresh or self._last is None
                or time.monotonic() - self._asked >= self.config.batch_query_interval):
            self._asked = time.monotonic()
            self._last = self._query(self.job_id, self.config.batch_command_timeout)
        return self._last

    def while_starting(self, say: Callable[[str], None]) -> bool:
        """One turn of waiting for the engines: report a change of state; True while queued (the
        engines' start-up deadline does not run then). Raises once the job cannot start."""
        job = self.state()
        line = f"Slurm job {self.job_id}: {job.state or 'gone'}" + (
            f" ({job.reason})" if job.reason and job.reason != "None" else "")
        if line != self._said:
            self._said = line
            say(line)
        if job.state == "PENDING" and job.reason in HOPELESS_REASONS:
            raise ClusterStartError(f"Slurm job {self.job_id} cannot start: PENDING "
                                    f"({job.reason}); it was cancelled. {self._hint(job)}")
        if job.ended:
            raise ClusterStartError(f"{self.end_detail(job)} before the engines registered.\n"
                                    + self.log_tail())
        return job.state in QUEUED

    def _hint(self, job: JobState) -> str:
        if job.reason.startswith("Partition"):
            return "The partition has fewer CPUs/nodes or a shorter time limit than asked (sinfo)."
        return "See scontrol show job " + self.job_id

    def end_detail(self, job: JobState | None = None) -> str:
        """The job's end in words, with its time limit when that is what ended it."""
        job = job or self.state()
        if job.state == "TIMEOUT":
            return (f"Slurm job {self.job_id} reached its time limit ({job.time_limit}) and was "
                    "ended (TIMEOUT)")
        if job.state == "CANCELLED":
            return f"Slurm job {self.job_id} was cancelled (CANCELLED)"
        if not job.state:
            return f"Slurm job {self.job_id} is no longer known to Slurm"
        return f"Slurm job {self.job_id} ended: {job.state}" + (
            f" ({job.reason})" if job.reason and job.reason != "None" else "")

    def ended_detail(self, fresh: bool = False) -> str | None:
        """end_detail if the job has ended or is ending, else None. Slurm shows an ending job as
        COMPLETING until its steps are gone, hiding why: wait up to batch_end_settle s for the
        final state."""
        job = self.state(fresh)
        deadline = time.monotonic() + self.config.batch_end_settle
        while job.state == "COMPLETING" and job.reason != "TimeLimit":
            if time.monotonic() > deadline:
                return (f"Slurm job {self.job_id} is ending (COMPLETING: cancelled or failed; "
                        "Slurm names which once its steps are gone)")
            time.sleep(0.2)
            job = self.state(fresh=True)
        if job.state == "COMPLETING":  # reason TimeLimit: ended by its time limit
            job = JobState("TIMEOUT", job.reason, job.time_limit)
        return self.end_detail(job) if job.ended else None

    def log_tail(self, lines: int = 20) -> str:
        """The end of the job's output file (every task's engine writes there)."""
        path = self.launcher.output_file
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            text = getattr(self.launcher, "_output", None) or ""
        return (f"--- Slurm job {self.job_id} log {path} (last {lines} lines) ---\n"
                + tail(text, lines, skip=ENGINE_LOG_NOISE))

    def cancel(self, timeout: float) -> bool:
        """scancel the job (again: harmless) and wait until Slurm lists it as ended, so no step
        or engine is left; False if it is still there after `timeout`."""
        subprocess.run(["scancel", self.job_id], capture_output=True,
                       timeout=self.config.batch_command_timeout)
        deadline = time.monotonic() + timeout
        while not self.state(fresh=True).ended:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True
