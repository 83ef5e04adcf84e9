"""The tick at scale (#30): thousands of jobs pending behind one running dependency cost
the tick a few queries, not a row and a query each; when the dependency fails they fail
in a few commits, not one each; and once their ends are evaluated, later ticks do not
read them again for 10 minutes. An in-process engine over a real SQLite database, its
dependency a real `sleep` under a real shim; counts of statements, commits and rows
loaded, not times (the machine is shared)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.orm import Session, sessionmaker

from supervisor.daemon.checks import PENDING_BATCH
from supervisor.spec import JobSpec, JobState
from supervisor.storage import store
from supervisor.storage.tables import Job
from tests.helpers import in_process_engine, tmpfs, wait_for

pytestmark = pytest.mark.timeout(120)

WAITING = 600
"""Jobs pending behind the one dependency (the issue had 10,000; the counts scale)."""


class Counts:
    """SQL statements, commits and job rows loaded while counting."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.statements = self.commits = self.job_rows = 0
        bind = sessions.kw["bind"]
        event.listen(bind, "before_cursor_execute", self._statement)
        event.listen(bind, "commit", self._commit)
        event.listen(Job, "load", self._loaded)
        self._bind = bind

    def _statement(self, *_args: Any) -> None:
        self.statements += 1

    def _commit(self, *_args: Any) -> None:
        self.commits += 1

    def _loaded(self, *_args: Any) -> None:
        self.job_rows += 1

    def reset(self) -> None:
        self.statements = self.commits = self.job_rows = 0

    def close(self) -> None:
        event.remove(self._bind, "before_cursor_execute", self._statement)
        event.remove(self._bind, "commit", self._commit)
        event.remove(Job, "load", self._loaded)


@pytest.fixture
def waiting_sweep(tmp_path: Path) -> Iterator[tuple[Any, sessionmaker[Session], str, list[str]]]:
    """An engine with one running dependency and WAITING jobs pending behind it, plus a
    chain of two more behind the first of them: (engine, sessions, dependency, chain)."""
    with in_process_engine(tmp_path / "data") as (engine, sessions):
        now = time.time()
        with sessions() as session:
            dependency = store.create_job(
                session, spec=JobSpec(name="data", command=["sleep", "60"]), now=now)
            session.flush()
            for index in range(WAITING):
                store.create_job(session, spec=JobSpec(
                    name=f"sweep-{index}", command=["true"], depends_on=[dependency.id]),
                    now=now + 1 + index * 1e-3)
            session.commit()
            dependency_id = dependency.id
        with sessions() as session:
            first = session.scalars(select(Job).where(Job.name == "sweep-0")).one().id
            second = store.create_job(session, spec=JobSpec(
                name="chain-1", command=["true"], depends_on=[first]), now=now + 10)
            session.flush()
            third = store.create_job(session, spec=JobSpec(
                name="chain-2", command=["true"], depends_on=[second.id]), now=now + 11)
            session.commit()
            chain = [first, second.id, third.id]
        engine.tick()  # launches the dependency
        with sessions() as session:
            assert store.get_job(session, dependency_id).state == JobState.RUNNING

        def worker_recorded() -> bool:  # its worker's pid written: nothing left to record
            engine.tick()
            with sessions() as session:
                return store.get_job(session, dependency_id).pid is not None
        wait_for(worker_recorded, timeout=30)
        engine.tick()  # a tick after the one that recorded it
        yield engine, sessions, dependency_id, chain


def states(sessions: sessionmaker[Session]) -> dict[str, int]:
    with sessions() as session:
        counts: dict[str, int] = {}
        for job in store.list_jobs(session):
            counts[job.state] = counts.get(job.state, 0) + 1
        return counts


def test_jobs_waiting_on_a_dependency_cost_a_tick_a_few_queries(
        waiting_sweep: tuple[Any, sessionmaker[Session], str, list[str]]) -> None:
    engine, sessions, _, _ = waiting_sweep
    counts = Counts(sessions)
    try:
        engine.tick()
        counts.reset()
        engine.tick()
    finally:
        counts.close()
    # before: a full row and a `session.get` of the dependency per waiting job
    assert counts.statements < 20, counts.statements
    assert counts.job_rows <= 2, counts.job_rows  # the running dependency
    assert counts.commits <= 1, counts.commits
    assert states(sessions) == {"running": 1, "pending": WAITING + 2}


def test_a_failed_dependency_fails_its_dependents_in_a_few_commits_and_once(
        waiting_sweep: tuple[Any, sessionmaker[Session], str, list[str]]) -> None:
    engine, sessions, dependency, chain = waiting_sweep
    with sessions() as session:
        store.request_stop(session, dependency, now=engine.clock())
        session.commit()
    counts = Counts(sessions)
    try:
        def all_ended() -> bool:
            engine.tick()
            return states(sessions).get("pending", 0) == 0

        wait_for(all_ended, 60, interval=0.2, what="the dependents failed")
        # before: a commit per failed job (~4 ms each: 12.6 s for 10,000)
        assert counts.commits <= WAITING / PENDING_BATCH + 20, counts.commits
        assert states(sessions) == {"stopped": 1, "failed": WAITING + 2}
        with sessions() as session:  # the chain behind the first failed in its tick too
            reasons = [store.get_job(session, job_id).reason for job_id in chain]
        assert reasons == [f"dependency {dependency} (data) stopped",
                           f"dependency {chain[0]} (sweep-0) failed",
                           f"dependency {chain[1]} (chain-1) failed"], reasons

        engine.tick()  # their ends evaluated once (no alert: a dependency's end)
        counts.reset()
        engine.tick()
        # before: every job ended in the last 10 minutes was read and evaluated each tick
        assert counts.job_rows == 0, counts.job_rows
    finally:
        counts.close()


PENDING_SCAN = "SELECT jobs.id, jobs.name, jobs.stop_requested_at, jobs.next_start_at"
"""What the statement that reads every pending job selects (`store.pending_jobs`)."""


def test_a_tick_where_no_pending_job_changed_does_not_read_them_again(
        waiting_sweep: tuple[Any, sessionmaker[Session], str, list[str]]) -> None:
    """Once a pass over the pending jobs acted on none, the next reads them again only
    when something they wait on changed: a submit, a stop, a restart, a running job's
    end (#30: reading and checking 10,000 of them cost ~80 ms a tick). Each change is
    still acted on in the next tick."""
    engine, sessions, dependency, chain = waiting_sweep
    scans: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.startswith(PENDING_SCAN):
            scans.append(statement)

    bind = sessions.kw["bind"]
    event.listen(bind, "before_cursor_execute", note)
    try:
        engine.tick()
        scans.clear()
        engine.tick()
        engine.tick()
        assert scans == []  # before: every tick read all of them

        with sessions() as session:  # a stop asked for one of them
            store.request_stop(session, chain[2], now=engine.clock())
            session.commit()
        engine.tick()
        assert len(scans) == 1
        with sessions() as session:
            assert store.get_job(session, chain[2]).state == JobState.STOPPED

        with sessions() as session:  # a submit that waits on nothing
            free = store.create_job(session, spec=JobSpec(name="free", command=["sleep", "30"]),
                                    now=engine.clock())
            session.commit()
            free_id = free.id
        engine.tick()
        with sessions() as session:
            assert store.get_job(session, free_id).state == JobState.RUNNING
        engine.tick()  # (the launch is a change: one more look, that acts on none)
        scans.clear()
        engine.tick()
        assert scans == []

        with sessions() as session:  # a restart of the stopped job: pending again
            store.requeue(session, chain[2], now=engine.clock())
            session.commit()
        engine.tick()
        assert len(scans) == 1
        with sessions() as session:  # it waits for its dependency again
            assert store.get_job(session, chain[2]).state == JobState.PENDING

        with sessions() as session:  # the dependency's end fails its dependents
            store.request_stop(session, dependency, now=engine.clock())
            session.commit()
        wait_for(lambda: (engine.tick(), states(sessions).get("pending", 0) == 0)[1], 60,
                 interval=0.2, what="the dependents failed")
    finally:
        event.remove(bind, "before_cursor_execute", note)
    assert states(sessions) == {"stopped": 1, "failed": WAITING + 2, "running": 1}


def test_jobs_sharing_a_directory_read_its_free_space_once_a_tick(tmp_path: Path) -> None:
    """Jobs without an output directory are read on their cwd, which a sweep's jobs
    share: its free space is read once per tick time for all of them (`DisksOfTick`;
    #30: a statvfs and a stat per job per tick before), and again at the next tick."""
    from supervisor.observe.readings import DisksOfTick, FileSide, ObservedJob, output_scanner

    jobs_dir = tmp_path / "jobs"
    jobs_dir.mkdir()
    with tmpfs(tmp_path / "work", "32m") as cwd:  # a disk no one else writes to
        disks = DisksOfTick()
        sides = [FileSide(jobs_dir, output_scanner, disks=disks) for _ in range(2)]
        jobs = [ObservedJob(job_id=f"j{index}", spec=JobSpec(name=f"j{index}", command=["true"],
                                                             cwd=str(cwd)),
                            attempt=1, root_pid=-1, root_create_time=None, worker_pid=None)
                for index in range(2)]
        now = time.time()
        first = sides[0].read(jobs[0], now)
        (cwd / "filler").write_bytes(b"\0" * (16 << 20))  # its free space moves meanwhile
        second = sides[1].read(jobs[1], now)
        assert (second.free_bytes, second.device) == (first.free_bytes, first.device)
        later = sides[1].read(jobs[1], now + 2)
        assert later.free_bytes is not None and first.free_bytes is not None
        assert later.free_bytes == first.free_bytes - (16 << 20)
