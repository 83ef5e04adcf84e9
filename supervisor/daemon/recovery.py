"""A lost or damaged database: check it at start, rebuild the jobs from the data dir.

The rebuild itself (what a job directory says, and what a rebuild cannot bring back)
is `rebuild.py`'s; this module decides when one happens, checks the SQLite file and
opens the database at the newest schema.

When, at daemon start (`open_database`):
- the SQLite file is missing or empty (0 bytes: SQLite would take it for a new
  database), or the `jobs` table is missing or empty while `DATA_DIR/jobs` holds job
  directories: rebuild, with a WARNING;
- the file is damaged ("file is not a database", "database disk image is malformed",
  `PRAGMA quick_check` failing): refuse to start with `DatabaseDamaged`, unless
  `rebuild_db` (`jobsup serve --rebuild-db`) is set: then move the file aside
  (`jobsup.db.damaged-<time>`, with its `-wal` and `-shm`) and rebuild;
- the upgrade meets part of a revision already there (a file an older jobsup left
  half-upgraded when it was killed during its upgrade, which committed one DDL statement
  at a time): the same, as `jobsup.db.half-upgraded-<time>`;
- a PostgreSQL database (`JOBSUP_DATABASE_URL`) has no file to check or set aside: only
  a database without jobs while `DATA_DIR/jobs` holds job directories is rebuilt.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any
from urllib.request import pathname2url

from sqlalchemy import Engine, inspect, select
from sqlalchemy.exc import DBAPIError, OperationalError

from supervisor.config import Settings
from supervisor.daemon.rebuild import job_dirs, rebuild
from supervisor.errors import DatabaseDamaged, DatabaseUnavailable, JobsElsewhere
from supervisor.runtime.files import DATA_DIR_ID, attempt_dir, launched_from
from supervisor.spec import ExitReason, JobState
from supervisor.storage import store
from supervisor.storage.database import (
    make_engine,
    make_sessionmaker,
    shown_url,
    sqlite_path,
    unavailable,
    upgrade,
)
from supervisor.storage.tables import Job

log = logging.getLogger(__name__)

SQLITE_CORRUPT, SQLITE_NOTADB = 11, 26


# -- the database at start ----------------------------------------------------------


def is_corruption(exc: BaseException) -> bool:
    """SQLITE_CORRUPT ("database disk image is malformed") or SQLITE_NOTADB ("file is
    not a database"); not a lock, a full disk or a permission problem."""
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF in (SQLITE_CORRUPT, SQLITE_NOTADB)
    text = str(exc).lower()
    return "file is not a database" in text or "malformed" in text


QUICK_CHECK_FULL_MAX_BYTES = 128 << 20
"""Up to this size the whole file is checked at start; a larger one has every table
checked but `samples` (and its indexes), which holds nearly all of its bytes."""

UNCHECKED_WHEN_LARGE = ("samples",)


def damage(path: Path) -> str | None:
    """Why the SQLite file at `path` is damaged; None when it is sound (or missing).

    `PRAGMA quick_check(1)`: every page and b-tree of the file, stopping at the first
    error, without integrity_check's index-against-table cross-check. It reads the whole
    file: for 1M samples rows (112 MiB), 0.4-1 s from the page cache and 3-4 s from disk
    on 2 busy cores. Above QUICK_CHECK_FULL_MAX_BYTES only the tables other than
    `samples` are checked (milliseconds), one by one."""
    uri = f"file:{pathname2url(str(path))}?mode=rw"
    try:
        with closing(sqlite3.connect(uri, uri=True, timeout=10)) as conn:
            large = (path.stat().st_size > QUICK_CHECK_FULL_MAX_BYTES
                     and sqlite3.sqlite_version_info >= (3, 33))  # quick_check(TABLE)
            if not large:
                return _check_result(conn.execute("PRAGMA quick_check(1)").fetchall())
            tables = [row[0] for row in conn.execute(
                "SELECT name FROM sqlite_schema WHERE type = 'table'")]
            for table in tables:
                if table in UNCHECKED_WHEN_LARGE:
                    continue
                quoted = table.replace('"', '""')
                result = _check_result(conn.execute(f'PRAGMA quick_check("{quoted}")')
                                       .fetchall())
                if result is not None:
                    return result
            log.info("database %s: larger than %d MiB, checked without its %s", path,
                     QUICK_CHECK_FULL_MAX_BYTES >> 20, ", ".join(UNCHECKED_WHEN_LARGE))
            return None
    except sqlite3.DatabaseError as exc:
        if is_corruption(exc):
            return str(exc)
        raise


def _check_result(rows: list[Any]) -> str | None:
    result = str(rows[0][0]) if rows else "quick_check gave no answer"
    return None if result == "ok" else result


def set_aside(path: Path, label: str, now: float) -> Path:
    """Rename the database file (and its -wal and -shm, kept beside it under the new
    name, so SQLite opens them together) to `<name>.<label>-<time>`."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(now))
    target = path.with_name(f"{path.name}.{label}-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.{label}-{stamp}-{n}")
    os.replace(path, target)
    for suffix in ("-wal", "-shm"):
        companion = Path(f"{path}{suffix}")
        if companion.exists():
            os.replace(companion, Path(f"{target}{suffix}"))
    return target


def set_aside_orphans(path: Path, now: float) -> list[Path]:
    """A -wal or -shm without its database (missing or 0 bytes) is never replayed onto
    a new one: it goes aside as `<name>-wal.orphaned-<time>`."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.localtime(now))
    moved = []
    for suffix in ("-wal", "-shm"):
        companion = Path(f"{path}{suffix}")
        if companion.exists():
            target = companion.with_name(f"{companion.name}.orphaned-{stamp}")
            os.replace(companion, target)
            moved.append(target)
    return moved


def damaged_error(path: Path, jobs_dir: Path, reason: str) -> DatabaseDamaged:
    return DatabaseDamaged(
        f"the database {path} is damaged ({reason})",
        hint=f"jobsup serve --rebuild-db moves it aside ({path.name}.damaged-<time>) and "
             f"rebuilds the jobs from {jobs_dir}")


HALF_UPGRADED = ("already exists", "duplicate column name")
"""What SQLite says when the upgrade meets the tables, indexes or columns of an earlier
upgrade that an older jobsup committed one statement at a time and was then killed
(since #30 the upgrade is one transaction: a kill leaves nothing behind)."""


def is_half_upgraded(exc: BaseException) -> bool:
    """The schema holds part of a revision its version does not record."""
    text = str(exc).lower()
    return any(words in text for words in HALF_UPGRADED)


def half_upgraded_error(path: Path, jobs_dir: Path, reason: str) -> DatabaseDamaged:
    return DatabaseDamaged(
        f"the database {path} was left half-upgraded by an earlier jobsup killed during "
        f"its schema upgrade ({reason})",
        hint=f"jobsup serve --rebuild-db moves it aside ({path.name}.half-upgraded-<time>, "
             f"its samples and alerts kept there) and rebuilds the jobs from {jobs_dir}")


def check_or_set_aside(path: Path, jobs_dir: Path, *, rebuild_db: bool,
                       now: float) -> Path | None:
    """Where the damaged file went (with `rebuild_db`), None if it is sound, missing or
    empty; DatabaseDamaged if it is damaged and `rebuild_db` is not set."""
    try:
        empty = path.stat().st_size == 0
    except FileNotFoundError:
        return None
    reason = None if empty else damage(path)
    if reason is None:
        if rebuild_db:
            log.info("--rebuild-db: the database %s is sound; nothing to rebuild", path)
        return None
    if not rebuild_db:
        raise damaged_error(path, jobs_dir, reason)
    moved = set_aside(path, "damaged", now)
    log.warning("moved the damaged database aside to %s (%s)", moved, reason)
    return moved


def has_jobs(engine: Engine) -> bool:
    """The database holds a jobs table with at least one row."""
    if not inspect(engine).has_table(Job.__tablename__):
        return False
    with engine.connect() as conn:
        return conn.execute(select(Job.id).limit(1)).first() is not None


def open_database(settings: Settings, *, now: float | None = None) -> Engine:
    """The daemon's database engine, checked, at the newest schema, and with the jobs
    rebuilt from the data dir when it was lost (see the module's docstring)."""
    now = time.time() if now is None else now
    url = settings.resolved_database_url
    path = sqlite_path(url)
    if path is None:
        return open_server_database(settings, url, now)
    lost = None
    try:
        size: int | None = path.stat().st_size
    except FileNotFoundError:
        size = None
    if not size:
        lost = "was missing" if size is None else "was empty (0 bytes)"
        for orphan in set_aside_orphans(path, now):
            log.warning("set %s aside: its database %s", orphan, lost)
    elif check_or_set_aside(path, settings.jobs_dir, rebuild_db=settings.rebuild_db,
                            now=now) is not None:
        lost = "was damaged and set aside"
    engine = make_engine(url)
    try:
        known = has_jobs(engine)
        upgrade(engine)
    except DBAPIError as exc:
        engine.dispose()
        if exc.orig is None:
            raise
        if is_corruption(exc.orig):
            label, error = "damaged", damaged_error(path, settings.jobs_dir, str(exc.orig))
        elif is_half_upgraded(exc.orig):
            label, error = "half-upgraded", half_upgraded_error(path, settings.jobs_dir,
                                                                str(exc.orig))
        else:
            raise
        if not settings.rebuild_db or lost is not None:
            raise error from None
        moved = set_aside(path, label, now)
        log.warning("moved the %s database aside to %s (%s)", label, moved, exc.orig)
        return open_database(settings, now=now)
    if not known:
        rebuild_if_lost(engine, settings, str(path), lost, now)
    return engine


def open_server_database(settings: Settings, url: str, now: float) -> Engine:
    """A database server's (PostgreSQL): no file to check or set aside, its damage is
    the server's business, so `rebuild_db` changes nothing. A database with no jobs
    while the data dir holds job directories (a new, emptied or restored-from-nothing
    database) gets them rebuilt, as a lost SQLite file does. A server that cannot be
    reached stops the daemon with `DatabaseUnavailable` (the URL shown without its
    password)."""
    shown = shown_url(url)
    if settings.rebuild_db:
        log.info("--rebuild-db: %s is a database server's; there is no file to set aside",
                 shown)
    engine = make_engine(url)
    try:
        with engine.connect():
            pass
    except OperationalError as exc:
        engine.dispose()
        raise unavailable(url, exc) from None
    try:
        known = has_jobs(engine)
        upgrade(engine)
    except DBAPIError as exc:
        engine.dispose()
        if getattr(exc.orig, "sqlstate", None) != INSUFFICIENT_PRIVILEGE:
            raise
        raise DatabaseUnavailable(
            f"the database {shown} does not let its role create jobsup's tables: "
            f"{str(exc.orig).strip().splitlines()[0]}",
            hint="make the role the database's owner (ALTER DATABASE ... OWNER TO ...), or "
                 "GRANT CREATE ON SCHEMA public TO it (PostgreSQL 15 no longer grants it "
                 "to every role)") from None
    if not known:
        rebuild_if_lost(engine, settings, shown, "had no jobs", now)
    return engine


def check_jobs_elsewhere(engine: Engine, settings: Settings, now: float) -> None:
    """Raise `JobsElsewhere` when a running job was launched from another data dir (its
    `Job.data_dir_id`) whose files are not in this one: a daemon with another
    `--data-dir` on the same database (`JOBSUP_DATABASE_URL`), or on another host, sees
    none of them, took its launch for one cut short and ran it a second time (#30, item
    7). A job whose current attempt's directory is here is this daemon's (a data dir
    renamed, or its id file lost). With `settings.abandon_jobs_elsewhere` such jobs are
    recorded lost instead (left running, unwatched) and the daemon starts. Jobs that
    ran elsewhere and ended, and pending ones, are this daemon's to show and launch."""
    ours, here = launched_from(settings.data_dir, settings.jobs_dir)
    if ours is None:
        log.warning("cannot read or make %s (a read-only or full data dir?): jobs launched "
                    "from another data dir are not looked for", settings.data_dir / DATA_DIR_ID)
        return
    sessions = make_sessionmaker(engine, jobs_dir=settings.jobs_dir)
    with sessions() as session:
        elsewhere = [job for job in session.scalars(
            select(Job).where(Job.state == JobState.RUNNING.value, Job.data_dir_id.is_not(None),
                              Job.data_dir_id != ours).order_by(Job.created_at, Job.id))
            if not attempt_dir(settings.jobs_dir, job.id, job.attempt).is_dir()]
        if not elsewhere:
            return
        if not settings.abandon_jobs_elsewhere:
            first = elsewhere[0]
            more = (f" (and {len(elsewhere) - 1} more running jobs)" if len(elsewhere) > 1
                    else "")
            where = (f"{first.jobs_dir} holds its files, not {here}" if first.jobs_dir != here
                     else f"one at the same path, {here}, on another host or since replaced, "
                          "holds its files, not this one")
            raise JobsElsewhere(
                f"job {first.id} ({first.name}) is running from another data dir: {where}"
                f"{more}; a daemon here cannot watch it and would run it again",
                hint=f"start the daemon with the data dir those jobs ran from (--data-dir "
                     f"{os.path.dirname(first.jobs_dir or '') or '?'}, or JOBSUP_DATA_DIR) "
                     "until they have ended, or give this data dir a database of its own; "
                     "if that data dir is gone for good, `jobsup serve "
                     "--abandon-jobs-elsewhere` records them lost (anything of them still "
                     "running is left alone, unwatched)")
        for job in elsewhere:
            store.transition(session, job, JobState.LOST, now=now, exit_reason=ExitReason.LOST,
                             reason=f"launched from another data dir ({job.jobs_dir}); "
                                    "abandoned at start (--abandon-jobs-elsewhere): not "
                                    "watched, not stopped, not run again")
            log.warning("job %s: running from another data dir (%s); recorded lost "
                        "(--abandon-jobs-elsewhere)", job.id, job.jobs_dir)
        session.commit()


INSUFFICIENT_PRIVILEGE = "42501"
"""PostgreSQL's SQLSTATE for "permission denied"."""


def rebuild_if_lost(engine: Engine, settings: Settings, where: str, lost: str | None,
                    now: float) -> None:
    """Rebuild the jobs of the data dir into a database that has none."""
    if not job_dirs(settings.jobs_dir):
        return
    lost = lost or "had no jobs"
    sessions = make_sessionmaker(engine)
    with sessions() as session:
        summary = rebuild(session, settings.jobs_dir, now, settings=settings)
        session.commit()
    counts = ", ".join(f"{n} {state}" for state, n in sorted(summary.states.items()))
    log.warning(
        "the database %s %s: rebuilt %d jobs from %s (%s; %d skipped, %d without a "
        "job.json); their samples, alerts, notifications and event history from before "
        "are lost", where, lost, summary.rebuilt, settings.jobs_dir, counts or "none",
        len(summary.skipped), summary.from_launch)
