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
from supervisor.alerting.recorder import FIRING_REREAD_S, RECENTLY_ENDED_S
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


def test_firing_alerts_are_read_again_only_once_one_may_have_opened(tmp_path: Path) -> None:
    """A tick that found no firing alert, and opened none, lets the next tick skip
    reading them (#15); a tick that opens one has the next read them again: the alert
    then resolves as it would have."""
    clock = Clock()
    with in_process_engine(tmp_path / "data", clock=clock) as (engine, sessions):
        statements: list[str] = []

        def executed(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            statements.append(statement)

        def alert_reads_of_a_tick() -> int:
            statements.clear()
            engine.tick()
            return len([s for s in statements if s.lstrip().startswith("SELECT")
                        and "FROM alerts" in s])

        event.listen(sessions.kw["bind"], "before_cursor_execute", executed)
        assert alert_reads_of_a_tick() == 1  # a new daemon: it cannot know
        assert alert_reads_of_a_tick() == 0  # none found, none opened
        with sessions() as session:  # a job fails: `crashed` opens on the next tick
            job = store.create_job(session, spec=JobSpec(name="j", command=["true"]), now=T0)
            job.attempt = 1
            store.transition(session, job, JobState.FAILED, now=clock(), reason="exit 1")
            session.commit()
        assert alert_reads_of_a_tick() == 0
        with sessions() as session:
            assert [a.rule for a in store.alerts(session, state=AlertState.FIRING)] \
                == [rules.CRASHED]
        assert alert_reads_of_a_tick() == 1  # it opened one: read again, found firing
        assert alert_reads_of_a_tick() == 1
        clock.advance(engine.settings.ended_alert_ttl_s + 1)
        assert alert_reads_of_a_tick() == 1  # resolved on this read
        with sessions() as session:
            assert store.alerts(session, state=AlertState.FIRING) == []
        assert alert_reads_of_a_tick() == 1  # (it found one firing then)
        assert alert_reads_of_a_tick() == 0
        clock.advance(FIRING_REREAD_S)
        assert alert_reads_of_a_tick() == 1  # read again now and then all the same
        assert alert_reads_of_a_tick() == 0
