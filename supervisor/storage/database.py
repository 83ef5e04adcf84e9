"""Database engine (SQLite with its pragmas, or PostgreSQL through psycopg 3), sessions,
and schema upgrade through Alembic."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import URL, Connection, Engine, create_engine, event, make_url, text
from sqlalchemy.engine import ExceptionContext
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    DisconnectionError,
    NoSuchModuleError,
    OperationalError,
)
from sqlalchemy.orm import Session, SessionTransaction, sessionmaker
from sqlalchemy.pool import ConnectionPoolEntry

from supervisor.errors import DaemonAlreadyRunning, DatabaseTaken, DatabaseUnavailable
from supervisor.storage.filelock import FileLock
from supervisor.storage.writability import sqlite_connection_spoiled

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 10_000
"""How long a writer waits for the lock before SQLITE_BUSY, in milliseconds."""


POSTGRESQL_DRIVER = "postgresql+psycopg"
"""The PostgreSQL driver jobsup installs (psycopg 3, the `postgresql` extra)."""

POSTGRESQL_LOCK_TIMEOUT_MS = SQLITE_BUSY_TIMEOUT_MS
"""How long a PostgreSQL statement waits for a lock (a row another transaction is
writing) before it fails, as SQLite's busy timeout: a write that cannot be made is
rolled back and retried (`transactions.py`, the notifier), never waited on forever."""

POSTGRESQL_POOL_SIZE = 5
"""Connections kept open to PostgreSQL: the tick, the notifier and a few API requests
at once (each holds one only for its transaction)."""


def engine_url(url: str) -> URL:
    """The URL as SQLAlchemy gets it: a plain `postgresql://` (or `postgres://`) URL
    means psycopg 3, whatever SQLAlchemy's default driver for it (psycopg2 before 2.1)."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername=POSTGRESQL_DRIVER)
    return parsed


def shown_url(url: str | URL) -> str:
    """The URL for logs and error messages: its password replaced by `***`."""
    try:
        parsed = make_url(url)
    except ArgumentError:  # not a URL at all: show no part of it
        return "(an unparsable database URL)"
    secret = {key: "***" for key in parsed.query
              if key.lower() in ("password", "dsn", "passfile", "sslpassword")}
    return parsed.update_query_dict(secret).render_as_string(hide_password=True)


def make_engine(url: str) -> Engine:
    """An engine. SQLite: WAL, busy_timeout, foreign keys, synchronous=NORMAL.
    PostgreSQL: connections checked before use (a restarted server or a dropped idle
    connection costs a reconnect, not a failed tick) and recycled hourly."""
    parsed = engine_url(url)
    is_sqlite = parsed.get_backend_name() == "sqlite"
    kwargs: dict[str, Any] = {}
    if is_sqlite:
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 10}
        path = sqlite_path(url)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
    elif parsed.get_backend_name() == "postgresql":
        kwargs.update(pool_pre_ping=True, pool_recycle=3600, pool_size=POSTGRESQL_POOL_SIZE,
                      max_overflow=10)
    try:
        engine = create_engine(parsed, **kwargs)
    except (ImportError, NoSuchModuleError) as exc:
        if parsed.drivername == POSTGRESQL_DRIVER:
            hint = "install jobsup's PostgreSQL driver: pip install 'jobsup[postgresql]'"
        elif parsed.get_backend_name() == "postgresql":
            hint = ("jobsup's PostgreSQL driver is psycopg 3: write the URL as "
                    "postgresql://USER:PASSWORD@HOST:PORT/DATABASE")
        else:
            hint = "use a sqlite:/// or postgresql:// URL in JOBSUP_DATABASE_URL"
        raise DatabaseUnavailable(f"no driver for the database {shown_url(parsed)}: {exc}",
                                  hint=hint) from None
    if is_sqlite:
        lineage = Lineage(sqlite_path(url))
        event.listen(engine, "handle_error", lineage.drop_spoiled)
        event.listen(engine, "checkout", lineage.checked_out)
        event.listen(engine, "engine_disposed", lineage.release)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, record: ConnectionPoolEntry) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()
            lineage.born(record)

    elif engine.dialect.name == "postgresql":

        @event.listens_for(engine, "connect")
        def _lock_timeout(dbapi_conn: Any, _record: Any) -> None:
            set_session(dbapi_conn, f"SET lock_timeout = {POSTGRESQL_LOCK_TIMEOUT_MS}")

        event.listen(engine, "before_cursor_execute", _without_nul, retval=True)

    return engine


class Lineage:
    """Which of a SQLite engine's connections may be trusted to write: those opened in
    its current generation. A connection keeps the file descriptors it opened with, so
    through a read-only spell (#30) one opened before it still writes, and one opened
    during it is read-only for good, even once the files are writable again. So:

    - a write refused for want of the files (`sqlite_connection_spoiled`) starts a new
      generation: the connections opened before it are condemned, and a write that
      goes through one of them after all proves nothing about the files;
    - the write that proves the files writable again (`TickSteps`) starts another one:
      the connections opened during the spell, which may be read-only, are condemned.

    A condemned connection is closed and replaced at its next checkout (`checked_out`);
    one in use finishes its transaction first.

    And one connection is kept open outside the pool (`keep`): SQLite maps a database's
    shared-memory index (`-shm`) once per process, shared by all its connections, and
    maps it anew only once none holds it. Mapped while the `-shm` file could not be
    written, it is read-only for every connection opened after, until all have closed:
    a pool that never emptied kept the daemon refusing writes long after a spell was
    over (CI's "/healthz ok again" timeout). The keeper holds the writable one."""

    def __init__(self, path: Path | None = None) -> None:
        self.generation = 0
        self.path = path
        """The SQLite file (None: in memory, no keeper)."""
        self.keeper: sqlite3.Connection | None = None
        self._keeping = threading.Lock()  # two threads connecting at once open one keeper

    def condemn(self) -> None:
        """Every connection opened before now is replaced at its next checkout."""
        self.generation += 1

    def born(self, record: ConnectionPoolEntry) -> None:
        """The engine's `connect` event: the new connection is of this generation (and
        the keeper is opened, where none is yet and the files take writes)."""
        record.info[_LINEAGE] = self
        record.info[_GENERATION] = self.generation
        self.keep()

    def keep(self) -> None:
        """Open the keeper, where there is none and the files take writes: the file
        opened read-write (`mode=rw`: no silent read-only open), the index mapped by a
        read, a write transaction begun and rolled back (refused where the index is
        read-only). Else nothing: the next connection tries again."""
        if self.keeper is not None or self.path is None:
            return
        with self._keeping:
            if self.keeper is None:
                self.keeper = self._opened_keeper(self.path)

    @staticmethod
    def _opened_keeper(path: Path) -> sqlite3.Connection | None:
        try:
            keeper = sqlite3.connect(f"file:{urllib.parse.quote(str(path))}?mode=rw",
                                     uri=True, timeout=1.0, isolation_level=None,
                                     check_same_thread=False)
        except sqlite3.Error:
            return None
        try:
            keeper.execute("SELECT count(*) FROM sqlite_master").fetchall()
            keeper.execute("BEGIN IMMEDIATE")
            keeper.execute("ROLLBACK")
        except sqlite3.Error:
            keeper.close()
            return None
        return keeper

    def release(self, *_args: Any) -> None:
        """The engine's `engine_disposed` event: the keeper closed with the pool."""
        keeper, self.keeper = self.keeper, None
        if keeper is not None:
            keeper.close()

    def checked_out(self, _dbapi_conn: Any, record: ConnectionPoolEntry,
                    _proxy: Any) -> None:
        """The engine's `checkout` event: a condemned connection is replaced by a new
        one (SQLAlchemy's way: `DisconnectionError` makes the pool reconnect)."""
        if record.info.get(_GENERATION) != self.generation:
            raise DisconnectionError("a connection opened before a read-only spell")

    def drop_spoiled(self, context: ExceptionContext) -> None:
        """The engine's `handle_error` event. A SQLite connection that met a read-only
        file or directory (or could not open its file) is read-only for good: SQLite
        opened it read-only without a word, or it cannot write its journal. Treated as a
        lost connection: SQLAlchemy closes it and every connection of its pool opened
        before now, and the generation's others are condemned with them, so the next
        write, once the file is writable, opens a new one (a read-only spell left the
        daemon refusing writes until restarted, #30)."""
        if sqlite_connection_spoiled(context.original_exception):
            context.is_disconnect = True
            self.condemn()


_LINEAGE, _GENERATION = "jobsup.lineage", "jobsup.generation"
"""Where a SQLite connection's record (its `info`) keeps its `Lineage` and generation."""


@dataclass(frozen=True)
class Writer:
    """The connection a transaction writes through, as its engine's `Lineage` saw it
    opened (`writer`)."""

    lineage: Lineage
    generation: int

    @property
    def trusted(self) -> bool:
        """Opened in its engine's current generation: a write through it shows whether
        the files take writes."""
        return self.generation == self.lineage.generation


def writer(session: Session) -> Writer | None:
    """The connection this session's transaction writes through (checked out now if the
    transaction has none yet); None for PostgreSQL, whose connections hold no files."""
    info = session.connection().info
    lineage = info.get(_LINEAGE)
    return Writer(lineage, info[_GENERATION]) if isinstance(lineage, Lineage) else None


def _without_nul(_conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any,
                 _executemany: bool) -> tuple[str, Any]:
    """PostgreSQL's text cannot hold NUL; SQLite's can. Strings jobsup does not make may
    (a webhook's error page in `last_error`, a job's log line in a reason): stored with
    U+FFFD in its place, not a failed write (the delivery's outcome was one, and the
    message went out again every second)."""
    return statement, _nul_free(parameters)


def _nul_free(parameters: Any) -> Any:
    """The parameters (a mapping, a sequence, or a list of them for executemany) with
    NUL in their strings replaced; the same object when there is none (nearly always)."""
    if not parameters:
        return parameters
    if isinstance(parameters, list):
        return [_nul_free(row) for row in parameters]
    values = parameters.values() if isinstance(parameters, Mapping) else parameters
    if not any(isinstance(v, str) and "\x00" in v for v in values):
        return parameters
    if isinstance(parameters, Mapping):
        return {k: _nul_replaced(v) for k, v in parameters.items()}
    return tuple(_nul_replaced(v) for v in parameters)


def _nul_replaced(value: Any) -> Any:
    return value.replace("\x00", "\ufffd") if isinstance(value, str) else value


def set_session(dbapi_conn: Any, statement: str) -> None:
    """Run a `SET` on a new PostgreSQL connection outside a transaction: in one, the
    pool's rollback at check-in would undo it."""
    dbapi_conn.autocommit = True
    try:
        dbapi_conn.execute(statement)
    finally:
        dbapi_conn.autocommit = False


def unavailable(url: str | URL, exc: OperationalError) -> DatabaseUnavailable:
    """A connection that could not be made (refused, no such database or role, a wrong
    password), for the user: the URL without its password, the driver's first line."""
    reason = _first_line(exc)
    return DatabaseUnavailable(
        f"cannot connect to the database {shown_url(url)}: {reason}",
        hint="start the database server, or fix JOBSUP_DATABASE_URL (the database and its "
             "role must exist; jobsup creates the tables)")


DAEMON_LOCK_KEY = 0x6A6F62737570
"""The PostgreSQL advisory lock a daemon holds on its database ("jobsup" in ASCII)."""

_LOCK_HELD = text(
    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted"
    " AND pid = pg_backend_pid() AND classid::bigint = :high AND objid::bigint = :low"
    " AND objsubid = 1)")
"""Whether this session holds `DAEMON_LOCK_KEY` (a bigint key shows in `pg_locks` as
its high and low 32 bits, `objsubid` 1)."""
_LOCK_KEY_PARTS = {"high": DAEMON_LOCK_KEY >> 32, "low": DAEMON_LOCK_KEY & 0xFFFFFFFF}


class DatabaseLock:
    """This daemon's hold on its database. A second daemon on the same PostgreSQL
    database (from another data dir or machine) would launch the same pending jobs and
    call the first one's jobs lost: it is refused, as a second daemon on one data dir is
    (`daemon.lock`). The lock is PostgreSQL's session advisory lock on a connection of
    its own, released by the server when that session ends: the daemon died, or the
    connection dropped (a network cut, a server restart, an admin's
    `pg_terminate_backend`). The daemon asks `confirm()` before each tick, so it never
    acts for longer than a tick on a lock it lost. A SQLite database is held through a
    `FileLock` on `<its file's real path>.lock`, so two data dirs given one file through
    `JOBSUP_DATABASE_URL` (by any path or symbolic link to it) are refused as well; a
    hard link to the file is another path, and not seen."""

    def __init__(self, url: str):
        self.url = url
        self._engine = None if make_url(url).get_backend_name() == "sqlite" else make_engine(url)
        database_file = sqlite_path(url)
        self._file = None if database_file is None else FileLock(
            Path(f"{os.path.realpath(database_file)}.lock"),
            what=f"the database {os.path.realpath(database_file)}",
            hint="use that daemon, stop it first, or give this one a database of its own "
                 "(JOBSUP_DATABASE_URL)")
        self._conn: Connection | None = None
        self._lost: str | None = None
        """How the lock was lost, until it is taken again."""
        self._unreachable = False
        """The lock could not be taken again (logged once while it lasts)."""

    def acquire(self) -> None:
        """Take the lock: DaemonAlreadyRunning while another daemon holds it,
        DatabaseUnavailable when the server cannot be reached."""
        if self._file is not None:
            self._file.acquire()
        if self._engine is None:
            return
        try:
            conn = self._engine.connect()
        except OperationalError as exc:
            raise unavailable(self.url, exc) from None
        if not self._take(conn):
            conn.close()
            raise DaemonAlreadyRunning(
                f"another jobsup daemon uses the database {shown_url(self.url)}",
                hint="use that daemon, stop it first, or give this one a database of "
                     "its own (JOBSUP_DATABASE_URL)")
        self._conn = conn

    def confirm(self) -> bool:
        """Whether this daemon still holds the database: one query on the lock's
        connection. If its session is gone, the lock is taken again on a new connection
        (logged as a warning): True. False while the server cannot be reached to do so
        (asked again at the next call). DatabaseTaken when another daemon holds the lock
        now: this daemon must stop acting."""
        if self._file is not None:
            return self._file.confirm()
        if self._engine is None:
            return True
        if self._conn is not None:
            try:
                held = bool(self._conn.scalar(_LOCK_HELD, _LOCK_KEY_PARTS))
                self._conn.rollback()
                if held:
                    return True
                self._lost = "its session no longer holds it"
            except DBAPIError as exc:
                self._lost = f"its connection ended: {_first_line(exc)}"
            self._close()
        conn = None
        try:
            conn = self._engine.connect()
            taken = self._take(conn)
        except DBAPIError as exc:
            if conn is not None:
                with contextlib.suppress(DBAPIError):
                    conn.close()
            if not self._unreachable:
                log.error("lost the lock on the database %s (%s) and cannot take it again "
                          "(%s): no tick runs until it is taken", shown_url(self.url),
                          self._lost, _first_line(exc))
            self._unreachable = True
            return False
        if not taken:
            conn.close()
            raise DatabaseTaken(
                f"another jobsup daemon took the database {shown_url(self.url)} while this "
                f"daemon's lock on it was lost ({self._lost}); this daemon stops: the "
                "jobs are the other daemon's now (they keep running)",
                hint="keep one daemon per database: stop one of them, or give each a "
                     "database of its own (JOBSUP_DATABASE_URL)")
        log.warning("lost the lock on the database %s (%s); took it again",
                    shown_url(self.url), self._lost)
        self._conn, self._lost, self._unreachable = conn, None, False
        return True

    def release(self) -> None:
        """Close the lock's connection (the server releases the lock) and the engine;
        SQLite's: unlock its file."""
        if self._file is not None:
            self._file.release()
        self._close()
        if self._engine is not None:
            self._engine.dispose()

    @staticmethod
    def _take(conn: Connection) -> bool:
        taken = bool(conn.scalar(text("SELECT pg_try_advisory_lock(:key)"),
                                 {"key": DAEMON_LOCK_KEY}))
        conn.commit()  # the lock outlives the transaction; the connection stays open
        return taken

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(DBAPIError):
                conn.close()


def _first_line(exc: DBAPIError) -> str:
    text_ = str(exc.orig).strip() if exc.orig else str(exc)
    return text_.splitlines()[0] if text_ else type(exc).__name__


@contextlib.contextmanager
def database_lock(url: str) -> Iterator[DatabaseLock]:
    """Hold the database for this daemon while the block runs (`DatabaseLock`)."""
    lock = DatabaseLock(url)
    try:
        lock.acquire()
        yield lock
    finally:
        lock.release()


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
    """Bring the schema to the newest revision (`alembic upgrade head`), all of it in one
    transaction: killed part way (kill -9, a power cut, Ctrl-C), the database is left as
    it was before, and the next start runs the whole upgrade again.

    PostgreSQL's DDL is transactional as it is. Python's sqlite3 (before 3.12's
    `autocommit`) opens a transaction only before an INSERT, UPDATE or DELETE: each
    `CREATE TABLE` or `ALTER TABLE` before one committed alone, so a kill left half a
    schema (`table jobs already exists`, `_alembic_tmp_notifications` at every later
    start). The upgrade's SQLite connection has the module's own transaction handling
    turned off and gets an explicit `BEGIN` (`sqlite_transaction`)."""
    cfg = alembic_config(str(engine.url.render_as_string(hide_password=False)))
    with engine.connect() as conn, sqlite_transaction(conn):
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
        conn.commit()
    log.info("database schema at head (%s)", shown_url(engine.url))


@contextlib.contextmanager
def sqlite_transaction(conn: Connection) -> Iterator[None]:
    """On SQLite, a real transaction around DDL for the block: the DBAPI connection's
    implicit transactions off (`isolation_level = None`: the module sends no BEGIN nor
    COMMIT of its own) and `BEGIN` sent; its
    `commit()` and `rollback()` still end it. The connection goes back to the pool as it
    came. Other databases: nothing to do. A deferred `BEGIN`, not `BEGIN IMMEDIATE`: a
    database already at head is only read, so a daemon still starts on a read-only or
    full disk; the data dir's lock keeps any other writer away."""
    if conn.dialect.name != "sqlite":
        yield
        return
    dbapi_conn = conn.connection.dbapi_connection
    assert dbapi_conn is not None
    legacy = dbapi_conn.isolation_level
    dbapi_conn.isolation_level = None
    try:
        conn.exec_driver_sql("BEGIN")
        yield
    finally:
        if conn.in_transaction():
            conn.rollback()
        dbapi_conn.isolation_level = legacy
