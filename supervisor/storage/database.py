"""Database engine (SQLite pragmas), sessions, and schema upgrade through Alembic."""

from __future__ import annotations

import contextlib
import logging
from importlib import resources
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.orm import Session, SessionTransaction, sessionmaker

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 10_000
"""How long a writer waits for the lock before SQLITE_BUSY, in milliseconds."""


def make_engine(url: str) -> Engine:
    """An engine; for SQLite: WAL, busy_timeout, foreign keys, synchronous=NORMAL."""
    is_sqlite = url.startswith("sqlite")
    kwargs: dict[str, Any] = {}
    if is_sqlite:
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 10}
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, **kwargs)
    if is_sqlite:

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

    return engine


UNCOMMITTED_JOB_RECORDS = "jobsup.uncommitted_job_records"
"""`Session.info` key: the job records (`job.json`) written in the session's open
transaction, removed again unless it commits (see `make_sessionmaker`)."""


def make_sessionmaker(engine: Engine, *, jobs_dir: Path | None = None) -> sessionmaker[Session]:
    """Sessions whose `info["jobs_dir"]` tells a submission where to write the job's
    record. A record written in a transaction that then does not commit (the commit
    failed, the request died) is removed when the transaction ends: a job whose `201`
    was never sent must not come back when the jobs are rebuilt from the data dir."""
    sessions = sessionmaker(engine, expire_on_commit=False, info={"jobs_dir": jobs_dir})
    event.listen(sessions, "after_commit", _records_committed)
    event.listen(sessions, "after_transaction_end", _drop_uncommitted_records)
    return sessions


def _records_committed(session: Session) -> None:
    session.info.pop(UNCOMMITTED_JOB_RECORDS, None)


def _drop_uncommitted_records(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is not None:  # a savepoint: the outer transaction decides
        return
    for path in session.info.pop(UNCOMMITTED_JOB_RECORDS, []):
        record = Path(path)
        record.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the job's directory, unless something is in it
            record.parent.rmdir()
        log.info("removed the record of a job never committed: %s", record)


def sqlite_path(url: str) -> Path | None:
    """The database file of a SQLite URL; None for other databases and in-memory ones."""
    parsed = make_url(url)
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:" \
            or database.startswith("file:"):
        return None
    return Path(database)


def alembic_config(url: str) -> Config:
    script_location = str(resources.files("migrations"))
    cfg = Config()
    cfg.set_main_option("script_location", script_location)
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(engine: Engine) -> None:
    """Bring the schema to the newest revision (`alembic upgrade head`)."""
    cfg = alembic_config(str(engine.url.render_as_string(hide_password=False)))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    log.info("database schema at head (%s)", engine.url.render_as_string(hide_password=True))
