"""How the engine's tick writes: each step in a transaction of its own, a full disk
under the database survived, and an unexpected error in one step kept from the steps
after it. Apart from the loop (`daemon/loop.py`) so the tick reads as its steps."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from supervisor.storage import store

log = logging.getLogger("supervisor.daemon.loop")  # the tick's log, whichever module writes it


@dataclass
class Written:
    ok: bool = False
    """The block's writes were committed."""


class TickSteps:
    def __init__(self) -> None:
        self.database_full = False
        """The last write failed for lack of disk space (SQLITE_FULL)."""

    @contextmanager
    def isolated(self, session: Session, what: str) -> Iterator[None]:
        """One step of the tick whose unexpected failure is logged and rolled back, so
        the steps after it still run: a bug in reading one job's output must not keep
        the pending jobs from starting, nor the other jobs from being watched."""
        try:
            yield
        except Exception:
            session.rollback()
            log.exception("tick step failed (%s); the rest of the tick goes on", what)

    @contextmanager
    def writing(self, session: Session, what: str) -> Iterator[Written]:
        """Commit what the block wrote. A full disk under the database is survived:
        the block's writes are rolled back (they are redone from the facts next tick)
        and the yielded outcome's `ok` stays False; other errors propagate."""
        outcome = Written()
        try:
            yield outcome
            session.commit()
            outcome.ok = True
        except OperationalError as exc:
            session.rollback()
            if not store.is_disk_full(exc):
                raise
            if not self.database_full:
                log.error("the database's disk is full (%s): keeping samples in memory and "
                          "sending alerts unrecorded until space returns", what)
            self.database_full = True
            return
        if self.database_full:
            log.warning("the database is writable again")
            self.database_full = False
