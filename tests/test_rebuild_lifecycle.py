"""A job's end decided twice on the same files: by the live engine as its shim records
the exit (`checks.JobChecks.finish`), and by a rebuild of a lost database from the data
dir (`rebuild._ended`). Both go through `lifecycle.exit_of` and `after_exit`: the same
state, reason, exit reason, restart count and restart backoff (#31: the rebuild had its
own copy, without the backoff and with another reason)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from supervisor.api.submission import submit_job
from supervisor.daemon import rebuild
from supervisor.spec import JobSpec, RestartPolicy
from supervisor.storage.database import make_engine, make_sessionmaker, upgrade
from supervisor.storage.tables import Job
from tests.helpers import in_process_engine, job_row, wait_for

pytestmark = pytest.mark.timeout(60)

SPECS = {
    # fails with a known cause in its log, and has restarts left: pending, with a backoff
    "restarts": JobSpec(name="flaky", command=[
        sys.executable, "-c",
        "import sys; print('torch.OutOfMemoryError: CUDA out of memory', flush=True); "
        "sys.exit(1)"], restart_policy=RestartPolicy.ON_FAILURE, max_restarts=2),
    "killed": JobSpec(name="killed", command=[
        sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]),
    "succeeds": JobSpec(name="fine", command=[sys.executable, "-c", "pass"],
                        restart_policy=RestartPolicy.ON_FAILURE, max_restarts=2),
}


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def decided(job: Job, now: float) -> tuple[object, ...]:
    return (job.state, job.reason, job.exit_reason, job.exit_code, job.signal, job.restarts,
            job.attempt, None if job.next_start_at is None else job.next_start_at - now,
            job.ended_at)


def test_a_rebuilt_end_is_the_end_the_engine_decided(tmp_path: Path) -> None:
    clock = Clock()
    with in_process_engine(tmp_path / "data", clock) as (engine, sessions):
        ids = {}
        with sessions() as session:
            for case, spec in SPECS.items():
                job, _ = submit_job(session, spec, default_cwd=str(tmp_path), views={},
                                    jobs_dir=engine.settings.jobs_dir)
                ids[case] = job.id
            session.commit()

        def all_ended() -> bool:
            engine.tick()
            return all(job_row(sessions, job_id).attempt == 1
                       and job_row(sessions, job_id).state != "running"
                       for job_id in ids.values())

        wait_for(all_ended, 30, interval=0.1, what="the three jobs' ends")
        live = {case: decided(job_row(sessions, job_id), clock.now)
                for case, job_id in ids.items()}
        jobs_dir = engine.settings.jobs_dir

        database = make_engine(f"sqlite:///{tmp_path / 'rebuilt.db'}")
        upgrade(database)
        rebuilt_sessions = make_sessionmaker(database)
        try:
            with rebuilt_sessions() as session:
                rebuild.rebuild(session, jobs_dir, clock.now, settings=engine.settings)
                session.commit()
            rebuilt = {case: decided(job_row(rebuilt_sessions, job_id), clock.now)
                       for case, job_id in ids.items()}
        finally:
            database.dispose()

    assert live["restarts"][0] == "pending" and "in 1.0 s" in str(live["restarts"][1])
    assert "CUDA out of memory" in str(live["restarts"][1])
    assert live["killed"][0] == "failed" and live["succeeds"][0] == "succeeded"
    assert rebuilt == live
