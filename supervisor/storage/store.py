"""Reads and writes of jobs, their events, samples and alerts. A job's state changes only
through `transition`, an alert's only through `open_alert` / `resolve_alert`; the
notification outbox has its own module (`outbox.py`)."""

from __future__ import annotations

import contextlib
import errno
import logging
import secrets
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Integer, bindparam, delete, func, insert, or_, select, text, update
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from supervisor.backends.base import Attempt
from supervisor.errors import (
    AmbiguousJob,
    Conflict,
    IllegalTransition,
    JobNotFound,
    JobRecordUnwritable,
)
from supervisor.runtime.fileio import atomic_write_json
from supervisor.runtime.files import WorkerInfo
from supervisor.spec import ENDED_STATES, AlertState, ExitReason, JobSpec, JobState, stored_spec
from supervisor.storage.database import UNCOMMITTED_JOB_RECORDS
from supervisor.storage.tables import Alert, Job, JobEvent, Sample, SampleRecord

log = logging.getLogger(__name__)


def new_job_id(session: Session) -> str:
    """8 hex digits: short enough to type, checked against the table for collisions."""
    while True:
        job_id = secrets.token_hex(4)
        if session.get(Job, job_id) is None:
            return job_id


def create_job(session: Session, *, spec: JobSpec, now: float) -> Job:
    job = Job(
        id=new_job_id(session), name=spec.name, spec_json=spec.model_dump_json(),
        state=JobState.PENDING.value, created_at=now, attempt=0, restarts=0,
    )
    session.add(job)
    session.add(JobEvent(job_id=job.id, t=now, from_state=None, to_state=job.state,
                         reason="submitted"))
    return job


JOB_RECORD = "job.json"
"""A job's record in its directory, `DATA_DIR/jobs/ID/job.json`: what the database
holds at submit, so a lost database can be rebuilt from the data dir (recovery.py)."""


def job_record(job: Job) -> dict[str, object]:
    return {"id": job.id, "name": job.name, "created_at": job.created_at,
            "spec": JobSpec.model_validate_json(job.spec_json).model_dump(mode="json")}


def write_job_record(session: Session, job: Job, jobs_dir: Path) -> Path:
    """Write the job's record before its submission commits, or JobRecordUnwritable.
    Until the session commits, the record is listed in its `info`, and removed if the
    transaction ends without a commit (db.make_sessionmaker)."""
    path = jobs_dir / job.id / JOB_RECORD
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, job_record(job))
    except OSError as exc:
        with contextlib.suppress(OSError):  # the directory this call made, if empty
            path.parent.rmdir()
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise  # a full disk: the API answers 503 with a hint (retry once freed)
        raise JobRecordUnwritable(
            f"cannot write the job's record {path}: {exc.strerror or exc}; the job was "
            "not submitted",
            hint=f"make {jobs_dir} writable (free space on its disk), then submit again",
        ) from None
    session.info.setdefault(UNCOMMITTED_JOB_RECORDS, []).append(path)
    return path


END_RECORD = "end.json"
"""How a job ended, in its directory, `DATA_DIR/jobs/ID/end.json`: written as its end is
recorded (`transition`), so a database rebuilt from the data dir ends it the same way
(`daemon/rebuild.py`), also a job that ended without an attempt of its own (stopped
while pending, failed by its dependency), and knows that its end was told (its alerts
are not sent again). Fields: `attempt` (the one it ended, 0 for none), `state`,
`reason`, `exit_reason`, `exit_code`, `signal`, `ended_at`."""

STOP_RECORD = "stop.json"
"""A person's stop of the job, `DATA_DIR/jobs/ID/stop.json` (`requested_at`): written
with the request, before the engine acts on it, so a database lost meanwhile does not
bring the job back to run (`daemon/rebuild.py`). Removed by a restart (`requeue`)."""


def _job_dir(session: Session, job_id: str) -> Path | None:
    """The job's directory, where the session knows the jobs dir (the daemon's do)."""
    jobs_dir = session.info.get("jobs_dir")
    return Path(jobs_dir) / job_id if jobs_dir is not None else None


def _write_marker(session: Session, job_id: str, name: str, data: Mapping[str, Any]) -> None:
    """Write one of the job's markers (`END_RECORD`, `STOP_RECORD`); a data dir that
    refuses it (full, read-only) costs only the rebuild's knowledge of it (warned).
    Not fsynced: what it guards against is a database lost or deleted, not a power
    cut (the rename is atomic; the job's directory exists from its submit)."""
    jdir = _job_dir(session, job_id)
    if jdir is None:
        return
    try:
        atomic_write_json(jdir / name, data, fsync=False)
    except OSError as exc:
        # a full or read-only data dir is logged once by `Writability`; an end the
        # database refused too is decided, and so written, again each tick
        quiet = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)
        log.log(logging.DEBUG if quiet else logging.WARNING,
                "job %s: cannot write %s (%s): a database rebuilt from the data dir "
                "would not know it", job_id, jdir / name, exc.strerror or exc)


def _remove_markers(session: Session, job_id: str) -> None:
    jdir = _job_dir(session, job_id)
    if jdir is None:
        return
    for name in (END_RECORD, STOP_RECORD):
        try:
            (jdir / name).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("job %s: cannot remove %s (%s)", job_id, jdir / name,
                        exc.strerror or exc)


def get_job(session: Session, job_id: str) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise JobNotFound(job_id)
    return job


AMBIGUOUS_LISTED = 10
"""Candidates an ambiguous reference's error lists (the rest are counted)."""


def find_job(session: Session, reference: str) -> Job:
    """The job a person's reference names, as docker and git read one: its id; else the
    one job of that name; else the one job whose id starts with it. JobNotFound when none
    does, AmbiguousJob (listing the candidates, newest first) when it names several: a
    name given to several jobs, or a start shared by several ids. Every API route under
    `/jobs/{job_id}` and the job page resolve their id through here."""
    job = session.get(Job, reference)
    if job is not None:
        return job
    found = _matches(session, Job.name == reference)
    what = "the name"
    if not found and reference:
        # substr, not LIKE: SQLite's LIKE ignores case, and ids are lower-case hex
        found = _matches(session, func.substr(Job.id, 1, len(reference)) == reference)
        what = "the start of the ids"
    if not found:
        raise JobNotFound(reference)
    if len(found) == 1:
        return found[0]
    listed = [f"{j.id} ({j.name}, {j.state})" for j in found[:AMBIGUOUS_LISTED]]
    raise AmbiguousJob(reference, what, listed, more=len(found) - len(listed))


def _matches(session: Session, condition: Any) -> Sequence[Job]:
    return session.scalars(select(Job).where(condition)
                           .order_by(Job.created_at.desc(), Job.id)).all()


def list_jobs(session: Session, *, state: JobState | None = None,
              spec_like: str | None = None) -> Sequence[Job]:
    """The jobs, oldest first; `spec_like`: only those whose stored spec matches this
    LIKE pattern (a narrowing: the caller checks what it wants of the spec)."""
    query = select(Job).order_by(Job.created_at, Job.id)
    if state is not None:
        query = query.where(Job.state == state.value)
    if spec_like is not None:
        query = query.where(Job.spec_json.like(spec_like))
    return session.scalars(query).all()


def count_firing_alerts(session: Session) -> int:
    """How many alerts fire now, of every job."""
    return session.scalar(select(func.count()).select_from(Alert)
                          .where(Alert.state == AlertState.FIRING.value)) or 0


def count_by_state(session: Session) -> dict[str, int]:
    """How many jobs are in each state (those with any)."""
    return {state: count for state, count in session.execute(
        select(Job.state, func.count()).group_by(Job.state))}


def output_dirs_of_running(session: Session) -> list[tuple[str, str | None]]:
    """(id, output dir) of each running job, read from its spec."""
    return [(job_id, stored_spec(spec_json).output_dir) for job_id, spec_json in
            session.execute(select(Job.id, Job.spec_json)
                            .where(Job.state == JobState.RUNNING.value))]


def spec_jsons_like(session: Session, pattern: str) -> list[str]:
    """The stored specs matching this LIKE pattern."""
    return list(session.scalars(select(Job.spec_json).where(Job.spec_json.like(pattern))))


# The queries every tick runs are built once, with their values as parameters: building
# a statement each time cost ~70 us, a third of running a small one (#15).

_JOBS_IN_STATES = (select(Job).where(Job.state.in_(bindparam("states", expanding=True)))
                   .order_by(Job.created_at, Job.id).execution_options(populate_existing=True))


def jobs_in_states(session: Session, *states: JobState) -> Sequence[Job]:
    """The jobs in these states now. Rows the session already holds are refreshed from
    the database (`populate_existing`): a tick's session keeps the objects it loaded, and
    the API may have changed a row since (a restart requeues a job the tick recorded as
    ended moments before; its stale copy would undo it)."""
    return session.scalars(_JOBS_IN_STATES, {"states": [s.value for s in states]}).all()


_JOBS_ENDED_SINCE = (select(Job).where(Job.ended_at >= bindparam("since"))
                     .order_by(Job.ended_at, Job.id))


def jobs_ended_since(session: Session, since: float) -> Sequence[Job]:
    return session.scalars(_JOBS_ENDED_SINCE, {"since": since}).all()


_TICK_JOBS = (select(Job).where(or_(Job.state == JobState.RUNNING.value,
                                    Job.ended_at >= bindparam("since")))
              .order_by(Job.created_at, Job.id).execution_options(populate_existing=True))


def jobs_of_tick(session: Session, *, ended_since: float) -> Sequence[Job]:
    """The running jobs and those that ended since `ended_since`, in one query
    (`jobs_in_states` + `jobs_ended_since`: each query costs ~0.3 ms even when it finds
    nothing, #15); refreshed as `jobs_in_states`'s are. Not the pending jobs: there may
    be thousands, waiting on one dependency, and a full row costs ~30 us to load
    (`pending_jobs`, #30)."""
    return session.scalars(_TICK_JOBS, {"since": ended_since}).all()


class PendingJob(NamedTuple):
    """What the tick reads of every pending job to tell whether it can act on it (a
    stop, a dependency's end, a launch); the full row is loaded only for those."""

    id: str
    name: str
    stop_requested_at: float | None
    next_start_at: float | None


_PENDING_JOBS = (select(Job.id, Job.name, Job.stop_requested_at, Job.next_start_at)
                 .where(Job.state == JobState.PENDING.value).order_by(Job.created_at, Job.id))


def pending_jobs(session: Session) -> list[PendingJob]:
    """The pending jobs, oldest first (a dependency is always older than its dependents),
    as four columns each: 10,000 of them read in ~10 ms, where their rows took ~0.3 s."""
    return [PendingJob(*row) for row in session.execute(_PENDING_JOBS)]


class PendingSummary(NamedTuple):
    """What tells whether the pending jobs changed since an earlier look, in one row
    (~5 ms for 10,000 pending jobs, where reading them took ~50 ms; #30). Only the engine
    takes a job out of `pending` (its launch, stop or failure: it knows when it did);
    anyone else's change is a submit or restart (`jobs` and `newest` grow: a restarted
    job is old, but it is one more) or a stop asked (`stops` grows)."""

    jobs: int
    newest: float | None
    stops: int
    first_start_at: float | None
    """The earliest `next_start_at` (a restart's backoff): a pending job may start then."""


_PENDING_SUMMARY = select(func.count(), func.max(Job.created_at),
                          func.count(Job.stop_requested_at), func.min(Job.next_start_at)
                          ).where(Job.state == JobState.PENDING.value)


def pending_summary(session: Session) -> PendingSummary:
    count, newest, stops, first_start_at = session.execute(_PENDING_SUMMARY).one()
    return PendingSummary(count or 0, newest, stops or 0, first_start_at)


IN_CHUNK = 500
"""Ids per `IN (...)` list: far below SQLite's and PostgreSQL's bound parameter limits."""


def _chunks(ids: Collection[str]) -> Iterator[list[str]]:
    listed = sorted(set(ids))
    for start in range(0, len(listed), IN_CHUNK):
        yield listed[start:start + IN_CHUNK]


def spec_jsons(session: Session, ids: Collection[str]) -> dict[str, str]:
    """The stored spec of each of these jobs, by id."""
    found: dict[str, str] = {}
    for chunk in _chunks(ids):
        found.update((job_id, spec_json) for job_id, spec_json in session.execute(
            select(Job.id, Job.spec_json).where(Job.id.in_(chunk))))
    return found


def names_and_states(session: Session, ids: Collection[str]) -> dict[str, tuple[str, JobState]]:
    """(name, state) of each of these jobs that exists, by id, as the database has them
    now."""
    found: dict[str, tuple[str, JobState]] = {}
    for chunk in _chunks(ids):
        for job_id, name, state in session.execute(
                select(Job.id, Job.name, Job.state).where(Job.id.in_(chunk))):
            found[job_id] = (name, JobState(state))
    return found


def jobs_with_ids(session: Session, ids: Collection[str], *,
                  fresh: bool = False) -> dict[str, Job]:
    """The jobs of these ids that exist, by id, in one query (the rows the session
    holds as they are, like `session.get`; `fresh`: read again, as
    `jobs_in_states`'s are)."""
    if not ids:
        return {}
    query = select(Job).where(Job.id.in_(list(ids)))
    if fresh:
        query = query.execution_options(populate_existing=True)
    return {job.id: job for job in session.scalars(query)}


def existing_ids(session: Session, ids: Sequence[str]) -> set[str]:
    if not ids:
        return set()
    return set(session.scalars(select(Job.id).where(Job.id.in_(list(ids)))).all())


def start_attempt(session: Session, job: Job, *, now: float,
                  launched_from: tuple[str | None, str]) -> None:
    """A new attempt of a pending job: its number, no process or exit yet, running;
    `launched_from`: the launching daemon's data dir id and jobs dir (`Job.jobs_dir`)."""
    job.attempt += 1
    job.data_dir_id, job.jobs_dir = launched_from
    job.started_at, job.ended_at, job.next_start_at = now, None, None
    job.pid = job.pid_create_time = job.pid_start_ticks = job.pid_boot_id = None
    job.shim_pid = job.shim_create_time = job.shim_start_ticks = job.shim_boot_id = None
    job.exit_code = job.signal = job.exit_reason = None
    transition(session, job, JobState.RUNNING, now=now, reason=f"started (attempt {job.attempt})")


def record_shim(job: Job, attempt: Attempt) -> None:
    """The identity of the attempt's shim (pid, start ticks, boot id, create time)."""
    job.shim_pid, job.shim_create_time = attempt.shim_pid, attempt.shim_create_time
    job.shim_start_ticks, job.shim_boot_id = attempt.shim_start_ticks, attempt.shim_boot_id


def record_worker(job: Job, worker: WorkerInfo) -> None:
    """The identity of the worker the attempt's shim started."""
    job.pid, job.pid_create_time, job.pid_start_ticks = (worker.pid, worker.create_time,
                                                         worker.start_ticks)
    job.pid_boot_id = worker.boot_id


def recorded_worker(job: Job) -> WorkerInfo | None:
    """The worker the attempt's shim started, as its row recorded it (`record_worker`),
    None before it was: the daemon's own record, which outlives the attempt's
    `worker.json` (a job directory deleted, moved or emptied while the job runs, #46).
    `started_at` is the attempt's launch (the row does not keep the worker's own)."""
    if job.pid is None:
        return None
    return WorkerInfo(job.pid, job.pid_create_time, job.started_at or 0.0,
                      job.pid_start_ticks)


def record_exit(job: Job, *, exit_code: int | None, signal: int | None) -> None:
    """The attempt's exit status, as its shim recorded it (before the transition that
    follows from it)."""
    job.exit_code, job.signal = exit_code, signal


def stop_when_served(job: Job, *, now: float) -> None:
    """The engine stops a job whose `stop_when_ended` jobs have all ended."""
    job.stop_requested_at = now
    job.reason = "stopping: the jobs it served have ended"


def restore_job(session: Session, job: Job, *, reason: str, now: float) -> None:
    """A job rebuilt from the data dir (the database was lost): its row and the event
    that says where it came from."""
    session.add(job)
    session.add(JobEvent(job_id=job.id, t=now, from_state=None, to_state=job.state,
                         reason=reason))


def request_stop(session: Session, job_id: str, *, now: float, by_person: bool = True) -> None:
    """Record the stop; the engine acts on it in its next tick. A single UPDATE, so it
    never overwrites what the engine writes to the same row. A person's stop
    (`by_person`; not the daemon's own before it exits, which requeues the job) is also
    marked in the job's directory (`STOP_RECORD`)."""
    stopped = session.execute(
        update(Job).where(Job.id == job_id, Job.stop_requested_at.is_(None))
        .values(stop_requested_at=now)
    )
    if by_person and stopped.rowcount:  # type: ignore[attr-defined]
        _write_marker(session, job_id, STOP_RECORD, {"requested_at": time.time()})


def requeue(session: Session, job_id: str, *, now: float) -> Job:
    """A new attempt of an ended job (`POST /jobs/{id}/restart`): pending again, as soon
    as its dependencies allow, with its history kept (events, samples, alerts, the
    earlier attempts' directories and logs); the launch numbers the new attempt. It
    counts as one of the job's restarts (`attempt` stays `restarts` + 1). Conflict for a
    job that has not ended. The state is claimed by a guarded UPDATE first, so two
    requests at once requeue it once; the change itself goes through `transition`."""
    job = get_job(session, job_id)
    ended = [state.value for state in ENDED_STATES]
    claimed = session.execute(
        update(Job).where(Job.id == job_id, Job.state.in_(ended))
        .values(state=JobState.PENDING.value)
        .execution_options(synchronize_session=False))
    if not getattr(claimed, "rowcount", 0) or not JobState(job.state).ended:
        raise Conflict(f"job {job_id} has not ended ({job.state}): only an ended job can be "
                       "restarted", hint=f"stop it first (POST /api/v1/jobs/{job_id}/stop), "
                                          "then restart it")
    job.stop_requested_at = job.next_start_at = None
    job.ended_at = job.exit_code = job.signal = job.exit_reason = None  # the old attempt's
    job.restarts += 1
    _remove_markers(session, job_id)  # its old end, and the stop that made it
    transition(session, job, JobState.PENDING, now=now, reason="restart requested")
    return job


def events(session: Session, job_id: str) -> Sequence[JobEvent]:
    return session.scalars(
        select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.t, JobEvent.id)
    ).all()


def transition(session: Session, job: Job, to: JobState, *, now: float,
               reason: str | None, exit_reason: ExitReason | None = None,
               restart_at: float | None = None, retry_at: float | None = None,
               clear_stop: bool = False) -> None:
    """The one place a job's state changes: sets it (with why it ended, when its
    restart is due, counted as a restart, or when a launch that could not start is
    tried again, not counted; `clear_stop`: the stop request that ended its attempt is
    forgotten, as for one the daemon's exit made) and records the event. A change
    `spec.TRANSITIONS` does not allow raises IllegalTransition, nothing changed."""
    from_state = job.state
    if not JobState(from_state).can_become(to):
        raise IllegalTransition(f"job {job.id}: {from_state} -> {to.value} is not a "
                                f"transition the lifecycle allows ({reason or 'no reason'})")
    if clear_stop:
        job.stop_requested_at = None
    job.state = to.value
    job.reason = reason
    if exit_reason is not None:
        job.exit_reason = exit_reason.value
    if restart_at is not None:
        job.restarts += 1
        job.next_start_at = restart_at
    elif retry_at is not None:
        job.next_start_at = retry_at
    if to.ended:
        job.ended_at = now
        _write_marker(session, job.id, END_RECORD, {
            "attempt": job.attempt, "state": job.state, "reason": job.reason,
            "exit_reason": job.exit_reason, "exit_code": job.exit_code,
            "signal": job.signal, "ended_at": now})
    session.add(JobEvent(job_id=job.id, t=now, from_state=from_state, to_state=to.value,
                         reason=reason))
    log.info("job %s: %s -> %s (%s)", job.id, from_state, to.value, reason or "")


# -- samples ------------------------------------------------------------------------

SAMPLE_TIERS: tuple[tuple[float, float], ...] = ((6 * 3600.0, 60.0), (72 * 3600.0, 900.0))
"""(age in seconds, bucket in seconds): samples older than the age keep one row per
bucket. Full resolution for 6 h, one per minute to 3 days, one per 15 min after, so a
7-day job at 2 s keeps ~15k rows instead of ~300k."""


_SAMPLES = Sample.metadata.tables[Sample.__tablename__]
"""The samples' table, for the Core INSERT of `add_samples`."""

_SQLITE_INSERT_SAMPLES = (
    f"INSERT INTO {Sample.__tablename__} ({', '.join(SampleRecord._fields)}) "
    f"VALUES ({', '.join('?' for _ in SampleRecord._fields)})")
"""SQLite's: the tuples as they are, through the driver's executemany."""

WROTE = "jobsup.transaction_wrote"
"""`Session.info` key: the session's open transaction has sent a write to the database
(`note_written`; read by the tick's steps, `transactions.has_writes`)."""


def note_written(session: Session) -> None:
    """Mark that this session's open transaction sent a write the ORM does not see."""
    session.info[WROTE] = True


def add_samples(session: Session, samples: Sequence[SampleRecord]) -> None:
    """One tick's readings in one executemany INSERT, no ORM objects (a tick of 100 jobs
    built 100 instrumented `Sample`s and flushed them one by one), through the session's
    transaction. On SQLite the tuples go to the driver's executemany as they are: less
    than half the CPU of a Core INSERT, which builds a dict per row (#15; the ORM's bulk
    path cost ~1.4 times the Core one). On PostgreSQL the Core INSERT, which SQLAlchemy
    sends as one multi-row statement: one round trip to the server."""
    if not samples:
        return
    if session.get_bind().dialect.name == "sqlite":
        session.connection().exec_driver_sql(_SQLITE_INSERT_SAMPLES, list(samples))
        note_written(session)
    else:
        session.execute(insert(_SAMPLES), [sample._asdict() for sample in samples])


def write_probe(session: Session) -> None:
    """A write that changes nothing (alembic's version row, rewritten as it is): while
    the database refused writes and the tick had none of its own to try, whether it
    takes them again."""
    session.execute(text("UPDATE alembic_version SET version_num = version_num"))
    note_written(session)


def is_disk_full(exc: Exception) -> bool:
    """SQLITE_FULL ("database or disk is full"), or PostgreSQL's disk-full error. The
    driver's own message only (`exc.orig`): SQLAlchemy's text adds the statement's
    parameters, and a reason holding a log line about a full disk is not one."""
    text = str(getattr(exc, "orig", None) or exc).lower()
    return "database or disk is full" in text or "no space left on device" in text


def samples(session: Session, job_id: str, *, since: float | None = None,
            limit: int = 1000) -> Sequence[Sample]:
    """Oldest first: from `since` on, or the latest `limit` when no `since` is given."""
    query = select(Sample).where(Sample.job_id == job_id)
    if since is not None:
        query = query.where(Sample.t >= since).order_by(Sample.t, Sample.id).limit(limit)
        return session.scalars(query).all()
    latest = session.scalars(query.order_by(Sample.t.desc(), Sample.id.desc()).limit(limit))
    return list(reversed(latest.all()))


def latest_sample(session: Session, job_id: str) -> Sample | None:
    return session.scalars(
        select(Sample).where(Sample.job_id == job_id)
        .order_by(Sample.t.desc(), Sample.id.desc()).limit(1)
    ).first()


class time_bucket(FunctionElement[int]):  # noqa: N801 - an SQL function's name
    """`time_bucket(t, size)`: the number of the `size`-second bucket holding `t`,
    floor(t / size). SQLite's CAST to INTEGER truncates (floor, for times after 1970);
    PostgreSQL's rounds, so there it is FLOOR."""

    type = Integer()
    name = "time_bucket"
    inherit_cache = True


@compiles(time_bucket)
def _truncated(element: time_bucket, compiler: SQLCompiler, **kw: Any) -> str:
    t, size = element.clauses
    return f"CAST({compiler.process(t, **kw)} / {compiler.process(size, **kw)} AS INTEGER)"


@compiles(time_bucket, "postgresql")
def _floored(element: time_bucket, compiler: SQLCompiler, **kw: Any) -> str:
    t, size = element.clauses
    return f"FLOOR({compiler.process(t, **kw)} / {compiler.process(size, **kw)})"


def compact_samples(session: Session, *, now: float,
                    since: Mapping[float, float] | None = None) -> int:
    """Downsample old samples per SAMPLE_TIERS (keep the newest row of each bucket);
    returns how many rows were deleted. `since` maps a tier's age to the cutoff of its
    last pass: only rows that aged into the tier after it are read (from the start of
    the bucket holding it, which that pass saw only in part). Without it, all of them."""
    deleted = 0
    for age_s, bucket_s in SAMPLE_TIERS:
        window = [Sample.t < now - age_s]
        previous = (since or {}).get(age_s)
        if previous is not None:
            window.append(Sample.t >= previous // bucket_s * bucket_s)
        keep = (
            select(func.max(Sample.id))
            .where(*window)
            .group_by(Sample.job_id, time_bucket(Sample.t, bucket_s))
        )
        result = session.execute(delete(Sample).where(*window, Sample.id.not_in(keep)))
        deleted += result.rowcount or 0  # type: ignore[attr-defined]
    return deleted


def compaction_cutoffs(now: float) -> dict[float, float]:
    """What a pass at `now` covered, for the next pass's `since`."""
    return {age_s: now - age_s for age_s, _ in SAMPLE_TIERS}


COMPACTION_RESUME_MARGIN_S = 86_400.0
"""How far before the newest sample a restarted daemon's first downsampling pass reads:
rows older than that were thinned by an earlier daemon."""


def compaction_resume_point(session: Session) -> dict[float, float] | None:
    """`since` for a daemon's first pass: every daemon runs a pass at its first tick and
    then every 5 minutes, so the last daemon's last pass came at most minutes before its
    newest sample. A day of margin covers passes lost to a full disk; None (read
    everything) for an empty table."""
    newest = session.scalar(select(func.max(Sample.t)))
    return None if newest is None else compaction_cutoffs(newest - COMPACTION_RESUME_MARGIN_S)


def learned_bytes_per_item(session: Session, name: str) -> float | None:
    """Bytes per item of the latest succeeded job of this name (its final sample), for
    the preflight of a new run of the same step."""
    job = session.scalars(
        select(Job).where(Job.name == name, Job.state == JobState.SUCCEEDED.value)
        .order_by(Job.ended_at.desc()).limit(1)
    ).first()
    if job is None:
        return None
    last = latest_sample(session, job.id)
    if last is None or not last.items_done or not last.bytes_written:
        return None
    return last.bytes_written / last.items_done


# -- alerts -------------------------------------------------------------------------


_ALERTS = select(Alert).order_by(Alert.started_at, Alert.id)
_ALERTS_IN_STATE = _ALERTS.where(Alert.state == bindparam("state"))


def alerts(session: Session, *, state: AlertState | None = None) -> Sequence[Alert]:
    if state is None:
        return session.scalars(_ALERTS).all()
    return session.scalars(_ALERTS_IN_STATE, {"state": state.value}).all()


def firing_alerts_by_job(session: Session, *,
                         job_id: str | None = None) -> dict[str, list[Alert]]:
    query = select(Alert).where(Alert.state == AlertState.FIRING.value)
    if job_id is not None:
        query = query.where(Alert.job_id == job_id)
    grouped: dict[str, list[Alert]] = {}
    for alert in session.scalars(query.order_by(Alert.started_at, Alert.id)):
        grouped.setdefault(alert.job_id, []).append(alert)
    return grouped


def open_alert(session: Session, *, job_id: str, rule: str, severity: str, message: str,
               started_at: float, resolved_at: float | None = None) -> Alert:
    """Record an alert that fires (or, with `resolved_at`, one that fired and resolved
    while nothing could be recorded); flushed, so that its id is known."""
    alert = Alert(job_id=job_id, rule=rule, severity=severity, started_at=started_at,
                  message=message, resolved_at=resolved_at,
                  state=(AlertState.FIRING if resolved_at is None
                         else AlertState.RESOLVED).value)
    session.add(alert)
    session.flush()
    return alert


def resolve_alert(alert: Alert, *, now: float) -> None:
    alert.state, alert.resolved_at = AlertState.RESOLVED.value, now


def reword_alert(alert: Alert, message: str) -> None:
    """A firing alert's message follows its facts (e.g. how long a job has been quiet)."""
    alert.message = message
