"""Jobs outlive the daemon: SIGKILL it, let jobs end meanwhile, restart, re-adopt."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from supervisor.storage.database import DAEMON_LOCK_KEY, make_engine
from tests.helpers import Daemon, exit_recorded, job_module, python_job, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.both_databases]


def test_daemon_sigkill_while_two_jobs_run(make_daemon, tmp_path: Path) -> None:
    daemon: Daemon = make_daemon()
    flag = tmp_path / "go"
    long = daemon.submit(python_job("import time; time.sleep(600)"), name="long")
    ends = daemon.submit(
        job_module("waits_for_file", flag, 5), name="ends-while-down")
    wait_for(lambda: all(daemon.job(j["id"])["pid"] for j in (long, ends)), 10,
             what="both workers running")
    long_before = daemon.job(long["id"])

    daemon.kill()
    flag.touch()  # the second job exits 5 while no daemon runs
    status_file = daemon.data_dir / "jobs" / ends["id"] / "attempt-1" / "status.json"
    wait_for(lambda: exit_recorded(status_file), 10, what="the shim's exit file")

    daemon.start()
    t0 = time.monotonic()  # once it answers: its start (imports, the database) not timed
    long_after = daemon.wait_state(long["id"], "running", timeout=10)
    ended = daemon.wait_state(ends["id"], "failed", timeout=10)
    assert time.monotonic() - t0 < 10  # settled by the restart's first tick
    assert long_after["pid"] == long_before["pid"]
    assert (ended["exit_code"], ended["exit_reason"]) == (5, "exit")
    # the re-adopted job is still supervised: a stop works through its shim
    daemon.http.post(f"/api/v1/jobs/{long['id']}/stop")
    stopped = daemon.wait_state(long["id"], "stopped", timeout=15)
    assert stopped["exit_reason"] == "stopped"


def test_exit_while_down_then_success_and_pending_jobs_start(make_daemon) -> None:
    daemon: Daemon = make_daemon()
    first = daemon.submit(python_job("import time; time.sleep(1.5)"), name="first")
    second = daemon.submit(python_job("pass"), name="second", depends_on=[first["id"]])
    attempt = daemon.data_dir / "jobs" / first["id"] / "attempt-1"
    wait_for((attempt / "worker.json").exists, 15, what="`first` started")
    daemon.kill()
    wait_for(lambda: exit_recorded(attempt / "status.json"), 20,
             what="`first` to succeed while the daemon is down")
    daemon.start()
    # a correctness test, not a speed one: the bound covers a busy 2-core CI machine
    # (5 s ran out in one fresh-clone run, after the daemon's start)
    assert daemon.wait_state(first["id"], "succeeded", timeout=15)["exit_code"] == 0
    assert daemon.wait_state(second["id"], "succeeded", timeout=15)["attempt"] == 1


def test_running_job_with_no_trace_left_is_lost(make_daemon) -> None:
    daemon: Daemon = make_daemon()
    job = daemon.submit(python_job("import time; time.sleep(600)"))
    wait_for(lambda: daemon.job(job["id"])["pid"], 10, what="worker pid")
    daemon.kill()
    attempt = daemon.data_dir / "jobs" / job["id"] / "attempt-1"
    for name in ("shim.json", "worker.json"):
        info = json.loads((attempt / name).read_text())
        subprocess.run(["kill", "-9", str(info["pid"])], check=True)
    time.sleep(0.5)
    daemon.start()
    done = daemon.wait_state(job["id"], "lost", timeout=5)
    assert done["exit_reason"] == "lost"


def test_second_daemon_on_the_same_data_dir_refuses(make_daemon) -> None:
    daemon: Daemon = make_daemon()
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "serve", "--port", "0",
         "--data-dir", str(daemon.data_dir)],
        capture_output=True, text=True, timeout=30, env=daemon.env,
    )
    assert result.returncode == 1
    assert f"error: another jobsup daemon (pid {daemon.proc.pid}) owns" in result.stderr
    assert "hint:" in result.stderr and "Traceback" not in result.stderr
    assert daemon.http.get("/healthz").status_code == 200  # the first is untouched


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
def test_second_daemon_on_the_same_postgresql_database_refuses(make_daemon) -> None:
    """Another data dir, the same database: it would launch the first one's pending jobs
    and call its running ones lost. Refused while the first lives; and after it, while a
    job the first launched runs (its files are in the first data dir: the second, not
    seeing them, ran it a second time in 8 of 8 tries, #30 item 7)."""
    first: Daemon = make_daemon()
    url = first.env["JOBSUP_DATABASE_URL"]
    job = first.submit(python_job("import time; time.sleep(600)"))
    first.wait_state(job["id"], "running")
    second: Daemon = make_daemon(env={"JOBSUP_DATABASE_URL": url}, start=False)
    assert second.data_dir != first.data_dir
    second.start(wait=False)
    assert second.proc is not None and second.proc.wait(30) == 1
    shown = url.split("@")[-1]
    assert f"error: another jobsup daemon uses the database postgresql+psycopg://postgres@{shown}" \
        in second.log()
    assert "Traceback" not in second.log()
    assert first.job(job["id"])["state"] == "running"  # the first is untouched
    first.kill()  # its connection, and with it the lock, goes with the process
    second.start(wait=False)
    assert second.proc is not None and second.proc.wait(30) == 1
    assert (f"error: job {job['id']} (job) is running from another data dir: "
            f"{first.data_dir / 'jobs'} holds its files") in second.log()
    first.start()  # its own data dir: the job is its again
    assert first.job(job["id"])["state"] == "running"
    assert first.job(job["id"])["attempt"] == 1


def _on_database(url: str, sql: str) -> Any:
    """One statement on a connection of the test's own; its first column's value."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            value = conn.scalar(text(sql))
            conn.commit()
            return value
    finally:
        engine.dispose()


LOCK_HOLDER = ("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND "
               f"objid::bigint = {DAEMON_LOCK_KEY & 0xFFFFFFFF}")


def _terminate_lock_holder(url: str) -> int:
    """What an admin (or a dropped connection) does to the daemon's lock: its session
    ends; the pid of that session."""
    pid = _on_database(url, LOCK_HOLDER)
    assert pid is not None, "no session holds the daemon's lock"
    assert _on_database(url, f"SELECT pg_terminate_backend({int(pid)})")
    return int(pid)


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
def test_a_dropped_lock_session_is_taken_again(make_daemon) -> None:
    """`pg_terminate_backend` on the lock's session: the next tick takes the lock again
    on a new connection, and the daemon goes on supervising."""
    daemon: Daemon = make_daemon()
    url = daemon.env["JOBSUP_DATABASE_URL"]
    ended = _terminate_lock_holder(url)
    wait_for(lambda: "took it again" in daemon.log(), 10, what="the lock taken again")
    assert "terminating connection due to administrator command" in daemon.log()
    holder = wait_for(lambda: _on_database(url, LOCK_HOLDER), 5, what="the lock held")
    assert holder != ended
    job = daemon.submit(python_job("print('after')"))
    assert daemon.wait_state(job["id"], "succeeded", "failed", "lost")["state"] == "succeeded"
    assert daemon.proc is not None and daemon.proc.poll() is None
    assert daemon.http.get("/healthz").status_code == 200


@pytest.mark.parametrize("database_kind", ["postgresql"], indirect=True)
def test_a_daemon_whose_lock_another_took_stops(make_daemon) -> None:
    """The first daemon frozen (SIGSTOP: a paused VM, a partition) while its lock's
    session is ended and a second daemon starts on the database: thawed, the first finds
    the lock taken, runs no tick and exits 1 saying why; the second goes on."""
    first: Daemon = make_daemon()
    url = first.env["JOBSUP_DATABASE_URL"]
    assert first.proc is not None
    os.kill(first.proc.pid, signal.SIGSTOP)
    try:
        _terminate_lock_holder(url)
        second: Daemon = make_daemon(env={"JOBSUP_DATABASE_URL": url})
    finally:
        os.kill(first.proc.pid, signal.SIGCONT)
    assert first.proc.wait(20) == 1
    shown = url.split("@")[-1]
    assert (f"error: another jobsup daemon took the database postgresql+psycopg://postgres@"
            f"{shown} while this daemon's lock on it was lost (its connection ended: "
            "terminating connection due to administrator command)") in first.log()
    assert "Traceback" not in first.log()
    job = second.submit(python_job("print('second')"))
    assert second.wait_state(job["id"], "succeeded", "failed", "lost")["state"] == "succeeded"


CLEANS_UP = ("import pathlib, signal, sys, time\n"
             "def term(*_):\n"
             "    time.sleep(3)\n"
             "    pathlib.Path(sys.argv[1]).write_text('cleaned')\n"
             "    sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, term)\n"
             "print('ready', flush=True)\n"
             "while True: time.sleep(0.1)\n")


def test_a_stop_recorded_before_a_crash_gets_its_whole_grace(make_daemon,
                                                             tmp_path: Path) -> None:
    """Issue #30, item 8: the daemon recorded a stop a minute ago and died before it sent
    the SIGTERM. The restarted daemon sends it and gives the job its whole grace (8 s)
    for its 3 s of cleanup; it used to SIGKILL it a tick after the SIGTERM, the grace
    counted from the request."""
    daemon: Daemon = make_daemon()
    cleaned = tmp_path / "cleaned"
    job = daemon.submit(python_job(CLEANS_UP) + [str(cleaned)], name="cleaner",
                        stop_grace_s=8)
    wait_for(lambda: "ready" in daemon.logs(job["id"]), 15, what="the job's handler set")
    daemon.kill()
    url = daemon.env.get("JOBSUP_DATABASE_URL") or f"sqlite:///{daemon.data_dir / 'jobsup.db'}"
    engine = make_engine(url)
    with engine.begin() as conn:  # the stop, as the dead daemon recorded it
        conn.execute(text("UPDATE jobs SET stop_requested_at = :t WHERE id = :id"),
                     {"t": time.time() - 60, "id": job["id"]})
    engine.dispose()
    daemon.start()
    done = daemon.wait_state(job["id"], "stopped", "failed", "lost", timeout=20)
    assert (done["state"], done["exit_code"], done["signal"]) == ("stopped", 0, None), done
    assert cleaned.read_text() == "cleaned"
    assert "after stop; SIGKILL" not in daemon.log()
