"""The store against a real SQLite database, where the tick's long session meets the
API's short ones: a row the API changed is read as changed, and success messages are
told once per attempt."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

from supervisor.errors import IllegalTransition
from supervisor.spec import TRANSITIONS, JobSpec, JobState
from supervisor.storage import outbox, store
from supervisor.storage.tables import Notification, SampleRecord

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
        store.start_attempt(tick, job, now=T0 + 1, launched_from=("a" * 32, "/data/jobs"))
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


def test_counts_beyond_32_bits_are_kept(sessions: sessionmaker[Session]) -> None:
    """Start ticks pass 2**31 after 248 days of uptime, and a progress count of tokens
    passes it in a day of training: PostgreSQL's `integer` is 32 bits, SQLite's is not."""
    ticks, tokens = 2**31 + 12_345, 5_000_000_000
    with sessions() as session:
        job = store.create_job(session, spec=JobSpec(name="j", command=["true"]), now=T0)
        job.pid, job.pid_start_ticks, job.shim_start_ticks = 4242, ticks, ticks + 1
        session.flush()
        store.add_samples(session, [SampleRecord(
            job_id=job.id, t=T0 + 1, items_done=tokens, items_total=2 * tokens, files=1,
            bytes_written=1 << 40, cpu_percent=1.0, cpu_time_s=1.0, rss_bytes=1, read_bytes=1,
            write_bytes=1, num_procs=1, num_threads=1, gpu_memory_bytes=None,
            disk_free_bytes=None)])
        session.commit()
        job_id = job.id
    with sessions() as session:
        row = store.get_job(session, job_id)
        assert (row.pid_start_ticks, row.shim_start_ticks) == (ticks, ticks + 1)
        sample = store.latest_sample(session, job_id)
        assert sample is not None and (sample.items_done, sample.items_total) == (tokens,
                                                                                  2 * tokens)


def test_downsampling_buckets_are_whole_minutes(sessions: sessionmaker[Session]) -> None:
    """A minute's bucket keeps its newest sample, on both databases: the bucket is
    floor(t / 60), where PostgreSQL's CAST to integer would round (x:50 joining the next
    minute's x:10)."""
    start = 1_800_000_000.0 // 900 * 900  # a whole quarter hour
    times = [start + minute * 60 + second for minute in range(10) for second in (10, 50)]
    with sessions() as session:
        job = store.create_job(session, spec=JobSpec(name="j", command=["true"]), now=start)
        session.flush()
        store.add_samples(session, [SampleRecord(
            job_id=job.id, t=t, items_done=i, items_total=None, files=0, bytes_written=0,
            cpu_percent=0.0, cpu_time_s=0.0, rss_bytes=0, read_bytes=0, write_bytes=0,
            num_procs=1, num_threads=1, gpu_memory_bytes=None, disk_free_bytes=None)
            for i, t in enumerate(times)])
        session.commit()
        assert store.compact_samples(session, now=start + 7 * 3600) == 10
        session.commit()
        kept = [sample.t for sample in store.samples(session, job.id, since=0)]
    assert kept == [start + minute * 60 + 50 for minute in range(10)]


def test_a_nul_from_outside_is_stored(sessions: sessionmaker[Session]) -> None:
    """Strings jobsup does not make can hold NUL: a webhook's error page (a notification's
    `last_error`), a job's log in a reason. PostgreSQL's text cannot, and the write that
    failed was the delivery's outcome: the message went out again and again. Kept as
    U+FFFD there; SQLite keeps the NUL."""
    page, reason = "HTTP 500: <html>\x00\x00</html>", "exited: log says a\x00b"
    with sessions() as session:
        job = store.create_job(session, spec=JobSpec(name="j", command=["true"]), now=T0)
        store.transition(session, job, JobState.FAILED, now=T0 + 1, reason=reason)
        outbox.add(session, ["webhook"], kind="firing", job_id=job.id, alert_id=None,
                   payload_json="{}", event_id="e1", now=T0)
        session.flush()
        row = outbox.head(session, "webhook")
        assert row is not None
        assert outbox.record_outcome(session, row.id, {"last_error": page})
        session.commit()
        job_id, row_id = job.id, row.id
    with sessions() as session:
        stored = session.get(Notification, row_id)
        assert stored is not None and stored.last_error is not None
        assert stored.last_error.replace("\ufffd", "\x00") == page
        assert (store.get_job(session, job_id).reason or "").replace("\ufffd", "\x00") == reason


@pytest.mark.parametrize("from_state", list(JobState))
def test_transition_refuses_what_the_lifecycle_does_not_allow(
        sessions: sessionmaker[Session], from_state: JobState) -> None:
    """Every (from, to) pair through store.transition: the edges of spec.TRANSITIONS are
    recorded with their event; any other raises IllegalTransition and leaves the job's
    state and events as they were. Ended states lead only back to pending (a restart)."""
    for to in JobState:
        with sessions() as session:
            job = store.create_job(session, spec=JobSpec(name="j", command=["true"]), now=T0)
            job.state = from_state.value
            session.commit()
            before = len(store.events(session, job.id))
            if to in TRANSITIONS[from_state]:
                store.transition(session, job, to, now=T0 + 1, reason="allowed")
                session.commit()
                assert job.state == to.value
                assert len(store.events(session, job.id)) == before + 1
            else:
                with pytest.raises(IllegalTransition, match=f"{from_state} -> {to}"):
                    store.transition(session, job, to, now=T0 + 1, reason="refused")
                session.rollback()
                session.refresh(job)
                assert job.state == from_state.value
                assert len(store.events(session, job.id)) == before
    if from_state.ended:
        assert TRANSITIONS[from_state] == {JobState.PENDING}
    assert from_state not in TRANSITIONS[from_state]  # a change, never a no-op
