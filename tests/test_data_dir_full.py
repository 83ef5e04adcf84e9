"""The disk under the data dir fills up while jobs end: every exit is still recorded
(the shim reserved its status file at launch and overwrites it in place), nothing that
ended normally is called `lost`, no temp file is left behind, and submits during the
outage answer 503 with a hint, never a bare 500."""

from __future__ import annotations

import errno
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import (
    Daemon,
    Receiver,
    exit_recorded,
    job_module,
    python_job,
    tmpfs,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "disk", "16m") as disk:
        yield disk


def fill(path: Path) -> None:
    """Write `path` until the filesystem has no byte left."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc


@pytest.mark.timeout(120)
def test_jobs_ending_on_a_full_data_dir_keep_their_exit(small_disk: Path, make_daemon,
                                                         tmp_path: Path) -> None:
    daemon: Daemon = make_daemon(data_dir=small_disk / "data", log_dir=tmp_path,
                                 env={"JOBSUP_NOTIFY_ON_SUCCESS": "false"})
    flag = tmp_path / "go"  # outside the full disk
    ok = daemon.submit(job_module("waits_for_file", flag, 0), name="ok")
    bad = daemon.submit(job_module("waits_for_file", flag, 3), name="bad")
    for job in (ok, bad):
        wait_for(lambda j=job: daemon.job(j["id"])["pid"], 15, what="worker started")

    ballast = small_disk / "ballast"
    fill(ballast)
    daemon.wait_ticks(3)  # ticks on a full disk: samples can no longer be written
    flag.touch()  # both jobs end while not one byte is free
    for job in (ok, bad):
        status = daemon.data_dir / "jobs" / job["id"] / "attempt-1" / "status.json"
        wait_for(lambda s=status: exit_recorded(s), 10, what="the exit recorded on a full disk")

    answers = [daemon.http.post("/api/v1/jobs", json={"name": f"during-{i}",
                                                      "command": python_job("pass")})
               for i in range(5)]
    assert all(a.status_code in (201, 503) for a in answers), [a.text for a in answers]
    refused = [a for a in answers if a.status_code == 503]
    for answer in refused:
        body = answer.json()
        assert " full" in body["error"] and "free space" in body["hint"], body
        assert answer.headers["retry-after"]
    assert refused, "no submit met the full database"

    ballast.unlink()  # space comes back
    done_ok = daemon.wait_state(ok["id"], "succeeded", "failed", "lost", timeout=20)
    done_bad = daemon.wait_state(bad["id"], "succeeded", "failed", "lost", timeout=20)
    assert (done_ok["state"], done_ok["exit_code"]) == ("succeeded", 0), done_ok
    assert (done_bad["state"], done_bad["exit_code"]) == ("failed", 3), done_bad
    alerts = daemon.http.get("/api/v1/alerts").json()
    # no false `crashed` (a `disk_low` for the data dir, its logs' disk, is true)
    assert not any(a["job_id"] == ok["id"] and a["rule"] == "crashed" for a in alerts), alerts
    leftovers = [p for p in (daemon.data_dir / "jobs").rglob("*") if p.name.endswith(".tmp")]
    assert not leftovers, leftovers
    for job in (ok, bad):
        status = json.loads((daemon.data_dir / "jobs" / job["id"] / "attempt-1"
                             / "status.json").read_bytes())
        assert status["ended_at"] and "reserved" not in status
    # and the daemon takes jobs again
    after = daemon.submit(python_job("pass"), name="after")
    daemon.wait_state(after["id"], "succeeded", timeout=15)


@pytest.mark.timeout(60)
def test_a_shim_that_cannot_reserve_its_status_file_is_launched_again(
        make_daemon, tmp_path: Path) -> None:
    """The shim exits before claiming the launch when it cannot reserve `status.json`
    (a full disk; here a directory in its way): the daemon claims the attempt and
    launches the job again instead of calling it lost."""
    daemon: Daemon = make_daemon()
    flag = tmp_path / "go"
    gate = daemon.submit(job_module("waits_for_file", flag, 0), name="gate")
    job = daemon.submit(python_job("print('ran')"), name="after-gate", depends_on=[gate["id"]])
    (daemon.data_dir / "jobs" / job["id"] / "attempt-1" / "status.json").mkdir(parents=True)
    flag.touch()
    done = daemon.wait_state(job["id"], "succeeded", "lost", "failed", timeout=20)
    assert done["state"] == "succeeded" and done["attempt"] == 2, done
    reasons = [e["reason"] or "" for e in daemon.events(job["id"])]
    assert any("its shim exited before starting the job" in r for r in reasons), reasons
    shim_log = daemon.data_dir / "jobs" / job["id"] / "attempt-1" / "shim.log"
    assert "cannot reserve status.json" in shim_log.read_text()


@pytest.mark.timeout(120)
def test_an_exit_on_a_full_data_dir_is_shown_and_alerted_at_once(
        small_disk: Path, make_daemon, tmp_path: Path, receiver: Receiver) -> None:
    """The database cannot record the end of a job that fails while its disk is full:
    the API shows the job `failed` and its `crashed` alert goes out from memory at once,
    `/healthz` says degraded; once space returns the end and the alert are recorded
    (the alert not sent twice), and the daemon logged the outage once each way (#30)."""
    daemon: Daemon = make_daemon(data_dir=small_disk / "data", log_dir=tmp_path,
                                 env={"JOBSUP_NOTIFY_ON_SUCCESS": "false",
                                      "JOBSUP_SLACK_WEBHOOK_URL": receiver.url})
    flag = tmp_path / "go"  # outside the full disk
    job = daemon.submit(job_module("waits_for_file", flag, 3), name="bad")["id"]
    wait_for(lambda: daemon.job(job)["pid"], 15, what="worker started")

    ballast = small_disk / "ballast"
    fill(ballast)
    wait_for(lambda: daemon.http.get("/healthz").json()["status"] == "degraded", 10,
             what="/healthz degraded on the full disk")
    flag.touch()
    status = daemon.data_dir / "jobs" / job / "attempt-1" / "status.json"
    wait_for(lambda: exit_recorded(status), 10, what="the exit recorded on a full disk")
    exited_at = time.monotonic()
    shown = wait_for(lambda: (j := daemon.job(job))["state"] == "failed" and j, 15,
                     what="the exit shown while the disk is full")
    shown_after_s = time.monotonic() - exited_at
    assert shown["exit_code"] == 3 and "not recorded yet" in shown["reason"], shown
    metrics = daemon.http.get("/metrics").text  # Prometheus sees the end too
    assert f'jobsup_job_state{{job_id="{job}",job_name="bad",state="failed"}} 1.0' in metrics
    assert [j["id"] for j in daemon.http.get("/api/v1/jobs",
                                              params={"state": "failed"}).json()] == [job]
    wait_for(lambda: any("crashed" in t for t in receiver.texts()), 15,
             what="the crashed alert sent while the disk is full")
    alerted_after_s = time.monotonic() - exited_at
    daemon.wait_ticks(3)  # ticks go on with the disk full
    assert daemon.http.get("/healthz").json()["status"] == "degraded"
    alerts = daemon.http.get("/api/v1/alerts").json()  # nothing more could be recorded
    assert not [a for a in alerts if a["rule"] == "crashed"], alerts

    ballast.unlink()  # space comes back
    wait_for(lambda: daemon.http.get("/healthz").json()["status"] == "ok", 15,
             what="/healthz ok once space returns")
    recorded = wait_for(lambda: (j := daemon.job(job))["state"] == "failed"
                        and "not recorded" not in (j["reason"] or "") and j, 15,
                        what="the end recorded")
    assert recorded["exit_code"] == 3
    assert [e["to_state"] for e in daemon.events(job)][-1] == "failed"
    crashed = wait_for(lambda: [a for a in daemon.http.get("/api/v1/alerts").json()
                                if a["rule"] == "crashed"], 15,
                       what="the crashed alert recorded")
    assert [a["job_id"] for a in crashed] == [job]
    daemon.wait_ticks(3)  # a second message would have gone by now
    assert sum("crashed" in t for t in receiver.texts()) == 1, receiver.texts()
    log = daemon.log()
    assert log.count("the database cannot be written: ") == 1, log[-3000:]
    # (the tick's line; the notifier says its own once if a message's outcome waited)
    assert log.count("the database is writable again (it was not") == 1, log[-3000:]
    print(f"shown {shown_after_s:.2f} s and alerted {alerted_after_s:.2f} s after the exit")
