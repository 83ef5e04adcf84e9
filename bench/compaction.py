"""Cost of one sample-downsampling pass (every 5 minutes, under the write lock) on a
database holding months of history: a full pass (what every pass did before the
`since` window), the first pass of a restarted daemon (from a day before the newest
sample) and an incremental pass.

`python bench/compaction.py --jobs 100 --rows-per-job 15000`"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import func, insert, select

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import describe  # noqa: E402
from supervisor.storage import store  # noqa: E402
from supervisor.storage.database import make_engine, make_sessionmaker, upgrade  # noqa: E402
from supervisor.storage.tables import Job, Sample  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--rows-per-job", type=int, default=15_000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    engine = make_engine(f"sqlite:///{work / 'db.sqlite'}")
    upgrade(engine)
    sessions = make_sessionmaker(engine)
    now = time.time()
    span = 90 * 86400  # each job spread over the last 90 days, already downsampled
    with sessions() as session:
        for j in range(args.jobs):
            session.add(Job(id=f"j{j}", name=f"job{j}", spec_json="{}", state="succeeded",
                            created_at=now - span, attempt=1, restarts=0))
        session.commit()
        step = span / args.rows_per_job
        for j in range(args.jobs):
            session.execute(insert(Sample), [
                {"job_id": f"j{j}", "t": now - span + i * step, "items_done": i, "files": i,
                 "bytes_written": i} for i in range(args.rows_per_job)])
        session.commit()
        t0 = time.perf_counter()
        store.compact_samples(session, now=now)  # the first pass after a start
        session.commit()
        timings = {"first pass (deletes)": time.perf_counter() - t0}
        rows = session.scalar(select(func.count()).select_from(Sample))
        for label, since in (("full pass 5 min later (each pass before)", None),
                             ("first pass of a restarted daemon (now)",
                              store.compaction_resume_point(session)),
                             ("incremental 5 min later (now)", store.compaction_cutoffs(now))):
            t0 = time.perf_counter()
            store.compact_samples(session, now=now + 300, since=since)
            session.commit()
            timings[label] = time.perf_counter() - t0
    print(describe())
    print(f"{rows:,} sample rows after the first pass ({args.jobs} jobs x "
          f"{args.rows_per_job:,} inserted over 90 days)\n")
    print("| pass | seconds |")
    print("| --- | ---: |")
    for label, seconds in timings.items():
        print(f"| {label} | {seconds:.4f} |")
    engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
