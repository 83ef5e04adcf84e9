"""One failing step of a tick (a bug in observing one job, in the alert rules) is
logged and rolled back; the steps after it still run: pending jobs start, running jobs
are still settled. An in-process engine over a real SQLite database, real processes."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from supervisor.api.submission import submit_job
from supervisor.daemon.loop import Engine
from supervisor.spec import JobSpec, JobState
from supervisor.storage import store
from supervisor.storage.tables import Job
from tests.helpers import in_process_engine, python_job, wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Engine, sessionmaker[Session]]]:
    with in_process_engine(tmp_path / "data") as pair:
        yield pair


def submit(sessions: sessionmaker[Session], code: str, name: str) -> str:
    with sessions() as session:
        job, _ = submit_job(session, JobSpec(name=name, command=python_job(code)),
                            default_cwd=str(Path.cwd()), views={})
        session.commit()
        return job.id


def state(sessions: sessionmaker[Session], job_id: str) -> str:
    with sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job.state


def test_failing_steps_do_not_stop_the_rest_of_the_tick(
        engine: tuple[Engine, sessionmaker[Session]], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    eng, sessions = engine
    quick = submit(sessions, "pass", "quick")
    eng.tick()
    assert state(sessions, quick) == "running"
    wait_for(lambda: _shim_done(eng, sessions, quick), 20, what="the quick job's exit")

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("bug in a step")

    monkeypatch.setattr(eng.observer, "observe", broken)
    monkeypatch.setattr(eng.alerting, "record", broken)
    waiting = submit(sessions, "import time; time.sleep(30)", "waiting")
    with caplog.at_level(logging.ERROR, logger="supervisor.daemon.loop"):
        eng.tick()
    assert state(sessions, quick) == "succeeded"  # settled before the broken steps
    assert state(sessions, waiting) == "running"  # started after them
    failed = [r.getMessage() for r in caplog.records if "tick step failed" in r.getMessage()]
    assert any("observation" in m for m in failed) and any("alerts" in m for m in failed)


def _job(sessions: sessionmaker[Session], job_id: str) -> Job:
    with sessions() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def _shim_done(eng: Engine, sessions: sessionmaker[Session], job_id: str) -> bool:
    attempt = eng.backends.attempt(_job(sessions, job_id))
    return not eng.backend.shim_alive(attempt)


def test_a_pending_job_survives_a_failing_neighbour(
        engine: tuple[Engine, sessionmaker[Session]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A start that raises for one job leaves the other pending jobs to start."""
    eng, sessions = engine
    first = submit(sessions, "import time; time.sleep(30)", "first")
    second = submit(sessions, "import time; time.sleep(30)", "second")
    real_launch = eng.checks._launch

    def launch(session: Session, job: Job, spec: JobSpec, now: float) -> None:
        if job.id == first:
            raise RuntimeError("bug while starting one job")
        real_launch(session, job, spec, now)

    monkeypatch.setattr(eng.checks, "_launch", launch)
    eng.tick()
    assert state(sessions, first) == "pending"  # rolled back, tried again next tick
    assert state(sessions, second) == "running"
    monkeypatch.setattr(eng.checks, "_launch", real_launch)
    eng.tick()
    assert state(sessions, first) == "running"
    with sessions() as session:
        assert len(store.jobs_in_states(session, JobState.RUNNING)) == 2


def test_a_stop_asked_during_a_tick_keeps_a_pending_job_from_starting(
        engine: tuple[Engine, sessionmaker[Session]]) -> None:
    """The tick reads its jobs once at its start (#15), but a pending job is read again
    before its launch: a stop the API recorded meanwhile (here, during the alert step) is
    seen, and the job ends `stopped` without an attempt, as it did when the pending jobs
    were a query of their own."""
    eng, sessions = engine
    job_id = submit(sessions, "import time; time.sleep(30)", "stopped-mid-tick")
    real = eng._alert

    def alert_then_stop(*args: object, **kwargs: object) -> None:
        real(*args, **kwargs)  # type: ignore[arg-type]
        with sessions() as other:  # POST /jobs/{id}/stop, while the tick runs
            store.request_stop(other, job_id, now=eng.clock())
            other.commit()

    eng._alert = alert_then_stop  # type: ignore[method-assign]
    eng.tick()
    job = _job(sessions, job_id)
    assert (job.state, job.attempt) == (JobState.STOPPED, 0), (job.state, job.reason)
