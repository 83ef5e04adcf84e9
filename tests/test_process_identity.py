"""A process is (pid, start ticks, boot id): the kernel's boot time moving under a
running daemon (a clock step or NTP slew moves /proc/stat's btime, which create times are
computed from) must not make the daemon lose its own jobs.

The boot time cannot be moved for real here without stepping the machine's clock, so the
daemon side reads a boot time 3 s later than the shim did (what a CI machine did to us:
two create times of one worker 3 s apart), or two hours (a clock step: #46); everything
else is real processes and files. tests/test_clock_jump.py moves it for a whole daemon.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
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
from supervisor.storage.tables import Base, Job
from tests.helpers import in_process_engine, job_row, wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Engine, sessionmaker[Session], Settings]]:
    with in_process_engine(tmp_path / "data") as (eng, sessions):
        yield eng, sessions, eng.settings


@pytest.mark.parametrize("moved_s", [3.0, 7200.0])
def test_a_moved_boot_time_does_not_lose_running_jobs(
        engine: tuple[Engine, sessionmaker[Session], Settings],
        monkeypatch: pytest.MonkeyPatch, moved_s: float) -> None:
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
    boot = procfs.this_boot_id()
    assert boot is not None and (row.pid_boot_id, row.shim_boot_id, worker.boot_id) == (
        boot, boot, boot)
    with sessions() as session:  # a row from before boot ids (migration 0011)
        session.get(Job, job_id).shim_boot_id = None  # type: ignore[union-attr]
        session.commit()
    eng.tick()  # its live shim, matched by create time, gets this boot's id
    assert job_row(sessions, job_id).shim_boot_id == boot

    real = procfs._boot_time()
    monkeypatch.setattr(procfs, "_boot_time", lambda: real + moved_s)
    assert procfs.create_time(worker.pid) != worker.create_time  # what the daemon sees now
    for _ in range(3):
        eng.tick()
        time.sleep(0.05)
    row = job_row(sessions, job_id)
    assert (row.state, row.attempt) == ("running", 1), row.reason
    attempt = eng.backend.attempt(job_id, 1, row.shim_pid, row.shim_create_time,
                                  row.shim_start_ticks, row.shim_boot_id)
    assert eng.backend.shim_state(attempt) is ShimState.RUNNING
    assert worker_group_alive(worker)
    reading = Sampler().sample([TreeTarget(job_id, attempt.shim_pid or -1,
                                           attempt.shim_create_time, worker.pid,
                                           attempt.shim_start_ticks, attempt.shim_boot_id)],
                               time.time())[job_id]
    assert reading.num_procs == 2  # the shim and its worker, still recognised

    # a stranger under the shim's pid (start ticks one off) is not the shim
    other = eng.backend.attempt(job_id, 1, row.shim_pid, row.shim_create_time,
                                (row.shim_start_ticks or 0) + 1, row.shim_boot_id)
    assert eng.backend.shim_state(other) is ShimState.GONE
    # and one of another boot with the shim's pid and start ticks is not either
    reboot = eng.backend.attempt(job_id, 1, row.shim_pid, row.shim_create_time,
                                 row.shim_start_ticks, str(uuid.uuid4()))
    assert eng.backend.shim_state(reboot) is ShimState.GONE


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
        command.downgrade(cfg, "0010")
        columns = {column["name"] for column in inspect(conn).get_columns("jobs")}
        assert "shim_boot_id" not in columns and "shim_start_ticks" in columns
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


def test_a_recorded_boot_id_decides_and_no_create_time_does() -> None:
    """With the boot id recorded (#46), the create time is not compared: a wall-clock
    step of hours moves it, a reboot changes the boot id."""
    pid = os.getpid()
    ticks, created, boot = (procfs.start_ticks_of(pid), procfs.create_time(pid),
                            procfs.this_boot_id())
    assert ticks is not None and created is not None and boot is not None
    assert len(boot) == 36 and procfs.boot_id_or_none(boot) == boot
    for step_s in (-7200.0, 0.0, 7200.0, 10 * procfs.OTHER_BOOT_S):
        assert procfs.is_same_process(pid, created + step_s, ticks, boot)
    assert procfs.is_same_process(pid, None, ticks, boot)
    other_boot = str(uuid.uuid4())
    assert not procfs.is_same_process(pid, created, ticks, other_boot)
    assert not procfs.is_same_process(pid, created, ticks + 1, boot)


@pytest.mark.parametrize("value", [None, 7, "", "x" * 36, "ABCDEF01-" + "0" * 27,
                                   "0" * 37, ["0" * 36]])
def test_a_boot_id_a_job_could_write_is_checked(tmp_path: Path, value: object) -> None:
    """The attempt's files are the job's to write: a boot id that is not one is None."""
    assert procfs.boot_id_or_none(value) is None
    (tmp_path / files.WORKER).write_text(json.dumps(
        {"pid": 1, "create_time": 1.0, "start_ticks": 5, "started_at": 1.0, "boot_id": value}))
    (tmp_path / files.SHIM).write_text(json.dumps(
        {"pid": 1, "create_time": 1.0, "start_ticks": 5, "boot_id": value}))
    worker, shim = files.read_worker(tmp_path), files.read_shim(tmp_path)
    assert worker is not None and worker.boot_id is None
    assert shim is not None and shim.get("boot_id") is None


def test_the_shim_records_its_boot(tmp_path: Path) -> None:
    """shim.json, claim.json and worker.json of a real shim carry this boot's id."""
    with in_process_engine(tmp_path / "data") as (eng, sessions):
        with sessions() as session:
            job, _ = submit_job(session, JobSpec(name="quick", command=[
                sys.executable, "-c", "pass"]), default_cwd=str(Path.cwd()), views={})
            session.commit()
        eng.tick()
        adir = attempt_dir(eng.settings.jobs_dir, job.id, 1)
        wait_for(lambda: files.read_worker(adir) is not None, 15, what="the worker started")
        boot = procfs.this_boot_id()
        shim, claim, worker = files.read_shim(adir), files.read_claim(adir), files.read_worker(adir)
        assert shim is not None and claim is not None and worker is not None
        assert (shim.get("boot_id"), claim.get("boot_id"), worker.boot_id) == (boot,) * 3
