"""The core daemon with real processes: exits, signals, stops, logs, restarts, deps; its
API and store on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime
from pathlib import Path

import psutil
import pytest

from tests.helpers import Daemon, job_module, python_job, wait_for

pytestmark = pytest.mark.both_databases


def ts(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


@pytest.mark.slow
def test_job_that_succeeds_records_its_lifecycle(daemon: Daemon, tmp_path: Path) -> None:
    job = daemon.submit(python_job("print('hello from the job')"), name="ok")
    assert job["state"] == "pending" and job["attempt"] == 0
    done = daemon.wait_state(job["id"], "succeeded")
    assert done["exit_code"] == 0 and done["signal"] is None
    assert done["exit_reason"] == "exit"
    assert done["pid"] > 0 and done["attempt"] == 1 and done["restarts"] == 0
    assert ts(done["created_at"]) <= ts(done["started_at"]) <= ts(done["ended_at"])
    steps = [(e["from_state"], e["to_state"]) for e in daemon.events(job["id"])]
    assert steps == [(None, "pending"), ("pending", "running"), ("running", "succeeded")]
    assert "hello from the job" in daemon.logs(job["id"])


@pytest.mark.slow
def test_job_environment(daemon: Daemon) -> None:
    code = ("import os, sys; print(os.environ['JOBSUP_JOB_ID'], os.environ['PYTHONUNBUFFERED'],"
            " os.environ['JOBSUP_PROGRESS_FILE'], os.environ['MY_VAR'],"
            " os.environ.get('JOBSUP_TOKEN'), os.getcwd(), os.getpgrp() == os.getpid())")
    job = daemon.submit(python_job(code), env={"MY_VAR": "42"}, cwd="/tmp")
    daemon.wait_state(job["id"], "succeeded")
    job_id, unbuffered, progress, my_var, token, cwd, own_group = daemon.logs(job["id"]).split()
    assert job_id == job["id"] and unbuffered == "1" and my_var == "42" and token == "None"
    assert progress == str(daemon.data_dir / "jobs" / job["id"] / "progress.json")
    assert cwd == "/tmp" and own_group == "True"


@pytest.mark.slow
def test_exit_code_3_is_failed(daemon: Daemon) -> None:
    job = daemon.submit(python_job("import sys; sys.exit(3)"), name="three")
    done = daemon.wait_state(job["id"], "failed")
    assert (done["exit_code"], done["signal"], done["exit_reason"]) == (3, None, "exit")
    assert done["reason"] == "exited with code 3"


def test_sigkilled_job_is_failed_with_signal_9(daemon: Daemon) -> None:
    job = daemon.submit(["sh", "-c", "kill -9 $$"], name="killed")
    done = daemon.wait_state(job["id"], "failed")
    assert (done["exit_code"], done["signal"], done["exit_reason"]) == (None, 9, "signal")
    assert "SIGKILL" in done["reason"]


@pytest.mark.slow
def test_exit_is_noticed_within_a_second_even_with_a_slow_tick(make_daemon) -> None:
    daemon = make_daemon(env={"JOBSUP_SAMPLE_INTERVAL": "30"})
    job = daemon.submit(python_job("import time; time.sleep(1.0)"))
    daemon.wait_state(job["id"], "running", timeout=35)  # a submit wakes the engine
    started = daemon.job(job["id"])
    # a wait, not the bound: it covers the worker's Python start on a busy machine; a
    # missed exit would wait for the 30 s tick and fail the bound below
    done = daemon.wait_state(job["id"], "succeeded", timeout=20)
    noticed = time.time()
    worker_exit = ts(done["ended_at"])
    assert noticed - worker_exit < 1.0, (noticed - worker_exit, started)


@pytest.mark.slow
def test_stop_kills_a_tree_that_ignores_sigterm(daemon: Daemon, tmp_path: Path) -> None:
    pids_file = tmp_path / "pids"
    job = daemon.submit(job_module("stubborn_tree", pids_file), name="stubborn",
                        stop_grace_s=1.5)
    wait_for(lambda: pids_file.exists() and len(pids_file.read_text().split()) == 2, 10,
             what="job and child pids")
    pids = [int(p) for p in pids_file.read_text().split()]
    procs = [psutil.Process(p) for p in pids]
    t0 = time.monotonic()
    assert daemon.http.post(f"/api/v1/jobs/{job['id']}/stop").status_code == 202
    done = daemon.wait_state(job["id"], "stopped", timeout=15)
    elapsed = time.monotonic() - t0
    assert elapsed >= 1.4, "SIGKILL came before the grace"
    assert done["exit_reason"] == "stopped" and done["signal"] == 9
    assert "SIGKILL after the grace" in done["reason"]
    for proc in procs:
        assert not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE


def test_stop_of_a_cooperative_job_uses_sigterm(daemon: Daemon) -> None:
    job = daemon.submit(python_job("import time; print('up'); time.sleep(600)"), stop_grace_s=30)
    wait_for(lambda: "up" in daemon.logs(job["id"]), 10, what="job output")
    t0 = time.monotonic()
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")
    done = daemon.wait_state(job["id"], "stopped", timeout=10)
    assert time.monotonic() - t0 < 5
    assert done["signal"] == signal.SIGTERM and done["reason"] == "stopped on request (SIGTERM)"


def test_leftover_background_processes_die_with_the_job(daemon: Daemon, tmp_path: Path) -> None:
    pid_file = tmp_path / "bg.pid"
    job = daemon.submit(["sh", "-c", f"sleep 600 & echo $! > {pid_file}; exit 0"])
    daemon.wait_state(job["id"], "succeeded")
    bg = int(pid_file.read_text())
    wait_for(lambda: not psutil.pid_exists(bg) or psutil.Process(bg).status() == "zombie", 5,
             what="background child gone")


def test_unflushed_print_shows_in_logs_within_2_s(daemon: Daemon, tmp_path: Path) -> None:
    # the clock starts when the job is about to print, not as its Python starts
    printing = tmp_path / "printing"
    job = daemon.submit(python_job(f"import time; open({str(printing)!r}, 'w').close(); "
                                   "print('first line, no flush'); time.sleep(60)"))
    wait_for(printing.exists, 20, what="the job about to print")
    t0 = time.monotonic()
    wait_for(lambda: "first line, no flush" in daemon.logs(job["id"]), 2.0, what="log line")
    assert time.monotonic() - t0 < 2.0
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")


def test_logs_tail(daemon: Daemon) -> None:
    job = daemon.submit(python_job("for i in range(500): print('line', i)"))
    daemon.wait_state(job["id"], "succeeded")
    assert daemon.logs(job["id"], tail=3) == "line 497\nline 498\nline 499\n"
    bad = daemon.http.get(f"/api/v1/jobs/{job['id']}/logs", params={"tail": "ten"})
    assert bad.status_code == 422 and "tail" in bad.json()["error"]


@pytest.mark.slow
def test_restart_on_failure_with_exponential_backoff(make_daemon) -> None:
    daemon = make_daemon(env={"JOBSUP_RESTART_BACKOFF_S": "0.5"})
    job = daemon.submit(python_job("import sys; sys.exit(7)"), name="flaky",
                        restart_policy="on-failure", max_restarts=3)
    done = daemon.wait_state(job["id"], "failed", timeout=30)
    assert done["restarts"] == 3 and done["attempt"] == 4 and done["exit_code"] == 7
    # from each exit (the `pending` event, at the shim's exit time) to the next launch:
    # the backoff, without the run time (a Python start, long on a busy machine)
    events = daemon.events(job["id"])
    gaps = [ts(b["t"]) - ts(a["t"]) for a, b in zip(events, events[1:], strict=False)
            if a["to_state"] == "pending" and b["to_state"] == "running"
            and a["from_state"] == "running"]
    assert len(gaps) == 3, events
    # backoff 0.5, 1, 2 s; each gap at least its delay
    for gap, delay in zip(gaps, (0.5, 1.0, 2.0), strict=True):
        assert gap >= delay, gaps
    assert gaps[0] < 2.0, gaps  # the first backoff is not the last one's (2 s)
    reasons = [e["reason"] for e in daemon.events(job["id"]) if e["to_state"] == "pending"]
    assert reasons[1:] == [f"exited with code 7; restart {i}/3 in {d} s"
                           for i, d in ((1, "0.5"), (2, "1.0"), (3, "2.0"))]


@pytest.mark.slow
def test_restart_until_success(make_daemon, tmp_path: Path) -> None:
    daemon = make_daemon(env={"JOBSUP_RESTART_BACKOFF_S": "0.1"})
    counter = tmp_path / "count"
    code = (f"import pathlib, sys; p = pathlib.Path({str(counter)!r}); "
            "n = int(p.read_text()) if p.exists() else 0; p.write_text(str(n + 1)); "
            "sys.exit(0 if n >= 1 else 1)")
    job = daemon.submit(python_job(code), restart_policy="on-failure", max_restarts=5)
    done = daemon.wait_state(job["id"], "succeeded", timeout=20)
    assert done["restarts"] == 1 and counter.read_text() == "2"
    # one log per attempt
    assert sorted(p.parent.name for p in (daemon.data_dir / "jobs" / job["id"]).glob(
        "attempt-*/output.log")) == ["attempt-1", "attempt-2"]


@pytest.mark.slow
def test_dependency_chain_runs_in_order(daemon: Daemon) -> None:
    a = daemon.submit(python_job("import time; time.sleep(1)"), name="a")
    b = daemon.submit(python_job("import time; time.sleep(0.5)"), name="b", depends_on=[a["id"]])
    c = daemon.submit(python_job("pass"), name="c", depends_on=[b["id"]])
    time.sleep(0.5)
    assert daemon.job(c["id"])["state"] == "pending"
    done_c = daemon.wait_state(c["id"], "succeeded", timeout=20)
    done_a, done_b = daemon.job(a["id"]), daemon.job(b["id"])
    assert ts(done_a["ended_at"]) <= ts(done_b["started_at"])
    assert ts(done_b["ended_at"]) <= ts(done_c["started_at"])


@pytest.mark.slow
def test_failed_dependency_fails_the_dependents(daemon: Daemon) -> None:
    a = daemon.submit(python_job("import sys; sys.exit(2)"), name="extract")
    b = daemon.submit(python_job("pass"), name="train", depends_on=[a["id"]])
    c = daemon.submit(python_job("pass"), name="eval", depends_on=[b["id"]])
    done_c = daemon.wait_state(c["id"], "failed", timeout=15)
    done_b = daemon.job(b["id"])
    assert done_b["state"] == "failed"
    assert done_b["reason"] == f"dependency {a['id']} (extract) failed"
    assert done_c["reason"] == f"dependency {b['id']} (train) failed"
    assert done_b["attempt"] == 0 and done_b["pid"] is None


@pytest.mark.slow
def test_stop_of_a_pending_job(daemon: Daemon) -> None:
    a = daemon.submit(python_job("import time; time.sleep(600)"), name="long")
    b = daemon.submit(python_job("pass"), depends_on=[a["id"]])
    assert daemon.http.post(f"/api/v1/jobs/{b['id']}/stop").status_code == 202
    done = daemon.wait_state(b["id"], "stopped")
    assert done["attempt"] == 0 and done["exit_reason"] == "stopped"
    again = daemon.http.post(f"/api/v1/jobs/{b['id']}/stop")
    assert again.status_code == 409 and "already ended" in again.json()["error"]
    daemon.http.post(f"/api/v1/jobs/{a['id']}/stop")


@pytest.mark.slow
def test_list_filters(daemon: Daemon) -> None:
    a = daemon.submit(python_job("pass"), labels={"step": "extract"})
    b = daemon.submit(python_job("import sys; sys.exit(1)"), labels={"step": "train"})
    daemon.wait_state(a["id"], "succeeded")
    daemon.wait_state(b["id"], "failed")
    by_state = daemon.http.get("/api/v1/jobs", params={"state": "failed"}).json()
    assert [j["id"] for j in by_state] == [b["id"]]
    by_label = daemon.http.get("/api/v1/jobs", params={"label": "step=extract"}).json()
    assert [j["id"] for j in by_label] == [a["id"]]
    assert daemon.http.get("/api/v1/jobs", params={"state": "nope"}).status_code == 422


@pytest.mark.slow
def test_job_whose_shim_and_worker_vanish_is_lost(daemon: Daemon, tmp_path: Path) -> None:
    job = daemon.submit(python_job("import time; time.sleep(600)"))
    running = daemon.wait_state(job["id"], "running")
    wait_for(lambda: daemon.job(job["id"])["pid"], 15, what="worker pid")  # its shim's start
    shim_file = daemon.data_dir / "jobs" / job["id"] / "attempt-1" / "shim.json"
    import json

    shim_pid = json.loads(shim_file.read_text())["pid"]
    os.kill(shim_pid, signal.SIGKILL)  # the job runs on without its shim
    daemon.wait_ticks(2)
    assert daemon.job(job["id"])["state"] == "running", running
    os.killpg(daemon.job(job["id"])["pid"], signal.SIGKILL)
    done = daemon.wait_state(job["id"], "lost", timeout=15)
    assert done["exit_reason"] == "lost" and "exit status unknown" in done["reason"]


@pytest.mark.slow
def test_command_is_never_run_by_a_shell(daemon: Daemon, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    job = daemon.submit(["echo", f"hi; touch {marker}"])
    daemon.wait_state(job["id"], "succeeded")
    assert daemon.logs(job["id"]) == f"hi; touch {marker}\n"
    assert not marker.exists()


@pytest.mark.slow
def test_spawn_failure_after_submit_is_reported(daemon: Daemon, tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\necho ran\n")
    script.chmod(0o755)
    a = daemon.submit(python_job("import time; time.sleep(1)"))
    b = daemon.submit([str(script)], depends_on=[a["id"]])
    script.unlink()  # gone by the time the job starts
    done = daemon.wait_state(b["id"], "failed", timeout=15)
    assert done["exit_code"] == 127 and "cannot start" in done["reason"]


def test_daemon_secrets_never_reach_a_job() -> None:
    from supervisor.backends.launch import SCRUBBED_ENV, job_environment
    from supervisor.spec import JobSpec

    base = ({name: "secret" for name in SCRUBBED_ENV}
            | {name.lower(): "secret" for name in SCRUBBED_ENV} | {"HOME": "/root"})
    env = job_environment(base, JobSpec(name="x", command=["true"]), "j1", 1, Path("/p"))
    assert "secret" not in env.values() and env["HOME"] == "/root"
    assert {"JOBSUP_TOKEN", "JOBSUP_SLACK_WEBHOOK_URL", "JOBSUP_DATABASE_URL"} <= set(
        SCRUBBED_ENV)
