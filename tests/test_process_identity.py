"""A process is (pid, start ticks): the kernel's boot time moving under a running daemon
(a clock step or NTP slew moves /proc/stat's btime, which create times are computed
from) must not make the daemon lose its own jobs.

The boot time cannot be moved for real here without stepping the machine's clock, so the
daemon side reads a boot time 3 s later than the shim did (what a CI machine did to us:
two create times of one worker 3 s apart); everything else is real processes and files.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.orm import Session, sessionmaker

from supervisor.api.submission import submit_job
from supervisor.backends.base import ShimState
from supervisor.backends.local import worker_group_alive
from supervisor.config import Settings
from supervisor.daemon.loop import Engine
from supervisor.runtime import files, procfs
from supervisor.runtime.files import attempt_dir
from supervisor.runtime.sampler import Sampler, TreeTarget
from supervisor.spec import JobSpec
from supervisor.storage.database import alembic_config, make_engine, upgrade
from supervisor.storage.tables import Base
from tests.helpers import in_process_engine, job_row, wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Engine, sessionmaker[Session], Settings]]:
    with in_process_engine(tmp_path / "data") as (eng, sessions):
        yield eng, sessions, eng.settings


def test_a_moved_boot_time_does_not_lose_running_jobs(
        engine: tuple[Engine, sessionmaker[Session], Settings],
        monkeypatch: pytest.MonkeyPatch) -> None:
    eng, sessions, settings = engine
    with sessions() as session:
        job, _ = submit_job(session, JobSpec(name="steady", command=[
            sys.executable, "-c", "import time; time.sleep(60)"]),
            default_cwd=str(Path.cwd()), views={})
        session.commit()
        job_id = job.id
    eng.tick()
    adir = attempt_dir(settings.jobs_dir, job_id, 1)
    wait_for(lambda: files.read_worker(adir) is not None, 15, what="the worker started")
    eng.tick()
    row = job_row(sessions, job_id)
    worker = files.read_worker(adir)
    assert worker is not None and row.pid == worker.pid
    assert row.pid_start_ticks == worker.start_ticks == procfs.start_ticks_of(worker.pid)
    assert row.shim_start_ticks == procfs.start_ticks_of(row.shim_pid or -1)

    real = procfs._boot_time()
    monkeypatch.setattr(procfs, "_boot_time", lambda: real + 3.0)
    assert procfs.create_time(worker.pid) != worker.create_time  # what the daemon sees now
    for _ in range(3):
        eng.tick()
        time.sleep(0.05)
    row = job_row(sessions, job_id)
    assert (row.state, row.attempt) == ("running", 1), row.reason
    attempt = eng.backend.attempt(job_id, 1, row.shim_pid, row.shim_create_time,
                                  row.shim_start_ticks)
    assert eng.backend.shim_state(attempt) is ShimState.RUNNING
    assert worker_group_alive(worker)
    reading = Sampler().sample([TreeTarget(job_id, attempt.shim_pid or -1,
                                           attempt.shim_create_time, worker.pid,
                                           attempt.shim_start_ticks)], time.time())[job_id]
    assert reading.num_procs == 2  # the shim and its worker, still recognised

    # a stranger under the shim's pid (start ticks one off) is not the shim
    other = eng.backend.attempt(job_id, 1, row.shim_pid, row.shim_create_time,
                                (row.shim_start_ticks or 0) + 1)
    assert eng.backend.shim_state(other) is ShimState.GONE


def test_files_of_an_older_shim_are_matched_by_create_time(tmp_path: Path) -> None:
    """shim.json / worker.json without start ticks (written before they were recorded)."""
    me = procfs.create_time(procfs.os.getpid())
    assert me is not None
    adir = tmp_path / "attempt-1"
    adir.mkdir()
    (adir / files.WORKER).write_text(
        f'{{"pid": {procfs.os.getpid()}, "create_time": {me}, "started_at": 1.0}}')
    worker = files.read_worker(adir)
    assert worker is not None and worker.start_ticks is None
    assert procfs.is_same_process(worker.pid, worker.create_time, worker.start_ticks)
    assert not procfs.is_same_process(worker.pid, me - 0.03)  # three ticks away: another
    assert not procfs.is_same_process(worker.pid, None)  # nothing recorded: not ours


@pytest.mark.both_databases
def test_migrations_match_the_tables_and_go_down_and_up(database_url: str) -> None:
    """Alembic's schema is the ORM's on SQLite and PostgreSQL (types, indexes, the
    partial unique index), and every migration goes down to nothing and up again."""
    db = make_engine(database_url)
    upgrade(db)
    with db.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], diff
    cfg = alembic_config(database_url)
    with db.begin() as conn:
        # rows must survive a downgrade (a copy-and-swap of `jobs` on SQLite, with
        # foreign keys on, would delete its samples through ON DELETE CASCADE)
        conn.exec_driver_sql(
            "INSERT INTO jobs (id, name, spec_json, state, attempt, restarts, created_at) "
            "VALUES ('j1', 'j', '{}', 'running', 1, 0, 1.0)")
        conn.exec_driver_sql("INSERT INTO samples (job_id, t) VALUES ('j1', 2.0)")
    with db.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0005")
        columns = {column["name"] for column in inspect(conn).get_columns("jobs")}
        assert "shim_start_ticks" not in columns and "shim_create_time" in columns
        assert conn.exec_driver_sql("SELECT count(*) FROM samples").scalar() == 1
        command.downgrade(cfg, "base")
        assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
    upgrade(db)
    with db.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
        assert inspect(conn).get_table_names()
    db.dispose()


def test_a_namesake_from_another_boot_is_not_the_process() -> None:
    """Same pid, same start ticks, but a create time a boot's uptime away: a process of
    another boot that happened to start at the same tick (the recorded one died with the
    machine)."""
    pid = os.getpid()
    ticks, created = procfs.start_ticks_of(pid), procfs.create_time(pid)
    assert ticks is not None and created is not None
    assert procfs.is_same_process(pid, created - 3.0, ticks)  # a clock step: still ours
    assert procfs.is_same_process(pid, None, ticks)
    assert not procfs.is_same_process(pid, created - 2 * procfs.OTHER_BOOT_S, ticks)
