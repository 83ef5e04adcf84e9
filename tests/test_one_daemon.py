"""One daemon per database, whatever the data dirs and whatever happens to the lock
files (issue #30, item 7). Two data dirs given one SQLite file through
`JOBSUP_DATABASE_URL` both ran (a finished job was relaunched: it ran twice), and
deleting `daemon.lock` let a second daemon start on the same data dir. The PostgreSQL
lock's tests are in `test_daemon_restart.py`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.helpers import Daemon, python_job, wait_for


def serve(data_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A second `jobsup serve` that is expected to refuse: its exit and output."""
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "serve", "--port", "0", "--data-dir",
         str(data_dir)], capture_output=True, text=True, timeout=60, env=env)


def test_two_data_dirs_on_one_sqlite_file_are_refused(make_daemon: Callable[..., Daemon],
                                                      tmp_path: Path) -> None:
    database = tmp_path / "shared" / "jobs.db"
    database.parent.mkdir()
    first = make_daemon(env={"JOBSUP_DATABASE_URL": f"sqlite:///{database}"},
                        data_dir=tmp_path / "one")
    (tmp_path / "link").symlink_to(database.parent)  # the same file by another path
    result = serve(tmp_path / "two", {**first.env,
                                      "JOBSUP_DATABASE_URL": f"sqlite:///{tmp_path}/link/jobs.db"})
    assert result.returncode == 1, result.stderr
    assert (f"error: another jobsup daemon (pid {first.proc.pid}) owns the database "
            f"{database}") in result.stderr
    assert "hint:" in result.stderr and "Traceback" not in result.stderr
    assert first.http.get("/healthz").status_code == 200


def test_a_deleted_daemon_lock_is_taken_again(make_daemon: Callable[..., Daemon]) -> None:
    """`rm daemon.lock` under a running daemon: its next tick locks a new one, and a
    second daemon on the data dir is refused as before."""
    first = make_daemon()
    lock = first.data_dir / "daemon.lock"
    lock.unlink()
    wait_for(lambda: lock.exists() and lock.read_text().strip() == str(first.proc.pid), 10,
             what="the lock file made again by the daemon")
    assert "daemon.lock was deleted while this daemon held it" in first.log()
    result = serve(first.data_dir, first.env)
    assert result.returncode == 1, result.stderr
    assert f"error: another jobsup daemon (pid {first.proc.pid}) owns" in result.stderr


def test_a_daemon_whose_deleted_lock_another_took_stops(make_daemon: Callable[..., Daemon],
                                                        ) -> None:
    """Both lock files deleted while the first daemon is frozen (SIGSTOP), and a second
    daemon starts on the data dir: thawed, the first sees its lock files are not the
    ones it holds, runs no tick and exits 1 saying why; the second goes on."""
    first = make_daemon()
    assert first.proc is not None
    os.kill(first.proc.pid, signal.SIGSTOP)
    try:
        (first.data_dir / "daemon.lock").unlink()
        (first.data_dir / "jobsup.db.lock").unlink()
        second = Daemon(first.data_dir, first.env).start()
    finally:
        os.kill(first.proc.pid, signal.SIGCONT)
    try:
        assert first.proc.wait(20) == 1
        assert "daemon.lock was replaced and another jobsup daemon (pid" in first.log()
        assert "Traceback" not in first.log()
        job = second.submit(python_job("print('second')"))
        assert second.wait_state(job["id"], "succeeded", "failed", "lost")["state"] == "succeeded"
    finally:
        second.shut_down()


def _job_left_running(make_daemon: Callable[..., Daemon], tmp_path: Path,
                      url: dict[str, str]) -> tuple[Daemon, dict[str, Any], Path, Path]:
    """A daemon on data dir `one` whose job (it appends a line to `runs.txt`, then waits
    for the file `go`) runs on after the daemon was killed (SIGKILL)."""
    runs, flag = tmp_path / "runs.txt", tmp_path / "go"
    first = make_daemon(env=url, data_dir=tmp_path / "one")
    job = first.submit([*python_job(
        "import pathlib, sys, time\n"
        "with open(sys.argv[1], 'a') as f: f.write('ran\\n')\n"
        "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.05)\n"),
        str(runs), str(flag)], name="once")
    wait_for(lambda: first.job(job["id"])["pid"], 15, what="the worker started")
    first.kill()  # SIGKILL: the job runs on under its shim
    return first, job, runs, flag


def _shared_database(tmp_path: Path) -> dict[str, str]:
    database = tmp_path / "shared" / "jobs.db"
    database.parent.mkdir()
    return {"JOBSUP_DATABASE_URL": f"sqlite:///{database}"}


def test_a_daemon_on_another_data_dir_does_not_run_a_running_job_again(
        make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """One database, one daemon at a time, but the second on another data dir: the first
    killed while its job runs, a daemon started on the same database with another data
    dir. The job's shim, log and exit record are in the first data dir; the second sees
    none of them. It judged the job's launch cut short and ran it again (twice, for a job
    that had done its work); now it refuses to start, naming the job and the data dir it
    needs. A daemon on the first data dir, by another path to it, takes the job back;
    once the job has ended, the other data dir's daemon starts and shows it."""
    url = _shared_database(tmp_path)
    first, job, runs, flag = _job_left_running(make_daemon, tmp_path, url)
    result = serve(tmp_path / "two", {**first.env, **url})
    assert result.returncode == 1, result.stderr
    assert (f"error: job {job['id']} (once) is running from another data dir: "
            f"{tmp_path / 'one' / 'jobs'} holds its files, not {tmp_path / 'two' / 'jobs'}"
            ) in result.stderr, result.stderr
    assert "hint:" in result.stderr and "--abandon-jobs-elsewhere" in result.stderr
    assert "Traceback" not in result.stderr
    (tmp_path / "link").symlink_to(tmp_path / "one")
    again = make_daemon(env=url, data_dir=tmp_path / "link")  # the same dir: its id
    assert again.job(job["id"])["state"] == "running"
    flag.touch()
    assert again.wait_state(job["id"], "succeeded", "failed", "lost")["state"] == "succeeded"
    assert runs.read_text() == "ran\n"
    again.stop()
    other = make_daemon(env=url, data_dir=tmp_path / "two")
    assert other.job(job["id"])["state"] == "succeeded"
    assert runs.read_text() == "ran\n"


def test_abandon_jobs_elsewhere_records_them_lost_and_starts(
        make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """The first data dir gone for good: `--abandon-jobs-elsewhere` (here through its
    environment variable) records its running job lost, leaves its processes alone, and
    the daemon starts and runs new jobs."""
    url = _shared_database(tmp_path)
    _, job, runs, flag = _job_left_running(make_daemon, tmp_path, url)
    other = make_daemon(env={**url, "JOBSUP_ABANDON_JOBS_ELSEWHERE": "1"},
                        data_dir=tmp_path / "two")
    lost = other.job(job["id"])
    assert (lost["state"], lost["exit_reason"]) == ("lost", "lost")
    assert lost["reason"].startswith(
        f"launched from another data dir ({tmp_path / 'one' / 'jobs'}); abandoned at start")
    assert "recorded lost (--abandon-jobs-elsewhere)" in other.log()
    flag.touch()
    after = other.submit(python_job("print('here')"))
    assert other.wait_state(after["id"], "succeeded", "failed", "lost")["state"] == "succeeded"
    assert runs.read_text() == "ran\n" and other.job(job["id"])["state"] == "lost"


def test_a_new_data_dir_at_the_old_path_is_another_data_dir(
        make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """The same path is not the same data dir: a fresh one made where the first was (as
    on another host with the same home directory, sharing a PostgreSQL database) holds
    none of the running job's files and is refused; the first, moved back, is not."""
    url = _shared_database(tmp_path)
    first, job, runs, flag = _job_left_running(make_daemon, tmp_path, url)
    (tmp_path / "one").rename(tmp_path / "one-away")
    result = serve(tmp_path / "one", {**first.env, **url})
    assert result.returncode == 1, result.stderr
    assert (f"error: job {job['id']} (once) is running from another data dir: one at the "
            f"same path, {tmp_path / 'one' / 'jobs'}, on another host or since replaced, "
            "holds its files, not this one") in result.stderr, result.stderr
    shutil.rmtree(tmp_path / "one")
    (tmp_path / "one-away").rename(tmp_path / "one")
    again = make_daemon(env=url, data_dir=tmp_path / "one")
    flag.touch()
    assert again.wait_state(job["id"], "succeeded", "failed", "lost")["state"] == "succeeded"
    assert runs.read_text() == "ran\n"


def test_the_data_dir_id_is_made_once_and_kept(tmp_path: Path) -> None:
    from supervisor.runtime.files import DATA_DIR_ID, data_dir_id

    made = data_dir_id(tmp_path)
    assert made is not None and len(made) == 32 and data_dir_id(tmp_path) == made
    assert json.loads((tmp_path / DATA_DIR_ID).read_text()) == {"id": made}
    (tmp_path / "moved").mkdir()
    (tmp_path / DATA_DIR_ID).rename(tmp_path / "moved" / DATA_DIR_ID)
    assert data_dir_id(tmp_path / "moved") == made  # it moves with the directory
    (tmp_path / DATA_DIR_ID).write_text("[1, 2]")  # foreign: replaced by a new id
    assert data_dir_id(tmp_path) not in (None, made)
    assert data_dir_id(tmp_path / "missing") is None  # cannot be made: none, no error
