"""argv: DATA_DIR. Ticks' writes (`TickSteps`) against a SQLite database in DATA_DIR
through a read-only spell, in the order that made the daemon's writability flap (#30):

1. a session opens a connection before the spell and keeps it; a tick writes before
   the spell and has not ended yet;
2. the spell: the database files 0444, DATA_DIR 0555; the API's write (through a
   connection opened in the spell) is refused; then the tick ends;
3. a tick writes through a connection opened in the spell: refused;
4. the old session writes: its connection kept its read-write descriptors; then every
   connection the pool holds is closed (as its recycling does, one at a time);
5. a reader opens a connection in the spell (read-only for good) and keeps it: without
   a connection from before the spell still open, it would map SQLite's shared-memory
   index read-only for every connection of the process until all have closed;
6. the fix: the modes put back;
7. a tick writes through a new connection; the reader's goes back to the pool;
8. more ticks, one of which draws the reader's connection from the pool.

Prints one JSON line per step: what the daemon's `Writability` says after it
(`reason`: None while writes go through) and whether the step's write went through.
Run it without CAP_DAC_OVERRIDE when root (`setpriv`), or file modes stop nothing."""

from __future__ import annotations

import gc
import json
import logging
import sys
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from supervisor.storage import database, store
from supervisor.storage.transactions import TickSteps
from supervisor.storage.writability import Writability, unwritable_reason

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

    def api_write(step: str) -> None:
        """A write as the API makes it: a refusal reported as its exception handler does."""
        api = sessions()
        try:
            store.write_probe(api)
            api.commit()
        except OperationalError as exc:
            reason = unwritable_reason(exc)
            assert reason is not None, exc
            steps.writability.failed(reason, "POST /api/v1/jobs")
            report(step, False)
        else:
            report(step, True)
        finally:
            api.close()

    files = [data_dir / name for name in ("jobsup.db", "jobsup.db-wal", "jobsup.db-shm")]
    before = sessions()
    before.execute(text("SELECT count(*) FROM alembic_version"))  # its connection, kept
    early = sessions()
    with steps.writing(early, "tick before the spell") as early_written:
        store.write_probe(early)
    early.execute(text("SELECT count(*) FROM alembic_version"))  # the API opens its own
    for path in files:
        path.chmod(0o444)
    data_dir.chmod(0o555)
    report("spell")
    api_write("API write in the spell")
    steps.tick_ended()  # the tick that wrote before the spell ends after the refusal
    report("the tick from before the spell ends", early_written.ok)
    early.close()
    tick(sessions(), "tick in the spell")
    tick(before, "old connection in the spell")
    engine.pool.dispose()  # not the engine's: that closes its keeper too
    gc.collect()  # and those the refusals' tracebacks still held: none is left open
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
