"""SQLAlchemy 2.0 typed ORM rows. Alembic (`migrations/`) owns the schema.

Times are stored as float seconds since the epoch (UTC by definition); the API turns
them into ISO 8601 strings.
"""

from __future__ import annotations

from typing import NamedTuple

from sqlalchemy import BigInteger, Boolean, Float, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


Count = BigInteger().with_variant(Integer(), "sqlite")
"""A count that may pass 2**31: start ticks (after 248 days of uptime at 100 Hz), items
done (tokens). 64 bits everywhere: PostgreSQL's `bigint`; SQLite's INTEGER already is
(its column stays INTEGER, migration 0007)."""


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_created_at_id", "created_at", "id"),)
    """The pages' order, newest first (migration 0009)."""

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    spec_json: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str | None] = mapped_column(Text)

    # the worker (the job's own process; its pid is also its process group id)
    pid: Mapped[int | None] = mapped_column(Integer)
    pid_create_time: Mapped[float | None] = mapped_column(Float)
    pid_start_ticks: Mapped[int | None] = mapped_column(Count)
    pid_boot_id: Mapped[str | None] = mapped_column(String(36))
    """With `pid` and its start ticks, the worker's identity (`procfs.is_same_process`):
    the boot it started in (`procfs.this_boot_id`, migration 0011). The create time is
    for people, for rows written before migration 0006 and, with the start ticks, for
    rows written before 0011."""
    # the shim that started the worker and records its exit
    shim_pid: Mapped[int | None] = mapped_column(Integer)
    shim_create_time: Mapped[float | None] = mapped_column(Float)
    shim_start_ticks: Mapped[int | None] = mapped_column(Count)
    shim_boot_id: Mapped[str | None] = mapped_column(String(36))

    attempt: Mapped[int] = mapped_column(Integer, default=0)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    signal: Mapped[int | None] = mapped_column(Integer)
    exit_reason: Mapped[str | None] = mapped_column(String(16))

    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float, index=True)
    """Indexed: each tick reads the jobs that ended lately (migration 0008)."""
    stop_requested_at: Mapped[float | None] = mapped_column(Float)
    next_start_at: Mapped[float | None] = mapped_column(Float)
    """Earliest start of a pending job (restart backoff); None = as soon as ready."""
    progress_json: Mapped[str | None] = mapped_column(Text)
    """The latest progress view (JSON of `observe.view.StoredProgress`), kept for ended jobs."""
    data_dir_id: Mapped[str | None] = mapped_column(String(32))
    jobs_dir: Mapped[str | None] = mapped_column(Text)
    """The data dir (`files.data_dir_id`) and jobs dir (its real path) of the daemon that
    launched the current attempt: where its shim, log and exit record are. A daemon on
    another data dir does not start while such a job runs, unless its files are in its
    own jobs dir (`recovery.check_jobs_elsewhere`); None before migration 0010."""


class JobEvent(Base):
    """One state transition of a job, with its time and reason."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    t: Mapped[float] = mapped_column(Float)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)


class Sample(Base):
    """One reading of one job at one tick (downsampled with age, see store.compact_samples)."""

    __tablename__ = "samples"
    __table_args__ = (Index("ix_samples_job_t", "job_id", "t"), Index("ix_samples_t", "t"))

    id: Mapped[int] = mapped_column(Count, primary_key=True, autoincrement=True)
    """bigint on PostgreSQL: ids are never reused, and 100 samples a second pass 2**31
    in 248 days, downsampling or not (SQLite's rowid is 64-bit)."""
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    t: Mapped[float] = mapped_column(Float)
    items_done: Mapped[int | None] = mapped_column(Count)
    items_total: Mapped[int | None] = mapped_column(Count)
    files: Mapped[int] = mapped_column(Integer, default=0)
    bytes_written: Mapped[int] = mapped_column(BigInteger, default=0)
    cpu_percent: Mapped[float] = mapped_column(Float, default=0.0)
    cpu_time_s: Mapped[float] = mapped_column(Float, default=0.0)
    rss_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    read_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    write_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    num_procs: Mapped[int] = mapped_column(Integer, default=0)
    num_threads: Mapped[int] = mapped_column(Integer, default=0)
    gpu_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    disk_free_bytes: Mapped[int | None] = mapped_column(BigInteger)


class SampleRecord(NamedTuple):
    """One reading of one job at one tick, as stored (the columns of `samples`): a plain
    tuple, inserted in one batch per tick (`store.add_samples`), never an ORM object."""

    job_id: str
    t: float
    items_done: int | None
    items_total: int | None
    files: int
    bytes_written: int
    cpu_percent: float
    cpu_time_s: float
    rss_bytes: int
    read_bytes: int
    write_bytes: int
    num_procs: int
    num_threads: int
    gpu_memory_bytes: int | None
    disk_free_bytes: int | None


class Alert(Base):
    """A firing or resolved alert. At most one firing alert per (job, rule): a partial
    unique index enforces it (migration 0003)."""

    __tablename__ = "alerts"
    __table_args__ = (Index("ux_alerts_firing", "job_id", "rule", unique=True,
                            sqlite_where=text("state = 'firing'"),
                            postgresql_where=text("state = 'firing'")),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    rule: Mapped[str] = mapped_column(String(32))
    severity: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16), index=True)
    started_at: Mapped[float] = mapped_column(Float)
    resolved_at: Mapped[float | None] = mapped_column(Float)
    message: Mapped[str] = mapped_column(Text)


class Notification(Base):
    """The outbox: one message to one destination. Written in the same transaction as
    the alert it announces, so a daemon killed before delivery delivers after restart
    (at least once). Each attempt is recorded (`attempts`, `in_flight_since`) before its
    request leaves, so a restarted daemon knows which message a crash cut short."""

    __tablename__ = "notifications"
    __table_args__ = (Index("ix_notifications_pending", "destination", "sent_at", "failed_at"),
                      Index("ux_notifications_event", "destination", "event_id", unique=True))

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    destination: Mapped[str] = mapped_column(String(16))
    """`slack` or `webhook`."""
    event_id: Mapped[str] = mapped_column(String(36))
    """The message's id (a UUID), fixed when it enters the outbox and the same for every
    destination and every attempt: what a receiver dedupes on (migration 0005)."""
    kind: Mapped[str] = mapped_column(String(16))
    """`firing`, `resolved` or `succeeded`."""
    job_id: Mapped[str | None] = mapped_column(String(32))
    alert_id: Mapped[int | None] = mapped_column(Integer)
    payload_json: Mapped[str] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    """Delivery attempts started (counted before the request leaves)."""
    next_attempt_at: Mapped[float] = mapped_column(Float)
    in_flight_since: Mapped[float | None] = mapped_column(Float)
    """Set (committed) just before a request leaves and cleared with its outcome: still
    set at a daemon's start, the previous daemon died while delivering it."""
    redelivery: Mapped[bool] = mapped_column(Boolean, default=False)
    """An earlier attempt may have reached the receiver (a crash or a lost answer cut
    it short): later attempts say so (`X-Jobsup-Redelivery: 1`)."""
    sent_at: Mapped[float | None] = mapped_column(Float)
    failed_at: Mapped[float | None] = mapped_column(Float)
    """Set when delivery was given up (a 4xx other than 429): not retried."""
    last_error: Mapped[str | None] = mapped_column(Text)
