"""`jobsup serve --stop-jobs-on-exit` (JOBSUP_STOP_JOBS_ON_EXIT): on SIGTERM the daemon
stops its running jobs (SIGTERM, grace, SIGKILL) and waits for them before it exits, as a
container needs; without it, jobs outlive the daemon (a restart re-adopts them)."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from tests.helpers import Daemon, job_module, python_job, wait_for

pytestmark = pytest.mark.slow

GRACE_S = 3.0

LONG_GRACE_S = 30.0
"""The grace of a job the daemon must not wait for: far beyond a daemon's own exit on a
busy machine, so an exit that waited for the job cannot pass for a slow one."""

# exits by itself 1 s after SIGTERM (a checkpoint being saved), leaving a marker
CLEAN_STOP = """
import signal, sys, time
log, ready = sys.argv[1:3]
def on_term(signum, frame):
    open(log, "a").write("term\\n")
    time.sleep(1.0)
    open(log, "a").write("saved\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(ready, "w").close()
while True:
    time.sleep(0.2)
"""


def stored_state(data_dir: Path, job_id: str) -> tuple[str, str | None]:
    """The job's state and reason as the database holds them (the daemon is gone)."""
    with sqlite3.connect(data_dir / "jobsup.db") as db:
        row = db.execute("SELECT state, reason FROM jobs WHERE id = ?", (job_id,)).fetchone()
    return row[0], row[1]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_stops_jobs_and_waits_for_them(make_daemon, tmp_path: Path) -> None:
    daemon: Daemon = make_daemon({"JOBSUP_STOP_JOBS_ON_EXIT": "1"})
    clean_log, clean_ready = tmp_path / "clean.log", tmp_path / "clean.ready"
    stubborn_log, stubborn_ready = tmp_path / "stubborn.log", tmp_path / "stubborn.ready"
    clean = daemon.submit(python_job(CLEAN_STOP) + [str(clean_log), str(clean_ready)],
                          name="clean", stop_grace_s=GRACE_S)
    # records SIGTERM and keeps running: SIGKILL after its grace
    stubborn = daemon.submit(job_module("signal_recorder", stubborn_log, stubborn_ready),
                             name="stubborn", stop_grace_s=GRACE_S)
    wait_for(lambda: clean_ready.exists() and stubborn_ready.exists(), 15,
             what="both jobs ready")

    def recorded_pids() -> list[int] | None:
        found = [daemon.job(j["id"])["pid"] for j in (clean, stubborn)]
        return found if all(found) else None

    pids = wait_for(recorded_pids, 10, what="both pids recorded")
    # a pending job (waits on the stubborn one) must not start during the exit
    later = daemon.submit(python_job("pass"), name="later", depends_on=[stubborn["id"]])

    assert daemon.proc is not None
    t0 = time.monotonic()
    daemon.proc.terminate()
    rc = daemon.proc.wait(GRACE_S + 15)
    took_s = time.monotonic() - t0

    # uvicorn re-raises the signal it caught once it has shut down
    assert rc in (0, -15), daemon.log()
    # it waited for the jobs: the clean one's cleanup finished, the stubborn one was
    # SIGKILLed after its grace, so the exit took the grace and not much longer
    assert clean_log.read_text().splitlines() == ["term", "saved"]
    assert stubborn_log.read_text().splitlines() == ["15"]
    assert GRACE_S <= took_s < GRACE_S + 8, took_s
    assert not any(alive(pid) for pid in pids)
    for job in (clean, stubborn):  # no person stopped them: they run again (#32 item 2)
        state, reason = stored_state(daemon.data_dir, job["id"])
        assert state == "pending", (state, reason)
        assert "daemon is exiting" in (reason or "") and "runs again" in (reason or ""), reason
    assert stored_state(daemon.data_dir, later["id"])[0] == "pending"
    assert "every job stopped" in daemon.log()


def test_a_pipeline_cut_by_the_daemons_exit_completes_after_its_restart(
        make_daemon, tmp_path: Path) -> None:
    """A running, B waiting on A; the daemon (--stop-jobs-on-exit, Docker's way) is
    SIGTERMed and started again: A runs again as a new attempt and succeeds, then B, with
    no one acting (#32 item 2: A was `stopped` and B `failed — dependency stopped`). A
    person's stop still ends a job for good."""
    daemon: Daemon = make_daemon({"JOBSUP_STOP_JOBS_ON_EXIT": "1"})
    first_run = tmp_path / "first-run"
    # the first attempt waits to be stopped; the next one finishes at once
    step = python_job(f"import os, time\nif not os.path.exists({str(first_run)!r}):\n"
                      f"    open({str(first_run)!r}, 'w').close(); time.sleep(600)\n"
                      "print('done')")
    a = daemon.submit(step, name="extract", stop_grace_s=GRACE_S)
    b = daemon.submit(python_job("print('trained')"), name="train", depends_on=[a["id"]])
    user_stopped = daemon.submit(python_job("import time; time.sleep(600)"), name="by-hand")
    wait_for(first_run.exists, 15, what="A's first attempt running")
    daemon.wait_state(user_stopped["id"], "running")
    daemon.http.post(f"/api/v1/jobs/{user_stopped['id']}/stop")
    daemon.wait_state(user_stopped["id"], "stopped")
    assert daemon.proc is not None
    daemon.proc.terminate()
    assert daemon.proc.wait(GRACE_S + 15) in (0, -15), daemon.log()
    assert stored_state(daemon.data_dir, a["id"])[0] == "pending"
    assert stored_state(daemon.data_dir, b["id"])[0] == "pending"

    daemon.start()
    done = daemon.wait_state(b["id"], "succeeded", timeout=30)
    again = daemon.job(a["id"])
    assert again["state"] == "succeeded" and again["attempt"] == 2 and again["restarts"] == 0
    events = [(e["to_state"], e["reason"] or "")
              for e in daemon.http.get(f"/api/v1/jobs/{a['id']}/events").json()]
    assert any(to == "pending" and "runs again when the daemon starts" in why
               for to, why in events), events
    assert done["state"] == "succeeded"
    assert daemon.job(user_stopped["id"])["state"] == "stopped"  # a person's stop holds


def test_without_the_flag_jobs_outlive_the_daemon(make_daemon, tmp_path: Path) -> None:
    daemon: Daemon = make_daemon()
    log, ready = tmp_path / "job.log", tmp_path / "job.ready"
    job = daemon.submit(job_module("signal_recorder", log, ready), stop_grace_s=LONG_GRACE_S)
    wait_for(ready.exists, 15, what="job ready")
    pid = wait_for(lambda: daemon.job(job["id"])["pid"], 10, what="the pid recorded")

    assert daemon.proc is not None
    t0 = time.monotonic()
    daemon.proc.terminate()
    assert daemon.proc.wait(LONG_GRACE_S) in (0, -15)
    assert time.monotonic() - t0 < LONG_GRACE_S / 3  # nothing waited for
    time.sleep(0.5)
    assert alive(pid)
    assert not log.exists()  # no signal reached the job
    assert stored_state(daemon.data_dir, job["id"])[0] == "running"
    # and a restarted daemon re-adopts it
    daemon.start()
    assert daemon.wait_state(job["id"], "running", timeout=5)["pid"] == pid


@pytest.mark.timeout(600)
def test_the_demo_pipeline_survives_a_container_restart(make_daemon, tiny_model: Path,
                                                        tmp_path: Path) -> None:
    """#32's must-show: the EAGLE-3 demo pipeline (`jobsup demo --model tiny`'s request,
    demo-sized) under a daemon with --stop-jobs-on-exit; the daemon is SIGTERMed while a
    step runs, as `docker compose restart` does, and started again: every step ends
    `succeeded`, with no one acting. Before #32 item 2 the running step ended `stopped`
    and every later one `failed` (dependency stopped)."""
    from supervisor.client.demo import DEMO_PROMPTS, pipeline_request

    daemon: Daemon = make_daemon({"JOBSUP_STOP_JOBS_ON_EXIT": "1", "OMP_NUM_THREADS": "1",
                                  "JOBSUP_SAMPLE_INTERVAL": "1"})
    request = pipeline_request("tiny", tiny_model, DEMO_PROMPTS, tmp_path / "run",
                               max_tokens=8, epochs=1)
    response = daemon.http.post("/api/v1/pipelines/eagle3",
                                json={**request, "eval_max_new_tokens": 8})
    assert response.status_code == 201, response.text
    steps = {job["spec"]["labels"]["step"]: job["id"] for job in response.json()}
    assert list(steps) == ["generate", "vocab", "train", "evaluate"]  # online features
    # the middle of the pipeline: training under way, its inputs written
    cut = daemon.wait_state(steps["train"], "running", timeout=240)
    assert daemon.job(steps["vocab"])["state"] == "succeeded"

    assert daemon.proc is not None
    daemon.proc.terminate()
    assert daemon.proc.wait(60) in (0, -15), daemon.log()
    assert stored_state(daemon.data_dir, cut["id"])[0] == "pending"

    daemon.start()
    last = daemon.wait_state(steps["evaluate"], "succeeded", "failed", "stopped", "lost",
                             timeout=420)
    jobs = {step: daemon.job(job_id) for step, job_id in steps.items()}
    assert {step: job["state"] for step, job in jobs.items()} == dict.fromkeys(
        steps, "succeeded"), [(j["name"], j["state"], j["reason"]) for j in jobs.values()]
    assert last["state"] == "succeeded"
    assert jobs["train"]["attempt"] == 2 and jobs["train"]["restarts"] == 0
    assert all(job["attempt"] == 1 for step, job in jobs.items() if step != "train")
    assert (tmp_path / "run" / "evaluate" / "eval.json").is_file()
