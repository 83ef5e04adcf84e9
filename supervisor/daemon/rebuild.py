"""Rebuilding the jobs from the data dir, for a database that lost them.

Every job leaves a directory behind, `DATA_DIR/jobs/ID/`: its record (`job.json`,
written at submit, before the `201`) and one directory per attempt with the files of
its launch, its shim, its worker and its exit (`launch.json`, `shim.json`,
`worker.json`, `status.json`; named, and read, by `runtime/files.py`). From these alone
each job is recreated: its spec, and its state from its newest attempt. A job still
running is recreated `running` with its shim's and worker's identities, so the engine
re-adopts it as after any restart; one that ended gets its exit as the engine would
have classified it. Two markers the daemon leaves in the job's directory come first
(`store.END_RECORD`, `store.STOP_RECORD`): a job whose end was recorded ends as recorded
(a job stopped while pending, or failed by a failed dependency, has no attempt to tell
it), and its alerts about how it ended (`crashed`, `incomplete`) are restored as firing,
not sent again; a job a person stopped is not started again. When a rebuild happens is
`recovery.py`'s business.

What a rebuild cannot bring back: samples, alerts other than those of a recorded end,
notifications (a `succeeded` message of the last 10 minutes goes again) and the event
history; the exact restart count (taken from the attempt number); for a job submitted
before job records existed, all of its spec but argv, cwd, env and stop grace.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from supervisor.alerting import rules
from supervisor.alerting.recorder import job_facts
from supervisor.backends.local import worker_group_alive
from supervisor.backends.slurm_query import SLURM_FILE
from supervisor.config import Settings
from supervisor.daemon import lifecycle
from supervisor.daemon.checks import restarts_of
from supervisor.observe.progress_file import from_progress_file
from supervisor.observe.view import JobView, ProgressRecord, progress_json
from supervisor.runtime import files
from supervisor.runtime.fileio import read_json, tail_lines
from supervisor.runtime.files import attempt_dir, launched_from, log_path, progress_path
from supervisor.runtime.procfs import boot_id_or_none, is_same_process
from supervisor.spec import (
    ExitReason,
    JobSpec,
    JobState,
    RestartPolicy,
    stored_spec,
)
from supervisor.storage import store
from supervisor.storage.store import END_RECORD, JOB_RECORD, STOP_RECORD
from supervisor.storage.tables import Job

log = logging.getLogger(__name__)


REBUILT = "rebuilt from the data dir after the database was lost"
"""The start of the reason of the one event a rebuilt job has."""

LAUNCH_ENV = frozenset({"JOBSUP_JOB_ID", "JOBSUP_ATTEMPT", "JOBSUP_PROGRESS_FILE",
                        "PYTHONUNBUFFERED"})
"""What `launcher.job_environment` adds to every job: not part of its spec."""

@dataclass
class RebuildSummary:
    states: Counter[str] = field(default_factory=Counter)
    skipped: list[str] = field(default_factory=list)
    """Directories nothing could be rebuilt from."""
    from_launch: int = 0
    """Jobs without a `job.json` (submitted before it existed), rebuilt from launch.json."""

    @property
    def rebuilt(self) -> int:
        return sum(self.states.values())

    @property
    def running(self) -> int:
        return self.states[JobState.RUNNING.value]


# -- rebuilding ---------------------------------------------------------------------


def job_dirs(jobs_dir: Path) -> list[Path]:
    """The job directories under `jobs_dir` (dot-directories and files ignored)."""
    try:
        entries = list(os.scandir(jobs_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(Path(e.path) for e in entries
                  if e.is_dir(follow_symlinks=False) and not e.name.startswith("."))


def attempt_numbers(jdir: Path) -> list[int]:
    numbers = []
    for entry in os.scandir(jdir):
        prefix, _, number = entry.name.partition("-")
        if prefix == "attempt" and number.isdigit() and entry.is_dir(follow_symlinks=False):
            numbers.append(int(number))
    return sorted(numbers)


def rebuild(session: Session, jobs_dir: Path, now: float, *,
            settings: Settings) -> RebuildSummary:
    """Recreate a Job row (and one JobEvent) for each job directory the database does
    not know; the caller commits. A directory that holds neither a job record nor an
    attempt's launch file is skipped with a warning."""
    summary = RebuildSummary()
    known = set(session.scalars(select(Job.id)))
    here = launched_from(settings.data_dir, jobs_dir)  # its files are here
    for jdir in job_dirs(jobs_dir):
        job_id = jdir.name
        if len(job_id) > 32 or job_id in known:
            continue
        try:
            rebuilt = _rebuild_job(jobs_dir, jdir, now, settings)
        except Exception as exc:  # one odd directory must not keep the daemon from starting
            rebuilt = f"{type(exc).__name__}: {exc}"
        if isinstance(rebuilt, str):
            log.warning("job %s: not rebuilt from %s (%s)", job_id, jdir, rebuilt)
            summary.skipped.append(job_id)
            continue
        job, event_reason, from_launch, told = rebuilt
        job.data_dir_id, job.jobs_dir = here
        store.restore_job(session, job, reason=event_reason, now=now)
        if told:
            session.flush()  # the job's row before its alerts' (a foreign key)
        for alert in told:  # its end was told before: firing, not sent again
            store.open_alert(session, job_id=job.id, rule=alert.rule, severity=alert.severity,
                             message=alert.message, started_at=job.ended_at or now)
            log.info("job %s: alert %s restored as firing (told before the database was "
                     "lost: not sent again)", job.id, alert.rule)
        summary.states[job.state] += 1
        summary.from_launch += from_launch
        log.info("job %s rebuilt: %s (%s)", job.id, job.state, job.reason or "")
    session.flush()
    return summary


def _rebuild_job(jobs_dir: Path, jdir: Path, now: float,
                 settings: Settings) -> tuple[Job, str, bool, list[rules.Firing]] | str:
    """(the job, its event's reason, whether its spec came from a launch.json, the
    alerts of an end that was told already), or why nothing can be rebuilt."""
    numbers = attempt_numbers(jdir)
    record = read_json(jdir / JOB_RECORD)
    from_launch = not (isinstance(record, dict) and isinstance(record.get("spec"), dict))
    if not from_launch:
        assert isinstance(record, dict)
        spec = stored_spec(json.dumps(record["spec"]))  # lenient: an older daemon wrote it
        created_at = float(record.get("created_at") or _mtime(jdir / JOB_RECORD, now))
        source = JOB_RECORD
    else:
        found = _spec_from_launch(jobs_dir, jdir.name, numbers)
        if found is None:
            return f"neither {JOB_RECORD} nor an attempt's launch.json"
        spec, created_at = found
        source = "launch.json: no job.json, so its name, output and restart policy are unknown"

    job = Job(id=jdir.name, name=spec.name, spec_json=spec.model_dump_json(),
              state=JobState.PENDING.value, created_at=created_at, attempt=0, restarts=0)
    if numbers:
        state, reason = _from_attempt(jobs_dir, job, spec, numbers[-1], now, settings)
    else:
        state, reason = JobState.PENDING, "not started yet"
    recorded = _recorded_end(jdir, job, spec, now)
    if recorded is not None:
        state, reason = recorded
    elif not state.ended and (jdir / STOP_RECORD).exists():
        state, reason = _stopped(job, state, reason, now)
    job.state, job.reason = state.value, reason
    progress = from_progress_file(progress_path(jobs_dir, job.id))
    read = None if progress is None else ProgressRecord(
        items_done=progress.items_done,
        items_total=progress.items_total or spec.expected_items,
        source="progress_file", metrics=progress.metrics)
    if read is not None:
        job.progress_json = progress_json(read)
    told = [] if recorded is None else [
        alert for alert in rules.evaluate(
            job_facts(job, JobView(progress=read) if read else None),
            now=now, settings=rules.AlertSettings())
        if alert.rule in rules.EVENT_RULES]
    return job, f"{REBUILT} (from {source}): {reason}", from_launch, told


def _recorded_end(jdir: Path, job: Job, spec: JobSpec,
                  now: float) -> tuple[JobState, str] | None:
    """The end the daemon recorded for the job's newest attempt (`store.END_RECORD`), set
    on the job; None when there is none (it runs, waits, or ended unrecorded: while no
    daemon ran, or before end records existed)."""
    record = read_json(jdir / END_RECORD)
    if not isinstance(record, dict) or record.get("attempt") != job.attempt:
        return None
    try:
        state = JobState(str(record.get("state")))
        exit_reason = (ExitReason(record["exit_reason"]) if record.get("exit_reason")
                       else None)
    except ValueError:
        return None
    if not state.ended:
        return None
    job.exit_reason = exit_reason.value if exit_reason is not None else None
    job.exit_code, job.signal = _integer(record.get("exit_code")), _integer(record.get("signal"))
    ended_at = record.get("ended_at")
    job.ended_at = float(ended_at) if isinstance(ended_at, int | float) else now
    job.next_start_at = None
    job.restarts = (min(max(job.attempt - 1, 0), spec.max_restarts)
                    if spec.restart_policy is RestartPolicy.ON_FAILURE else 0)
    reason = record.get("reason")
    return state, reason if isinstance(reason, str) else f"{state.value} (recorded)"


def _stopped(job: Job, state: JobState, reason: str, now: float) -> tuple[JobState, str]:
    """A job a person stopped (`store.STOP_RECORD`) whose end was not recorded: one
    waiting to start (or to restart) is stopped; one running is stopped by the engine
    (its stop request restored)."""
    if state is JobState.RUNNING:
        job.stop_requested_at = now
        return state, f"{reason}; stopping: a stop was requested"
    job.exit_reason, job.ended_at, job.next_start_at = ExitReason.STOPPED.value, now, None
    return JobState.STOPPED, "stopped on request before it started"


def _integer(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _spec_from_launch(jobs_dir: Path, job_id: str,
                      numbers: list[int]) -> tuple[JobSpec, float] | None:
    """A job submitted before job records existed: argv, cwd, env and stop grace from
    its newest launch.json; its env without what the launcher adds and without what
    this daemon's environment holds alike (inherited, not asked for)."""
    for number in reversed(numbers):
        launch = files.read_launch(attempt_dir(jobs_dir, job_id, number))
        if launch is None:
            continue
        argv = launch["argv"]
        env = {k: v for k, v in launch["env"].items()
               if k not in LAUNCH_ENV and os.environ.get(k) != v}
        spec = JobSpec(name=shlex.join(argv)[:128] or "job", command=argv,
                       cwd=launch["cwd"], env=env, stop_grace_s=launch["stop_grace_s"])
        first = attempt_dir(jobs_dir, job_id, numbers[0]) / files.LAUNCH
        return spec, _mtime(first, _mtime(first.parent, time.time()))
    return None


def _from_attempt(jobs_dir: Path, job: Job, spec: JobSpec, number: int,
                  now: float, settings: Settings) -> tuple[JobState, str]:
    """Fill the job's attempt, processes and exit from attempt `number`'s files."""
    adir = attempt_dir(jobs_dir, job.id, number)
    job.attempt = number
    job.restarts = (min(number - 1, spec.max_restarts)
                    if spec.restart_policy is RestartPolicy.ON_FAILURE else 0)
    shim, worker = files.read_shim(adir), files.read_worker(adir)
    if worker is not None:
        store.record_worker(job, worker)
    job.started_at = (worker.started_at if worker is not None and worker.started_at
                      else _mtime(adir / files.LAUNCH, _mtime(adir, now)))
    if shim is not None:
        job.shim_pid, job.shim_create_time = shim["pid"], shim["create_time"]
        job.shim_start_ticks = shim.get("start_ticks")
        job.shim_boot_id = boot_id_or_none(shim.get("boot_id"))  # a job-writable file

    started = f"started (attempt {number})"
    if (adir / SLURM_FILE).exists():
        # a SLURM attempt: its shim and worker are not this machine's processes, and its
        # end may be SLURM's (a time limit, a cancel); the engine asks the scheduler
        return JobState.RUNNING, (f"{started} in SLURM; re-adopted after the database was "
                                  "rebuilt")
    status = files.read_exit(adir)
    if status is not None:
        return _ended(jobs_dir, job, status, now, settings)
    if is_same_process(job.shim_pid, job.shim_create_time, job.shim_start_ticks,
                       job.shim_boot_id):
        return JobState.RUNNING, f"{started}; re-adopted after the database was rebuilt"
    if worker is not None and worker_group_alive(worker):
        return JobState.RUNNING, (f"{started}; its shim is gone, its worker re-adopted after "
                                  "the database was rebuilt")
    if shim is None and worker is None:
        # launched just before the database was lost: the engine settles the launch
        # through the attempt's claim file (launched again, waited for, or lost)
        return JobState.RUNNING, f"{started} just before the database was lost"
    job.exit_reason, job.ended_at = ExitReason.LOST.value, now
    return JobState.LOST, ("its processes vanished without recording an exit status (found "
                           "when the database was rebuilt)")


def _ended(jobs_dir: Path, job: Job, status: files.ExitStatus,
           now: float, settings: Settings) -> tuple[JobState, str]:
    """A recorded exit, from status.json, as the engine decides it when the shim records
    it (`checks.JobChecks.finish`): the same `lifecycle.exit_of` and `after_exit`, set on
    the job as `store.transition` writes a decision. What only a live daemon knew is not
    in the data dir: that a stop was its own on its way out, its backstop's SIGKILL, or
    that the jobs a job served had ended (a stop is "on request")."""
    job.exit_code, job.signal = status.exit_code, status.signal
    lines: list[str] = []
    if lifecycle.is_failure(status, stop_requested=status.stop_requested):
        lines, _ = tail_lines(log_path(jobs_dir, job.id, job.attempt), rules.LOG_TAIL_LINES)
    decision = lifecycle.after_exit(
        lifecycle.exit_of(status, stop_requested=status.stop_requested, log_tail=lines),
        restarts_of(job, settings))
    if decision.exit_reason is not None:
        job.exit_reason = decision.exit_reason.value
    if decision.restart_in_s is not None:  # as `store.transition(restart_at=...)`
        job.restarts += 1
        job.next_start_at = now + decision.restart_in_s
    if decision.state.ended:
        # a rebuild runs on the system clock (`recovery.open_database`'s `now`), the
        # shim's: its stamp needs no moving (and the start it has may be a file's mtime)
        job.ended_at = lifecycle.end_time(status.ended_at, now=now, offset_s=0.0)
    return decision.state, decision.reason


def _mtime(path: Path, default: float) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return default
