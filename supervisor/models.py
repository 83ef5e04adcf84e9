"""SQLAlchemy 2.0 typed ORM rows. Alembic (`migrations/`) owns the schema.

Times are stored as float seconds since the epoch (UTC by definition); the API turns
them into ISO 8601 strings.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), index=True)
    spec_json: Mapped[str] = mapped_column(Text)
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str | None] = mapped_column(Text)

    # the worker (the job's own process; its pid is also its process group id)
    pid: Mapped[int | None] = mapped_column(Integer)
    pid_create_time: Mapped[float | None] = mapped_column(Float)
    # the shim that started the worker and records its exit
    shim_pid: Mapped[int | None] = mapped_column(Integer)
    shim_create_time: Mapped[float | None] = mapped_column(Float)

    attempt: Mapped[int] = mapped_column(Integer, default=0)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    signal: Mapped[int | None] = mapped_column(Integer)
    exit_reason: Mapped[str | None] = mapped_column(String(16))

    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    stop_requested_at: Mapped[float | None] = mapped_column(Float)
    next_start_at: Mapped[float | None] = mapped_column(Float)
    """Earliest start of a pending job (restart backoff); None = as soon as ready."""
    progress_json: Mapped[str | None] = mapped_column(Text)
    """The latest progress view (JSON of spec.Progress), kept for ended jobs."""


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
    __table_args__ = (Index("ix_samples_job_t", "job_id", "t"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    t: Mapped[float] = mapped_column(Float)
    items_done: Mapped[int | None] = mapped_column(Integer)
    items_total: Mapped[int | None] = mapped_column(Integer)
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
