"""A lost or damaged database: jobs are rebuilt from the data dir, running jobs are never
orphaned, and damage stops the daemon with `error:` / `hint:` until `--rebuild-db`.

The daemon tests run a real daemon that is SIGKILLed, then lose its database three ways:
truncated to 0 bytes, deleted, garbage written over its header; a PostgreSQL database has
no file to lose, but an empty one is rebuilt the same way. The unit tests call
`recovery.rebuild` on job directories written by hand (into both databases)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, text

from supervisor.api.submission import submit_job
from supervisor.config import Settings
from supervisor.daemon import recovery
from supervisor.daemon.rebuild import rebuild
from supervisor.errors import DatabaseDamaged, DatabaseUnavailable, JobRecordUnwritable
from supervisor.runtime.fileio import atomic_write_json
from supervisor.runtime.procfs import create_time, is_same_process, start_ticks_of
from supervisor.spec import JobSpec, RestartPolicy
from supervisor.storage.database import (
    engine_url,
    make_engine,
    make_sessionmaker,
    shown_url,
    upgrade,
)
from supervisor.storage.tables import Job, JobEvent
from tests.helpers import (
    PY,
    REPO,
    Daemon,
    Receiver,
    free_port,
    job_module,
    python_job,
    wait_for,
)


def db_path(daemon: Daemon) -> Path:
    return daemon.data_dir / "jobsup.db"


def start_jobs(daemon: Daemon) -> dict[str, Any]:
    """A running job, a failed one (exit 3) and one waiting for the running one."""
    long = daemon.submit(job_module("step_counter"), name="long")["id"]
    short = daemon.submit(python_job("import sys; sys.exit(3)"), name="short")["id"]
    after = daemon.submit(python_job("print('never')"), name="after", depends_on=[long])["id"]
    daemon.wait_state(short, "failed")
    job = wait_for(lambda: (j := daemon.job(long))["pid"] and j, 15, what="the long job's pid")
    wait_for(lambda: daemon.job(long)["progress"]["items_done"], 15, what="progress")
    pid = job["pid"]
    record = json.loads((daemon.data_dir / "jobs" / long / "job.json").read_text())
    assert (record["id"], record["name"], record["spec"]["depends_on"]) == (long, "long", [])
    return {"long": long, "short": short, "after": after, "pid": pid,
            "create_time": create_time(pid)}


def check_rebuilt(daemon: Daemon, jobs: dict[str, Any]) -> None:
    """The running job is re-adopted (same pid), stoppable, and ends `stopped`; the
    failed one keeps its exit; the dependent one keeps its dependency and fails with it."""
    long = daemon.job(jobs["long"])
    assert long["state"] == "running", long
    assert long["pid"] == jobs["pid"]
    assert is_same_process(jobs["pid"], jobs["create_time"])
    assert any("rebuilt from the data dir after the database was lost" in (e["reason"] or "")
               for e in daemon.events(jobs["long"]))
    assert long["spec"]["name"] == "long" and long["spec"]["command"] == job_module("step_counter")
    before = long["progress"]["items_done"] or 0
    wait_for(lambda: (daemon.job(jobs["long"])["progress"]["items_done"] or 0) > before, 15,
             what="progress observed by the new daemon")

    short = daemon.job(jobs["short"])
    assert (short["state"], short["exit_code"], short["name"]) == ("failed", 3, "short")
    after = daemon.job(jobs["after"])
    assert after["state"] == "pending" and after["spec"]["depends_on"] == [jobs["long"]]
    assert "rebuilt 3 jobs" in daemon.log() and "1 running" in daemon.log()

    response = daemon.http.post(f"/api/v1/jobs/{jobs['long']}/stop")
    assert response.status_code == 202, response.text
    stopped = daemon.wait_state(jobs["long"], "stopped", "failed", "lost", timeout=30)
    assert stopped["state"] == "stopped", stopped
    wait_for(lambda: not is_same_process(jobs["pid"], jobs["create_time"]), 10,
             what="the worker gone")
    failed = daemon.wait_state(jobs["after"], "failed")
    assert f"dependency {jobs['long']}" in failed["reason"]


def remove_wal(path: Path) -> None:
    for suffix in ("-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


@pytest.mark.slow
def test_database_truncated_to_zero_bytes_is_rebuilt(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon()
    jobs = start_jobs(daemon)
    daemon.kill()
    db_path(daemon).write_bytes(b"")
    remove_wal(db_path(daemon))
    daemon.start()
    check_rebuilt(daemon, jobs)


@pytest.mark.slow
def test_database_deleted_is_rebuilt(make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon()
    jobs = start_jobs(daemon)
    daemon.kill()
    db_path(daemon).unlink()  # the -wal and -shm stay behind: set aside, never replayed
    daemon.start()
    check_rebuilt(daemon, jobs)
    assert list(daemon.data_dir.glob("jobsup.db-wal.orphaned-*"))


def serve_command(daemon: Daemon, *args: str) -> list[str]:
    return [PY, "-m", "supervisor", "serve", "--port", str(daemon.port),
            "--data-dir", str(daemon.data_dir), *args]


def start_with(daemon: Daemon, *args: str) -> None:
    """Daemon.start with extra `serve` arguments."""
    daemon.starts += 1
    with open(daemon.log_path, "wb") as log:
        daemon.proc = subprocess.Popen(serve_command(daemon, *args), stdout=log,
                                       stderr=subprocess.STDOUT, env=daemon.env, cwd=REPO)
    daemon.wait_started()


@pytest.mark.slow
def test_damaged_database_stops_the_daemon_until_rebuild_db(
        make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon()
    jobs = start_jobs(daemon)
    daemon.kill()
    with closing(sqlite3.connect(db_path(daemon))) as conn:  # the WAL into the file, so
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")   # page 1 is read from the file
    with open(db_path(daemon), "r+b") as f:
        f.write(b"this is no database header!!" * 4)

    refused = subprocess.run(serve_command(daemon), env=daemon.env, cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    output = " ".join((refused.stdout + refused.stderr).split())  # rich wraps at 80 columns
    assert refused.returncode == 1, output
    assert f"error: the database {db_path(daemon)} is damaged" in output
    assert "hint: jobsup serve --rebuild-db moves it aside" in output
    assert "Traceback" not in output
    assert is_same_process(jobs["pid"], jobs["create_time"])  # the job ran on meanwhile

    start_with(daemon, "--rebuild-db")
    aside = list(daemon.data_dir.glob("jobsup.db.damaged-*"))
    assert [p.name for p in aside if not p.name.endswith(("-wal", "-shm"))], aside
    kept = next(p for p in aside if not p.name.endswith(("-wal", "-shm")))
    assert kept.read_bytes().startswith(b"this is no database header!!")
    assert "moved the damaged database aside" in daemon.log()
    check_rebuilt(daemon, jobs)

    # the rebuilt database is sound: left set, JOBSUP_REBUILD_DB does nothing more
    daemon.stop()
    daemon.env["JOBSUP_REBUILD_DB"] = "1"
    daemon.start()
    assert len(list(daemon.data_dir.glob("jobsup.db.damaged-*"))) == len(aside)
    assert "is sound; nothing to rebuild" in daemon.log()
    assert daemon.job(jobs["long"])["state"] == "stopped"
    assert len(daemon.events(jobs["long"])) >= 2  # the rebuilt history was kept


# -- without a daemon ---------------------------------------------------------------


def write_job(jobs_dir: Path, job_id: str, spec: JobSpec, created_at: float = 1000.0) -> None:
    (jobs_dir / job_id).mkdir(parents=True)
    atomic_write_json(jobs_dir / job_id / "job.json", {
        "id": job_id, "name": spec.name, "created_at": created_at,
        "spec": spec.model_dump(mode="json")})


def write_attempt(jobs_dir: Path, job_id: str, number: int, **files: Any) -> Path:
    adir = jobs_dir / job_id / f"attempt-{number}"
    adir.mkdir(parents=True)
    atomic_write_json(adir / "launch.json", {
        "job_id": job_id, "attempt": number, "argv": ["/bin/true"], "cwd": "/",
        "env": {"PATH": "/usr/bin", "JOBSUP_JOB_ID": job_id, "MY_SETTING": "x"},
        "log_path": str(adir / "output.log"), "stop_grace_s": 7.0})
    for name, data in files.items():
        atomic_write_json(adir / f"{name}.json", data)
    return adir


def status(**fields: Any) -> dict[str, Any]:
    return {"exit_code": None, "signal": None, "ended_at": 2000.0, "stop_requested": False,
            "killed_after_grace": False, "max_rss_bytes": 0, "spawn_error": None, **fields}


@pytest.mark.both_databases
def test_rebuild_classifies_each_job_from_its_newest_attempt(tmp_path: Path,
                                                             sessions: Any) -> None:
    jobs_dir = tmp_path / "jobs"
    spec = JobSpec(name="step", command=["/bin/true"], cwd="/")
    me = {"pid": os.getpid(), "create_time": create_time(os.getpid())}
    dead = {"pid": 2**22 + 5, "create_time": 1.0}  # above any pid_max default: no process
    cases: dict[str, dict[int, dict[str, Any]]] = {
        "a0000001": {},  # never started
        "a0000002": {1: {"status": status(exit_code=0)}},
        "a0000003": {1: {"status": status(exit_code=1)}, 2: {"status": status(signal=9)}},
        "a0000004": {1: {"status": status(signal=15, stop_requested=True)}},
        "a0000005": {1: {"shim": dead, "worker": {**dead, "started_at": 1500.0}}},
        "a0000006": {1: {"shim": dead, "worker": {**me, "started_at": 1500.0}}},
        "a0000007": {1: {"shim": me, "worker": {**dead, "started_at": 1500.0}}},
        "a0000008": {1: {"status": status(exit_code=127,
                                          spawn_error="jobsup: cannot start 'x'")}},
        # the boot time moved 3 s since the shim computed its create time (a clock step):
        # the start ticks still name this process
        "a0000009": {1: {"shim": {**me, "create_time": me["create_time"] - 3,
                                  "start_ticks": start_ticks_of(os.getpid())}}},
        # and a recorded start that is not this process's: gone, whatever the create time
        "a0000010": {1: {"shim": {**me, "start_ticks": start_ticks_of(os.getpid()) + 1}}},
    }
    for i, (job_id, attempts) in enumerate(cases.items()):
        deps = ["a0000001"] if job_id == "a0000002" else []
        write_job(jobs_dir, job_id, spec.model_copy(update={"depends_on": deps}),
                  created_at=1000.0 + i)
        for number, files in attempts.items():
            write_attempt(jobs_dir, job_id, number, **files)
    # an old job (before job.json existed): rebuilt from its launch.json
    write_attempt(jobs_dir, "b0000001", 1, status=status(exit_code=0))
    (jobs_dir / "b0000002").mkdir()  # nothing to rebuild from: skipped

    with sessions() as session:
        summary = rebuild(session, jobs_dir, now=3000.0,
                                   settings=Settings(data_dir=tmp_path))
        session.commit()
    assert summary.rebuilt == 11 and summary.running == 3 and summary.skipped == ["b0000002"]

    with sessions() as session:
        got = {job.id: job for job in session.query(Job)}
        states = {job_id: (job.state, job.exit_code, job.signal, job.attempt)
                  for job_id, job in got.items()}
        assert states == {
            "a0000001": ("pending", None, None, 0),
            "a0000002": ("succeeded", 0, None, 1),
            "a0000003": ("failed", None, 9, 2),
            "a0000004": ("stopped", None, 15, 1),
            "a0000005": ("lost", None, None, 1),
            "a0000006": ("running", None, None, 1),
            "a0000007": ("running", None, None, 1),
            "a0000008": ("failed", 127, None, 1),
            "a0000009": ("running", None, None, 1),
            "a0000010": ("lost", None, None, 1),
            "b0000001": ("succeeded", 0, None, 1),
        }
        assert got["a0000003"].reason.startswith("killed by signal 9 (SIGKILL)")
        assert got["a0000003"].restarts == 0 and got["a0000003"].ended_at == 2000.0
        assert got["a0000008"].reason == "jobsup: cannot start 'x'"
        assert got["a0000006"].pid == os.getpid() and got["a0000006"].shim_pid == dead["pid"]
        assert got["a0000007"].shim_pid == os.getpid()
        assert got["a0000007"].shim_create_time == me["create_time"]
        assert got["a0000006"].started_at == 1500.0
        assert JobSpec.model_validate_json(got["a0000002"].spec_json).depends_on == ["a0000001"]
        assert got["a0000001"].created_at == 1000.0
        old = JobSpec.model_validate_json(got["b0000001"].spec_json)
        assert (old.command, old.cwd, old.stop_grace_s) == (["/bin/true"], "/", 7.0)
        assert "JOBSUP_JOB_ID" not in old.env and old.env.get("MY_SETTING") == "x"
        events = session.query(JobEvent).filter(JobEvent.job_id == "a0000005").all()
        assert len(events) == 1 and "rebuilt from the data dir" in (events[0].reason or "")


@pytest.mark.both_databases
def test_rebuild_restarts_a_failure_with_restarts_left(tmp_path: Path, sessions: Any) -> None:
    jobs_dir = tmp_path / "jobs"
    spec = JobSpec(name="flaky", command=["/bin/false"], restart_policy=RestartPolicy.ON_FAILURE,
                   max_restarts=2)
    write_job(jobs_dir, "c0000001", spec)
    write_attempt(jobs_dir, "c0000001", 1, status=status(exit_code=1))
    with sessions() as session:
        rebuild(session, jobs_dir, now=3000.0,
                         settings=Settings(data_dir=tmp_path))
        session.commit()
        job = session.get(Job, "c0000001")
        assert job is not None and (job.state, job.restarts, job.attempt) == ("pending", 1, 1)
        assert job.next_start_at == 3000.0 + 1.0  # the backoff: restart_backoff_s x 2^0


def make_db(path: Path, rows: int = 2000) -> None:
    engine = make_engine(f"sqlite:///{path}")
    upgrade(engine)
    engine.dispose()
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO jobs (id, name, spec_json, state, created_at, attempt, "
                     "restarts) VALUES ('j', 'j', '{}', 'running', 0, 1, 0)")
        conn.executemany("INSERT INTO samples (job_id, t, files, bytes_written, cpu_percent, "
                         "cpu_time_s, rss_bytes, read_bytes, write_bytes, num_procs, "
                         "num_threads) VALUES ('j', ?, 0, 0, 0, 0, 0, 0, 0, 1, 1)",
                         [(float(i),) for i in range(rows)])
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def corrupt_page_of(path: Path, table: str) -> None:
    with closing(sqlite3.connect(path)) as conn:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        root = conn.execute("SELECT rootpage FROM sqlite_schema WHERE name = ?",
                            (table,)).fetchone()[0]
    with open(path, "r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(os.urandom(page_size))


@pytest.mark.parametrize("large", [False, True], ids=["whole-file", "per-table"])
def test_a_damaged_page_inside_the_file_is_found_at_start(
        tmp_path: Path, large: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if large:  # a database over the limit: every table is checked but samples
        monkeypatch.setattr(recovery, "QUICK_CHECK_FULL_MAX_BYTES", 0)
    path = tmp_path / "jobsup.db"
    make_db(path)
    assert recovery.damage(path) is None
    corrupt_page_of(path, "jobs")
    reason = recovery.damage(path)
    assert reason is not None, "quick_check missed a damaged page of jobs"
    with pytest.raises(DatabaseDamaged) as raised:
        recovery.check_or_set_aside(path, tmp_path / "jobs", rebuild_db=False, now=time.time())
    assert f"the database {path} is damaged" in raised.value.message
    assert "--rebuild-db" in (raised.value.hint or "")
    moved = recovery.check_or_set_aside(path, tmp_path / "jobs", rebuild_db=True,
                                        now=time.time())
    assert moved is not None and moved.name.startswith("jobsup.db.damaged-")
    assert moved.exists() and not path.exists()


@pytest.mark.both_databases
def test_submit_that_cannot_write_job_json_fails_and_records_nothing(
        tmp_path: Path, sessions: Any) -> None:
    not_a_dir = tmp_path / "jobs"
    not_a_dir.write_text("a file where the jobs directory should be")
    with sessions() as session:
        with pytest.raises(JobRecordUnwritable) as raised:
            submit_job(session, JobSpec(name="x", command=["/bin/true"]), default_cwd="/",
                       views={}, jobs_dir=not_a_dir)
        assert raised.value.status_code == 507 and "job.json" in raised.value.message
    with sessions() as session:
        assert session.query(Job).count() == 0


def test_job_json_of_a_submit_never_committed_is_removed(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'jobsup.db'}")
    upgrade(engine)
    jobs_dir = tmp_path / "jobs"
    sessions = make_sessionmaker(engine, jobs_dir=jobs_dir)
    with sessions() as session:  # closed without commit: the 201 was never sent
        job, _ = submit_job(session, JobSpec(name="x", command=["/bin/true"]),
                            default_cwd="/", views={})
        assert (jobs_dir / job.id / "job.json").exists()
    assert not (jobs_dir / job.id).exists()
    with sessions() as session:
        kept, _ = submit_job(session, JobSpec(name="y", command=["/bin/true"]),
                             default_cwd="/", views={})
        session.commit()
    assert (jobs_dir / kept.id / "job.json").exists()
    engine.dispose()


# -- PostgreSQL ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
def test_an_emptied_postgresql_database_is_rebuilt_from_the_data_dir(
        make_daemon: Callable[..., Daemon]) -> None:
    """No file to check or set aside (`--rebuild-db` says so and changes nothing): a
    database left without jobs (dropped and recreated, restored from nothing) gets them
    back from the data dir, the running one re-adopted."""
    daemon = make_daemon()
    url = daemon.env["JOBSUP_DATABASE_URL"]
    jobs = start_jobs(daemon)
    assert not db_path(daemon).exists()  # the state is in PostgreSQL, not the data dir
    daemon.kill()
    engine = make_engine(url)
    with engine.begin() as conn:
        assert conn.scalar(select(func.count()).select_from(Job)) == 3
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    start_with(daemon, "--rebuild-db")
    assert "there is no file to set aside" in daemon.log()
    check_rebuilt(daemon, jobs)
    assert not db_path(daemon).exists()


def test_an_unreachable_postgresql_stops_the_daemon_without_showing_the_password(
        postgres_server: Any, tmp_path: Path) -> None:
    """A database that does not exist on a running server, and a server that is not
    there: `error:` / `hint:`, the URL with `***` for its password, no traceback."""
    missing = postgres_server.url("no_such_database").replace("postgres@", "postgres:s3cret@")
    nobody = f"postgresql://jobsup:s3cret@127.0.0.1:{free_port()}/jobsup"
    for url, reason in ((missing, 'database "no_such_database" does not exist'),
                        (nobody, "Connection refused")):
        result = subprocess.run(
            [PY, "-m", "supervisor", "serve", "--port", str(free_port()), "--data-dir",
             str(tmp_path / "data")], capture_output=True, text=True, timeout=60, cwd=REPO,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("JOBSUP_")},
                 "JOBSUP_DATABASE_URL": url})
        assert result.returncode == 1, result.stderr
        shown = url.replace(":s3cret@", ":***@")
        assert f"error: cannot connect to the database {shown}" in result.stderr
        assert reason in result.stderr and "hint: start the database server" in result.stderr
        assert "s3cret" not in result.stdout + result.stderr
        assert "Traceback" not in result.stderr


def test_database_urls_name_psycopg_and_never_show_the_password() -> None:
    """`postgresql://` is psycopg 3 whatever SQLAlchemy's default driver (psycopg2 before
    2.1); a driver jobsup does not install is an error with a hint, password hidden."""
    for plain in ("postgresql://jobsup:s3cret@db:5432/jobsup", "postgres://jobsup:s3cret@db/j"):
        assert engine_url(plain).drivername == "postgresql+psycopg"
        assert engine_url(plain).password == "s3cret"
        assert "s3cret" not in shown_url(plain) and ":***@" in shown_url(plain)
    assert str(engine_url("sqlite:////tmp/x.db")) == "sqlite:////tmp/x.db"
    assert shown_url("not a url") == "(an unparsable database URL)"
    for query in ("password=s3cret", "dsn=host%3Ddb+password%3Ds3cret", "PASSWORD=s3cret"):
        shown = shown_url(f"postgresql://jobsup@db/jobsup?sslmode=require&{query}")
        assert "s3cret" not in shown and "sslmode=require" in shown, shown
    with pytest.raises(DatabaseUnavailable) as raised:
        make_engine("postgresql+psycopg2://jobsup:s3cret@db/jobsup")
    assert "s3cret" not in raised.value.message + (raised.value.hint or "")
    assert "postgresql+psycopg2://jobsup:***@db/jobsup" in raised.value.message
    assert "psycopg 3" in (raised.value.hint or "")
    engine = make_engine("postgresql://jobsup:s3cret@db/jobsup")  # connects on first use
    assert engine.dialect.driver == "psycopg" and engine.pool.status()
    engine.dispose()


def test_a_postgresql_role_that_cannot_create_the_tables_is_told_how(
        postgres_server: Any, tmp_path: Path) -> None:
    """PostgreSQL 15 grants CREATE on `public` to the database's owner only: a role that
    merely may connect gets `error:` / `hint:` saying what to grant, not a traceback."""
    with postgres_server.database() as owned_by_postgres:
        postgres_server.admin("CREATE ROLE jobsup_weak LOGIN PASSWORD 's3cret'")
        try:
            url = owned_by_postgres.replace("postgres@", "jobsup_weak:s3cret@")
            result = subprocess.run(
                [PY, "-m", "supervisor", "serve", "--port", str(free_port()), "--data-dir",
                 str(tmp_path / "data")], capture_output=True, text=True, timeout=60,
                cwd=REPO, env={**{k: v for k, v in os.environ.items()
                                  if not k.startswith("JOBSUP_")},
                               "JOBSUP_DATABASE_URL": url})
        finally:
            postgres_server.admin("DROP ROLE jobsup_weak")
    assert result.returncode == 1, result.stderr
    assert "does not let its role create jobsup's tables: permission denied" in result.stderr
    assert "hint: make the role the database's owner" in result.stderr
    assert "s3cret" not in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_a_rebuilt_database_keeps_stops_dependency_failures_and_told_alerts(
        make_daemon: Callable[..., Daemon], tmp_path: Path, receiver: Receiver) -> None:
    """Issue #30, item 4: stop X (pending on L), let F crash (its `crashed` alert sent)
    and fail D with it, kill -9 the daemon, delete the database, start: X stays stopped
    and never runs when L succeeds, D stays failed (not failed again), F's alert is not
    sent again."""
    go = tmp_path / "go"
    daemon = make_daemon(env={"JOBSUP_SLACK_WEBHOOK_URL": receiver.url})
    long = daemon.submit(job_module("waits_for_file", go), name="long")["id"]
    stopped = daemon.submit(python_job("print('ran')"), name="x", depends_on=[long])["id"]
    crashed = daemon.submit(python_job("import sys; sys.exit(3)"), name="f")["id"]
    dependent = daemon.submit(python_job("print('ran')"), name="d", depends_on=[crashed])["id"]
    assert daemon.http.post(f"/api/v1/jobs/{stopped}/stop").status_code == 202
    daemon.wait_state(stopped, "stopped")
    daemon.wait_state(dependent, "failed")
    wait_for(lambda: any("crashed" in t for t in receiver.texts()), 15, what="F's alert")
    before = {job_id: daemon.job(job_id) for job_id in (stopped, crashed, dependent)}

    daemon.kill()
    db_path(daemon).unlink()
    remove_wal(db_path(daemon))
    daemon.start()
    assert "rebuilt 4 jobs" in daemon.log()
    for job_id, was in before.items():
        job = daemon.job(job_id)
        assert (job["state"], job["reason"], job["exit_code"]) == (
            was["state"], was["reason"], was["exit_code"]), job
    alerts = daemon.http.get("/api/v1/alerts").json()
    assert [(a["job_id"], a["rule"], a["state"]) for a in alerts] == [
        (crashed, "crashed", "firing")]

    go.touch()  # L succeeds: X must not start, D must not fail again
    daemon.wait_state(long, "succeeded")
    daemon.wait_ticks(3)
    assert daemon.job(stopped)["state"] == "stopped"
    assert not (daemon.data_dir / "jobs" / stopped / "attempt-1").exists()
    for job_id in (stopped, dependent):
        assert len(daemon.events(job_id)) == 1, daemon.events(job_id)  # the rebuild's only
    assert sum("crashed" in t for t in receiver.texts()) == 1, receiver.texts()


@pytest.mark.both_databases
def test_rebuild_honours_a_stop_the_engine_had_not_acted_on(tmp_path: Path,
                                                           sessions: Any) -> None:
    """A stop recorded (`stop.json`) before the engine acted: a waiting job is rebuilt
    stopped, a running one keeps its stop request (the engine then stops it)."""
    jobs_dir = tmp_path / "jobs"
    spec = JobSpec(name="step", command=["/bin/true"], cwd="/")
    me = {"pid": os.getpid(), "create_time": create_time(os.getpid()),
          "start_ticks": start_ticks_of(os.getpid())}
    write_job(jobs_dir, "d0000001", spec)
    write_job(jobs_dir, "d0000002", spec)
    write_attempt(jobs_dir, "d0000002", 1, shim=me)
    for job_id in ("d0000001", "d0000002"):
        atomic_write_json(jobs_dir / job_id / "stop.json", {"requested_at": 1.0})
    with sessions() as session:
        rebuild(session, jobs_dir, now=3000.0,
                         settings=Settings(data_dir=tmp_path))
        session.commit()
        waiting, running = session.get(Job, "d0000001"), session.get(Job, "d0000002")
        assert waiting is not None and running is not None
        assert (waiting.state, waiting.exit_reason) == ("stopped", "stopped")
        assert (running.state, running.stop_requested_at) == ("running", 3000.0)
