"""The disk under the data dir fills up while jobs end: every exit is still recorded
(the shim reserved its status file at launch and overwrites it in place), nothing that
ended normally is called `lost`, no temp file is left behind, and submits during the
outage answer 503 with a hint, never a bare 500."""

from __future__ import annotations

import errno
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import Daemon, exit_recorded, job_module, python_job, tmpfs, wait_for

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
    assert not any(a["job_id"] == ok["id"] for a in alerts), alerts  # no false `crashed`
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
