"""argv: DATA_DIR. Ticks' writes (`TickSteps`) against a SQLite database in DATA_DIR
through a read-only spell, in the order that made the daemon's writability flap (#30):

1. a session opens a connection before the spell and keeps it;
2. the spell: the database files 0444, DATA_DIR 0555;
3. a tick writes through a connection opened in the spell: refused;
4. the old session writes: its connection kept its read-write descriptors;
5. a reader opens a connection in the spell (read-only for good) and keeps it;
6. the fix: the modes put back;
7. a tick writes through a new connection; the reader's goes back to the pool;
8. more ticks, one of which draws the reader's connection from the pool.

Prints one JSON line per step: what the daemon's `Writability` says after it
(`reason`: None while writes go through) and whether the step's write went through.
Run it without CAP_DAC_OVERRIDE when root (`setpriv`), or file modes stop nothing."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session

from supervisor.storage import database, store
from supervisor.storage.transactions import TickSteps
from supervisor.storage.writability import Writability

LATER_TICKS = 8
"""Ticks after the fix: more than the connections the pool can hold by then."""


def main(argv: list[str] | None = None) -> int:
    data_dir = Path((sys.argv[1:] if argv is None else argv)[0])
    logging.basicConfig(stream=sys.stdout, format="LOG %(levelname)s %(message)s")
    engine = database.make_engine(f"sqlite:///{data_dir / 'jobsup.db'}")
    database.upgrade(engine)
    sessions = database.make_sessionmaker(engine)
    steps = TickSteps(Writability())

    def report(step: str, ok: bool | None = None) -> None:
        print(json.dumps({"step": step, "ok": ok, "reason": steps.writability.reason}),
              flush=True)

    def tick(session: Session, step: str) -> None:
        with steps.writing(session, step) as written:
            store.write_probe(session)
        steps.tick_ended()
        session.close()
        report(step, written.ok)

    files = [data_dir / name for name in ("jobsup.db", "jobsup.db-wal", "jobsup.db-shm")]
    before = sessions()
    before.execute(text("SELECT count(*) FROM alembic_version"))  # its connection, kept
    for path in files:
        path.chmod(0o444)
    data_dir.chmod(0o555)
    report("spell")
    tick(sessions(), "tick in the spell")
    tick(before, "old connection in the spell")
    reader = sessions()
    reader.execute(text("SELECT count(*) FROM alembic_version"))
    data_dir.chmod(0o755)
    for path in files:
        path.chmod(0o644)
    report("fix")
    tick(sessions(), "tick after the fix")
    reader.close()
    for i in range(LATER_TICKS):
        tick(sessions(), f"later tick {i}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
