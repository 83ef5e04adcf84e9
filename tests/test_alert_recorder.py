"""The engine's alert step over jobs that ended long ago but keep an open alert (a
`crashed` stays firing for `ended_alert_ttl_s` after the end): their rows are read in one
query whatever their number, the alerts stay open until the TTL has passed, then
resolve. An in-process engine over a real SQLite database, on a fake clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from supervisor.alerting import rules
from supervisor.alerting.recorder import RECENTLY_ENDED_S
from supervisor.spec import AlertState, JobSpec, JobState
from supervisor.storage import store
from tests.helpers import T0, Clock, in_process_engine

pytestmark = pytest.mark.timeout(60)


def test_open_alerts_of_long_ended_jobs_are_read_at_once_and_age_out(tmp_path: Path) -> None:
    clock = Clock()
    with in_process_engine(tmp_path / "data", clock=clock) as (engine, sessions):
        with sessions() as session:
            for i in range(3):
                job = store.create_job(session, spec=JobSpec(name=f"j{i}", command=["true"]),
                                       now=T0)
                job.attempt = 1
                store.transition(session, job, JobState.FAILED, now=T0, reason="exit 1")
                session.flush()
                store.open_alert(session, job_id=job.id, rule=rules.CRASHED,
                                 severity="critical", message=f"j{i} failed: exit 1",
                                 started_at=T0)
            session.commit()

        statements: list[str] = []

        def executed(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            statements.append(statement)

        event.listen(sessions.kw["bind"], "before_cursor_execute", executed)
        clock.advance(RECENTLY_ENDED_S + 60)
        engine.tick()
        by_id = [s for s in statements if "FROM jobs" in s and "WHERE jobs.id" in s]
        assert len(by_id) == 1 and "WHERE jobs.id IN" in by_id[0], by_id  # not one per job
        with sessions() as session:
            firing = store.alerts(session, state=AlertState.FIRING)
            assert [a.message for a in firing] == [f"j{i} failed: exit 1" for i in range(3)]

        clock.advance(engine.settings.ended_alert_ttl_s)
        engine.tick()
        with sessions() as session:
            assert store.alerts(session, state=AlertState.FIRING) == []
            assert len(store.alerts(session, state=AlertState.RESOLVED)) == 3


def test_an_alert_opened_elsewhere_is_seen_by_the_next_tick(tmp_path: Path) -> None:
    """Every pass reads the firing alerts, whoever opened them (another daemon on the
    same database while this one had lost its lock, a rebuild): an alert that should not
    fire resolves on the next tick (#31: a tick that had found none firing skipped the
    read for up to a minute, on an assumption nothing guarded)."""
    clock = Clock()
    with in_process_engine(tmp_path / "data", clock=clock) as (engine, sessions):
        with sessions() as session:
            job = store.create_job(session, spec=JobSpec(name="j", command=["true"]), now=T0)
            store.start_attempt(session, job, now=T0, launched_from=("a" * 32, "/data/jobs"))
            store.transition(session, job, JobState.SUCCEEDED, now=T0, reason="exit 0")
            session.commit()
            job_id = job.id
        engine.tick()
        engine.tick()  # none firing, none opened
        with sessions() as session:
            store.open_alert(session, job_id=job_id, rule=rules.STALLED, severity="warning",
                             message="j: no new item for 10 min", started_at=clock())
            session.commit()
        clock.advance(1)
        engine.tick()
        with sessions() as session:
            assert store.alerts(session, state=AlertState.FIRING) == []
            assert [a.rule for a in store.alerts(session, state=AlertState.RESOLVED)] \
                == [rules.STALLED]
