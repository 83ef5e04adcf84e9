"""The store against a real SQLite database, where the tick's long session meets the
API's short ones: a row the API changed is read as changed, and success messages are
told once per attempt."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

from supervisor.spec import JobSpec, JobState
from supervisor.storage import outbox, store

pytestmark = pytest.mark.both_databases

T0 = 1_700_000_000.0



def test_a_restart_the_tick_did_not_see_is_not_undone(
        sessions: sessionmaker[Session]) -> None:
    """The tick records a stop and commits; before its pending step, the API requeues the
    job. The tick's session still holds the ended object (`expire_on_commit=False`): its
    pending query must hand back the row as it is now, or the stale `stop_requested_at`
    turns the restart into 'stopped on request before it started'."""
    with sessions() as api:
        job_id = store.create_job(api, spec=JobSpec(name="j", command=["true"]), now=T0).id
        api.commit()
    with sessions() as tick:
        (job,) = store.jobs_in_states(tick, JobState.PENDING)
        store.start_attempt(tick, job, now=T0 + 1)
        job.stop_requested_at = T0 + 2
        store.transition(tick, job, JobState.STOPPED, now=T0 + 3, reason="stopped")
        tick.commit()
        with sessions() as api:  # `jobsup restart` lands while the tick goes on
            store.requeue(api, job_id, now=T0 + 4)
            api.commit()
        (pending,) = store.jobs_in_states(tick, JobState.PENDING)
        assert pending is job  # the same object, refreshed
        assert (pending.state, pending.stop_requested_at) == (JobState.PENDING.value, None)
        assert (pending.ended_at, pending.exit_reason, pending.restarts) == (None, None, 1)


def test_a_success_is_told_once_per_attempt(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        outbox.add(session, ["slack"], kind="succeeded", job_id="j1", alert_id=None,
                   payload_json="{}", event_id="e1", now=T0 + 10)
        session.commit()
        # attempt 1 started at T0 and was told at T0 + 10
        assert outbox.jobs_notified(session, "succeeded", {"j1": T0}) == {"j1"}
        # attempt 2 (a restart by hand) started at T0 + 60: not told yet
        assert outbox.jobs_notified(session, "succeeded", {"j1": T0 + 60}) == set()
        assert outbox.jobs_notified(session, "succeeded", {}) == set()
