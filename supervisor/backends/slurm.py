"""Backend `slurm`: the shim runs inside a SLURM allocation (docs/scale-out.md).

Start: `launch.json` is written as for a local job (`launch.write_launch`), then
`sbatch --parsable` submits a batch script that execs the shim on the allocation's
first node. The shim writes its files into the attempt directory, which must be on a
filesystem the daemon and the nodes share, so the exit code, the log and the claim
reach the daemon the usual way. The SLURM job id goes to `slurm.json`; the job's name,
`jobsup-ID-N`, finds it too if the daemon died before writing that file.

The job's process tree, GPUs and output are read by its shim on the node, which
publishes them to `observed.jsonl` (`observes_locally` is False; docs/scale-out.md).
Liveness comes from the scheduler, never from /proc: one
`squeue` per tick for all of this user's jobs. A job SLURM still lists as pending,
running, completing or suspended is alive; once it lists a final state (or no longer
lists it: `sacct` is asked where accounting exists), the attempt has ended, and
`scheduler_end` says whether SLURM's state (TIMEOUT, CANCELLED from outside, OOM,
PREEMPTED, NODE_FAIL) rather than the shim's exit code is the reason. An unreachable
controller is not an ended job: the attempt counts as running until SLURM answers.

Stop: `stop.json` records that jobsup asked (so a cancel is told apart from someone
else's `scancel`), then `scancel --batch --signal=TERM` reaches the shim alone, which
runs the job's own SIGTERM -> grace -> SIGKILL; the backstop after the grace is a plain
`scancel` (SLURM's SIGTERM, KillWait, SIGKILL to everything). A job still queued is
cancelled at once. Jobs are submitted `--no-requeue`: a restart is a new attempt that
jobsup starts, never SLURM re-running an attempt whose claim is taken.

Asking SLURM (squeue, scontrol, sacct, scancel) is `slurm_query.py`'s.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.backends.base import (
    Attempt,
    Backend,
    LaunchDeferred,
    LaunchFate,
    SchedulerEnd,
    ShimState,
)
from supervisor.backends.launch import observe_request, package_root_on_path, write_launch
from supervisor.backends.slurm_jobs import (
    BATCH_SCRIPT,
    PENDING_REASONS,
    SlurmJob,
    end_of,
    job_name,
    sbatch_argv,
    worker_argv,
)
from supervisor.backends.slurm_query import SLURM_FILE, SlurmQueries, SlurmUnreachable
from supervisor.errors import InvalidSpec
from supervisor.runtime import files
from supervisor.runtime.fileio import atomic_write_json, create_json_exclusive
from supervisor.runtime.files import ExitStatus, WorkerInfo
from supervisor.runtime.procfs import StatReader
from supervisor.spec import JobSpec

if TYPE_CHECKING:
    from supervisor.config import Settings

log = logging.getLogger(__name__)

STOP_FILE = "stop.json"
"""Written before jobsup cancels the job: its cancel, not someone else's."""


TRANSIENT_ERRORS = ("Unable to contact slurm controller", "Socket timed out",
                    "temporarily unable", "Resource temporarily unavailable",
                    "Transport endpoint is not connected")
"""sbatch errors after which the same submission may succeed later."""
class SlurmBackend(SlurmQueries, Backend):
    """Shims inside SLURM allocations; the scheduler's tools on this machine's PATH,
    pointed at the cluster by the daemon's environment (`SLURM_CONF`)."""

    observes_locally = False

    def __init__(self, jobs_dir: Path, *, publish_interval_s: float = 2.0):
        """`publish_interval_s`: how often each job's shim publishes its readings
        (`observed.jsonl`; the daemon's tick interval)."""
        self.jobs_dir = jobs_dir
        self.publish_interval_s = publish_interval_s
        self._listing: dict[str, SlurmJob] | None = None
        self._listed_at = 0.0
        self._unreachable: str | None = None
        """squeue's last error, until it answers again."""
        self._failed_at = 0.0
        self._finals: dict[str, SlurmJob | None] = {}
        """Final states looked up one by one (scontrol, sacct), kept: they never change."""
        self._ids: dict[Path, str] = {}
        """SLURM job ids by attempt dir (`scheduler_job_id`), until the attempt ends."""
        self._queued: dict[Path, bool] = {}
        """Per attempt dir, whether squeue last listed it queued (`queued`; kept while
        SLURM does not answer)."""
        self._running_since: dict[Path, float] = {}
        """Per attempt dir that left the queue, when it began running (`running_since`)."""

    @classmethod
    def from_settings(cls, settings: Settings, *, on_exit: Callable[[], None]) -> SlurmBackend:
        """Its shims publish their readings every tick interval; an exit is found by the
        tick's squeue (no pidfd reaches another node: `on_exit` is not called)."""
        return cls(settings.jobs_dir, publish_interval_s=settings.sample_interval)

    @classmethod
    def check_usable(cls) -> None:
        """sbatch must be on the daemon's PATH."""
        if shutil.which("sbatch") is None:
            raise InvalidSpec("backend: `slurm`, but sbatch is not on the daemon's PATH",
                              hint="run the daemon on a machine that can submit SLURM "
                                   "jobs (docs/scale-out.md), or submit with backend "
                                   "`local`",
                              field="backend")

    # -- Backend ----------------------------------------------------------------------
    def queued(self, attempt: Attempt) -> bool:
        """SLURM lists the job PENDING (or CONFIGURING: its nodes being readied); while
        SLURM does not answer, what it last said (not queued if it never did). Queued
        again after it ran (a requeue) is a new wait: its run starts anew after it."""
        try:
            job = self._find(attempt)
        except SlurmUnreachable:
            return self._queued.get(attempt.dir, False)
        queued = job is not None and job.queued
        self._queued[attempt.dir] = queued
        if queued:
            self._running_since.pop(attempt.dir, None)
        return queued

    def running_since(self, attempt: Attempt, now: float) -> float | None:
        """When the worker started on its node (`worker.json`'s time, moved onto the
        daemon's clock by the current offset between the two, as the shim's readings
        are; never later than `now`), else when the daemon first saw the job out of the
        queue: the first look after the queue, or after a daemon restart."""
        if self._queued.get(attempt.dir, False):
            return None
        since = self._running_since.get(attempt.dir)
        if since is None:
            worker = files.read_worker(attempt.dir)
            since = now if worker is None else min(now, worker.started_at - (time.time() - now))
            self._running_since[attempt.dir] = since
        return since

    def start(self, job_id: str, number: int, spec: JobSpec, *, cwd: str,
              stop_grace_s: float) -> Attempt:
        adir = write_launch(self.jobs_dir, job_id, number, spec, cwd=cwd,
                            stop_grace_s=stop_grace_s, argv=worker_argv(spec),
                            inherit_env=["SLURM_"],
                            observe=observe_request(spec, self.publish_interval_s))
        script = adir / BATCH_SCRIPT
        script.write_text(
            "#!/bin/sh\n# the job's jobsup shim, inside the allocation (docs/scale-out.md)\n"
            f"export PYTHONPATH={shlex.quote(package_root_on_path())}\n"
            f"exec {shlex.quote(sys.executable)} -m supervisor.runtime.shim "
            f"{shlex.quote(str(adir))}\n")
        name = job_name(job_id, number)
        try:
            done = self._run(sbatch_argv(spec, adir, name))
        except subprocess.SubprocessError as exc:
            self._give_up(adir)
            raise LaunchDeferred(f"SLURM did not take the job (sbatch: {exc})") from None
        if done.returncode != 0:
            error = done.stderr.strip()
            if any(words in error for words in TRANSIENT_ERRORS):
                self._give_up(adir)
                raise LaunchDeferred(f"SLURM did not take the job ({error})")
            raise OSError(f"sbatch refused the job: {error}")
        slurm_id = done.stdout.strip().split(";")[0]
        atomic_write_json(adir / SLURM_FILE, {"job_id": slurm_id, "name": name})
        self._listing = None
        log.info("job %s: attempt %d submitted to SLURM as job %s", job_id, number, slurm_id)
        return Attempt(job_id, number, adir)

    @staticmethod
    def _give_up(adir: Path) -> None:
        """Claim an attempt whose submission failed for the daemon: had SLURM taken the
        job after all (sbatch timed out after the controller accepted it), its shim
        finds the claim taken and starts nothing; the next attempt runs the job."""
        try:
            create_json_exclusive(adir / files.CLAIM, files.Claim(by="daemon",
                                                                 pid=os.getpid()))
        except OSError as exc:
            log.warning("cannot claim %s (%s)", adir, exc)

    def attempt(self, job_id: str, number: int, shim_pid: int | None,
                shim_create_time: float | None, shim_start_ticks: int | None,
                shim_boot_id: str | None = None) -> Attempt:
        return Attempt(job_id, number, files.attempt_dir(self.jobs_dir, job_id, number))

    def shim_state(self, attempt: Attempt, stat_of: StatReader | None = None) -> ShimState:
        """RUNNING while SLURM lists the job as pending, running, completing or
        suspended, or cannot be asked; GONE once it lists a final state or none."""
        try:
            job = self._find(attempt)
        except SlurmUnreachable as exc:
            if self._unreachable != str(exc):
                log.warning("squeue failed (%s); SLURM jobs count as running until it "
                            "answers", exc)
            self._unreachable = str(exc)
            return ShimState.RUNNING
        self._unreachable = None
        return ShimState.RUNNING if job is not None and job.active else ShimState.GONE

    def status_note(self, attempt: Attempt) -> str | None:
        if self._unreachable is not None:
            return f"SLURM does not answer ({self._unreachable})"
        try:
            job = self._find(attempt)
        except SlurmUnreachable:
            return None
        if job is None:
            return None
        if job.state == "PENDING":
            why = PENDING_REASONS.get(job.reason, "")
            return (f"queued in SLURM (job {job.id}): {job.reason}"
                    + (f", {why}" if why else ""))
        if job.state in ("RUNNING", "COMPLETING"):
            return f"running in SLURM (job {job.id}) on {job.nodes}"
        return f"SLURM job {job.id} {job.state.lower()}" + (
            f" ({job.reason})" if job.reason not in ("", "None") else "")

    def worker_alive(self, worker: WorkerInfo) -> bool:
        """Asked only once SLURM lists the job ended: its allocation, and every process
        in it, is gone (the pid is a compute node's, never looked up here)."""
        return False

    def _ended(self, attempt: Attempt) -> SlurmJob | None:
        try:
            job = self._find(attempt)
        except SlurmUnreachable:
            return None
        if job is None or job.active:
            return None
        return self._final(job)

    def read_exit(self, attempt: Attempt) -> ExitStatus | None:
        """The shim's record, its `stop_requested` true only when jobsup asked (SLURM's
        time limit and an outside scancel reach the shim as a SIGTERM too); without
        one, the exit SLURM recorded, once it lists the job ended."""
        asked = (attempt.dir / STOP_FILE).exists()
        status = files.read_exit(attempt.dir)
        if status is not None:
            return ExitStatus(status.exit_code, status.signal, status.ended_at, asked,
                              status.killed_after_grace, status.max_rss_bytes,
                              status.spawn_error, status.oom_kills)
        job = self._ended(attempt)
        if job is None:
            return None
        return ExitStatus(exit_code=job.exit_code, signal=job.signal, ended_at=time.time(),
                          stop_requested=asked, killed_after_grace=False, max_rss_bytes=0,
                          spawn_error=None)

    def scheduler_end(self, attempt: Attempt) -> SchedulerEnd | None:
        job = self._ended(attempt)
        if job is None:
            return None
        return end_of(job, jobsup_cancelled=(attempt.dir / STOP_FILE).exists(),
                       shim_recorded=files.read_exit(attempt.dir) is not None)

    def request_stop(self, attempt: Attempt, worker: WorkerInfo | None) -> None:
        """Record the stop, then SIGTERM to the shim alone (it runs the grace), or a
        cancel if the job has not started."""
        atomic_write_json(attempt.dir / STOP_FILE, {"by": "jobsup", "at": time.time()})
        job = self._find_quietly(attempt)
        if job is None:
            return
        if job.state == "RUNNING":
            self._scancel(job.id, "--batch", "--signal=TERM")
        else:
            self._scancel(job.id)

    def kill(self, attempt: Attempt, worker: WorkerInfo | None) -> None:
        """The backstop: a plain scancel (SLURM's SIGTERM, KillWait, SIGKILL)."""
        job = self._find_quietly(attempt)
        if job is not None:
            self._scancel(job.id)

    def settle_launch(self, attempt: Attempt) -> LaunchFate:
        """SLURM knows no job of this attempt and it left no record: claim it (a late
        shim then starts nothing) and launch again; a shim that claimed it died."""
        try:
            attempt.dir.mkdir(parents=True, exist_ok=True)
            claimed = create_json_exclusive(attempt.dir / files.CLAIM,
                                            files.Claim(by="daemon", pid=os.getpid()))
        except OSError as exc:
            log.warning("job %s: cannot claim attempt %d (%s)", attempt.job_id,
                        attempt.number, exc)
            return LaunchFate.WAIT
        claim = files.read_claim(attempt.dir)
        if claimed or (claim is not None and claim["by"] == "daemon"):
            return LaunchFate.ABANDONED
        return LaunchFate.DEAD

    def forget(self, attempt: Attempt) -> None:
        self._ids.pop(attempt.dir, None)
        self._queued.pop(attempt.dir, None)
        self._running_since.pop(attempt.dir, None)

    def reap(self) -> None:
        """A new tick: ask squeue afresh."""
        self._listing = None
