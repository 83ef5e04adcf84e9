"""One daemon per database, whatever the data dirs and whatever happens to the lock
files (issue #30, item 7). Two data dirs given one SQLite file through
`JOBSUP_DATABASE_URL` both ran (a finished job was relaunched: it ran twice), and
deleting `daemon.lock` let a second daemon start on the same data dir. The PostgreSQL
lock's tests are in `test_daemon_restart.py`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

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


def test_a_daemon_on_another_data_dir_does_not_run_a_running_job_again(
        make_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    """One database, one daemon at a time, but the second on another data dir: the first
    killed while its job runs, a daemon started on the same database with another data
    dir. The job's shim, log and exit record are in the first data dir; the second sees
    none of them. It judged the job's launch cut short and ran it again (twice, for a job
    that had done its work); now it refuses to start, naming the job and the data dir it
    needs, and a daemon on the first data dir takes the job back."""
    database = tmp_path / "shared" / "jobs.db"
    database.parent.mkdir()
    url = {"JOBSUP_DATABASE_URL": f"sqlite:///{database}"}
    runs, flag = tmp_path / "runs.txt", tmp_path / "go"
    first = make_daemon(env=url, data_dir=tmp_path / "one")
    job = first.submit([*python_job(
        "import pathlib, sys, time\n"
        "with open(sys.argv[1], 'a') as f: f.write('ran\\n')\n"
        "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.05)\n"),
        str(runs), str(flag)], name="once")
    wait_for(lambda: first.job(job["id"])["pid"], 15, what="the worker started")
    first.kill()  # SIGKILL: the job runs on under its shim

    result = serve(tmp_path / "two", {**first.env, **url})
    assert result.returncode == 1, result.stderr
    assert (f"error: job {job['id']} (once) is running from another data dir: "
            f"{tmp_path / 'one' / 'jobs'} holds its files, not {tmp_path / 'two' / 'jobs'}"
            ) in result.stderr, result.stderr
    assert "hint:" in result.stderr and "Traceback" not in result.stderr
    flag.touch()
    again = make_daemon(env=url, data_dir=tmp_path / "one")
    assert again.wait_state(job["id"], "succeeded", "failed", "lost")["state"] == "succeeded"
    assert runs.read_text() == "ran\n"
