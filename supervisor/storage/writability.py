"""Whether the database takes writes: why a write failed for want of its storage (a full
disk, a read-only file or directory), and the daemon's one view of it, which the tick
and the API report to and `/healthz` reads (`Writability`).

A SQLite connection opened while the database file or its directory could not be
written is read-only for good: SQLite falls back to a read-only open without a word,
and such a connection refuses every write after the file is writable again. The engine
drops it (`sqlite_connection_spoiled`, used by `database.make_engine`), with every other
connection of its pool opened before the failure, so the next write opens a new one.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("supervisor.daemon.loop")  # the tick's log, whichever module writes it

SQLITE_PERM, SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN = 3, 8, 10, 13, 14
"""SQLite's primary result codes (the low byte of an extended code)."""

POSTGRESQL_READ_ONLY_SQL_TRANSACTION = "25006"
POSTGRESQL_DISK_FULL = "53100"

_SQLITE_REASONS = {
    SQLITE_FULL: "its disk is full",
    SQLITE_READONLY: "it is read-only",
    SQLITE_CANTOPEN: "its file cannot be opened for writing",
    SQLITE_PERM: "its file may not be written",
    SQLITE_IOERR: "writing its file failed",
}
_SPOILING = frozenset({SQLITE_READONLY, SQLITE_CANTOPEN, SQLITE_PERM, SQLITE_IOERR})
_TEXT_REASONS = (
    ("database or disk is full", "its disk is full"),
    ("no space left on device", "its disk is full"),
    ("readonly database", "it is read-only"),
    ("read-only file system", "it is read-only"),
    ("unable to open database file", "its file cannot be opened for writing"),
    ("read-only transaction", "it is read-only"),
)


def _driver_error(exc: BaseException) -> BaseException:
    """The driver's exception under SQLAlchemy's wrapper (its `orig`), else `exc`."""
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


def unwritable_reason(exc: BaseException) -> str | None:
    """Why the database refused a write for want of its storage ("its disk is full",
    "it is read-only", ...); None for any other error (a lock, a bug, a lost server).
    The driver's own code or message only: SQLAlchemy's text adds the statement's
    parameters, and a job's reason holding "disk is full" is not one."""
    error = _driver_error(exc)
    code = getattr(error, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF in _SQLITE_REASONS:
        return _SQLITE_REASONS[code & 0xFF]
    state = getattr(error, "sqlstate", None)
    if state == POSTGRESQL_READ_ONLY_SQL_TRANSACTION:
        return "it is read-only"
    if state == POSTGRESQL_DISK_FULL:
        return "its disk is full"
    text = str(error).lower()
    return next((reason for words, reason in _TEXT_REASONS if words in text), None)


def sqlite_connection_spoiled(exc: BaseException) -> bool:
    """A SQLite error after which the connection cannot be trusted to write again,
    whatever happens to the file: read-only, not openable, not permitted, an I/O
    error. Not a full disk: freed space serves the same connection."""
    code = getattr(_driver_error(exc), "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF in _SPOILING


class Writability:
    """Whether the database's last writes went through. The tick reports each commit
    that wrote (`succeeded`) or failed for want of storage (`failed`), once a tick
    (`TickSteps`); the API reports its failed writes. Logged when it changes, not at
    each write: a full disk gives one ERROR line and one "writable again" line,
    however many ticks it lasts. Thread-safe (the tick's thread and the API's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reason: str | None = None
        """Why writes fail ("its disk is full (samples)"); None while they go through."""
        self.failures = 0
        """Writes refused so far, the API's and the ticks': a write shows the database
        writable only if none was refused after it began (`succeeded`)."""

    def failed(self, reason: str, what: str) -> None:
        with self._lock:
            was, self.reason = self.reason, f"{reason} ({what})"
            self.failures += 1
        if was is None:
            log.error("the database cannot be written: %s: keeping samples in memory, "
                      "showing and sending job ends and alerts unrecorded until it can",
                      self.reason)

    def succeeded(self, after: int) -> None:
        """A write went through. `after`: the refusals counted (`failures`) before it
        began; one since then (the API's, in its thread, while the tick committed)
        is newer news, and the write shows nothing about it."""
        with self._lock:
            if after != self.failures:
                return
            was, self.reason = self.reason, None
        if was is not None:
            log.warning("the database is writable again (it was not: %s)", was)
