"""How the engine's tick writes: each step in a transaction of its own, a database that
cannot be written (a full disk, a read-only file) survived, and an unexpected error in
one step kept from the steps after it. Apart from the loop (`daemon/loop.py`) so the
tick reads as its steps."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import TracebackType

from sqlalchemy import event
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import ORMExecuteState, Session, SessionTransaction, sessionmaker

from supervisor.storage import database, store
from supervisor.storage.writability import Writability, unwritable_reason

log = logging.getLogger("supervisor.daemon.loop")  # the tick's log, whichever module writes it


@dataclass
class Written:
    ok: bool = False
    """The block's writes were committed."""


_WROTE = store.WROTE
"""`Session.info` key: the session's open transaction has sent a write (a flush, an
INSERT/UPDATE/DELETE statement, or one marked with `store.note_written`)."""
_WATCHED = "jobsup.writes_watched"


def _flushed(session: Session, _context: object) -> None:
    store.note_written(session)


def _executed(state: ORMExecuteState) -> None:
    if state.is_insert or state.is_update or state.is_delete:
        store.note_written(state.session)


def _ended(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:  # the outer transaction: committed or rolled back
        session.info.pop(_WROTE, None)


def watch_writes(target: Session | sessionmaker[Session]) -> None:
    """Have a session, or every session a sessionmaker makes from now on, mark its writes
    (`has_writes`). The engine does it once for its sessionmaker: three listeners added
    to each tick's new session cost ~0.15 ms a tick (#15). Once per target."""
    watched = (target.kw.get("info", {}) if isinstance(target, sessionmaker)
               else target.info)
    if watched.get(_WATCHED):
        return
    event.listen(target, "after_flush", _flushed)
    event.listen(target, "do_orm_execute", _executed)
    event.listen(target, "after_transaction_end", _ended)
    if isinstance(target, sessionmaker):
        target.configure(info={**target.kw.get("info", {}), _WATCHED: True})
    else:
        target.info[_WATCHED] = True


def _watch_writes(session: Session) -> None:
    if not session.info.get(_WATCHED):
        watch_writes(session)


def has_writes(session: Session) -> bool:
    """The session holds changes not yet committed: pending objects or attribute
    changes, or writes already sent to the database in its open transaction."""
    return bool(session.info.get(_WROTE) or session.new or session.deleted
                or session.identity_map.check_modified())


class TickSteps:
    def __init__(self, writability: Writability | None = None) -> None:
        self.writability = writability or Writability()
        """Whether the database takes writes, as the ticks find it (/healthz reads it)."""
        self._failed: tuple[str, str] | None = None
        """This tick's first write refused for want of storage: (reason, step)."""
        self._proven: int | None = None
        """This tick committed a write that shows the database takes writes: the refusals
        counted before it began (`Writability.failures`); None: no such write yet."""

    def isolated(self, session: Session, what: str) -> _Isolated:
        """One step of the tick whose unexpected failure is logged and rolled back, so
        the steps after it still run: a bug in reading one job's output must not keep
        the pending jobs from starting, nor the other jobs from being watched."""
        return _Isolated(self, session, what)

    def writing(self, session: Session, what: str) -> _Writing:
        """Commit what the block wrote. A database that cannot be written (its disk
        full, its file read-only: `writability.unwritable_reason`) is survived: the
        block's writes are rolled back (they are redone from the facts next tick) and
        the yielded outcome's `ok` stays False; other errors propagate.

        A block that wrote nothing (a running job whose state did not change: most jobs,
        most ticks) commits nothing: there is nothing to lose, and a commit per job per
        tick was a good part of the tick's cost (#15). Nor does it prove the database
        writable: only a commit that wrote does (`tick_ended`)."""
        return _Writing(self, session, what)

    def refused(self, error: BaseException, what: str) -> bool:
        """Note an error of the tick that is the database refusing writes for want of
        storage (True); False for any other."""
        reason = unwritable_reason(error)
        if reason is None:
            return False
        if self._failed is None:
            self._failed = (reason, what)
        return True

    def proof(self, session: Session) -> tuple[int, database.Writer | None]:
        """Taken before a block's commit: the refusals counted so far, and while writes
        fail and this tick has not shown them through since the last refusal, the
        connection the commit goes through (`database.writer`), which must show the
        files writable again (None while nothing is in doubt)."""
        failures = self.writability.failures
        if self.writability.reason is None or self._proven == failures:
            return failures, None
        return failures, database.writer(session)

    def committed(self, proof: tuple[int, database.Writer | None]) -> None:
        """A block of this tick committed writes: the database takes them, as of the
        refusals counted before the commit (`proof`; a refusal the API met meanwhile is
        newer news). Not shown by a commit through a connection condemned since it was
        opened: it kept its file descriptors from before the spell. One that shows it
        condemns the connections opened during the spell, read-only ones among them
        (`database.Lineage`)."""
        failures, writer = proof
        if writer is not None:
            if not writer.trusted:
                return
            writer.lineage.condemn()
        self._proven = failures if self._proven is None else max(self._proven, failures)

    @property
    def unproven(self) -> bool:
        """Writes failed before, and this tick has neither shown them through since the
        last refusal nor failed yet: a write must show whether the database takes them
        again (`store.write_probe`)."""
        return self.writability.reason is not None \
            and self._proven != self.writability.failures and self._failed is None

    def tick_ended(self) -> None:
        """Tell `writability` what this tick found: a refused write, else a committed
        one; neither (nothing written) changes nothing."""
        failed, proven = self._failed, self._proven
        self._failed, self._proven = None, None
        if failed is not None:
            self.writability.failed(*failed)
        elif proven is not None:
            self.writability.succeeded(after=proven)


class _Isolated:
    """`TickSteps.isolated` (a class, not a generator: the tick enters two steps per
    job, and a generator's context manager costs several times as much: #15)."""

    __slots__ = ("steps", "session", "what")

    def __init__(self, steps: TickSteps, session: Session, what: str) -> None:
        self.steps, self.session, self.what = steps, session, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> bool:
        if not isinstance(error, Exception):  # none, or one that must end the tick
            return False
        self.session.rollback()
        if self.steps.refused(error, self.what):  # logged once by `Writability`
            return True
        log.error("tick step failed (%s); the rest of the tick goes on", self.what,
                  exc_info=error)
        return True


class _Writing:
    """`TickSteps.writing`."""

    __slots__ = ("steps", "session", "what", "outcome")

    def __init__(self, steps: TickSteps, session: Session, what: str) -> None:
        self.steps, self.session, self.what = steps, session, what
        self.outcome = Written()

    def __enter__(self) -> Written:
        _watch_writes(self.session)
        return self.outcome

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> bool:
        steps, session = self.steps, self.session
        if kind is None:
            if not has_writes(session):
                self.outcome.ok = True
                return False
            try:
                proof = steps.proof(session)
                session.commit()
            except OperationalError as failed:
                return self._failed(failed, raise_other=True)
            self.outcome.ok = True
            steps.committed(proof)
            return False
        if isinstance(error, OperationalError):
            return self._failed(error, raise_other=False)
        return False

    def _failed(self, error: OperationalError, *, raise_other: bool) -> bool:
        """Roll back; a database refusing writes for want of storage is survived (True:
        the error is swallowed), anything else goes on up (re-raised from a failed
        commit, else left to propagate)."""
        self.session.rollback()
        if not self.steps.refused(error, self.what):
            if raise_other:
                raise error
            return False
        return True
