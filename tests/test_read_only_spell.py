"""A read-only spell under the daemon (#30, item 2): its database files made 0444 and
its data dir 0555 for a few seconds under concurrent submits, then put back.

While it lasts, `/healthz` says `degraded` and every submit answers 201 or a 503 that
says why; once the files are writable again the daemon takes writes within a tick,
without a restart: the refused submits go through, every acknowledged job runs, and
the job that ended during the spell is recorded. The log says "cannot be written" and
"writable again" once each, never "tick step failed".

As root, file modes stop nothing (CAP_DAC_OVERRIDE): the daemon runs under `setpriv`
without the capabilities that bypass them, so 0444 and 0555 refuse its writes as they
would a user's. Its connections opened before the spell keep their read-write file
descriptors; those SQLite opens during it are read-only, and stayed so.

Which connection a write goes through, and when, decided whether writes looked mended
during the spell, or broken again after the fix (the log said so twice, in CI's runs),
and a shared-memory index mapped read-only in the spell kept every connection refused
after it (/healthz not ok 5 s after the fix, on a loaded VM): the second test plays
those orders through `tests/jobs/read_only_ticks.py`, deterministically."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import PY, REPO, Daemon, job_module, python_job, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

WITHOUT_DAC_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner,"
                        "-linux_immutable", "--"]
"""The daemon (and its jobs) as root, but subject to file modes."""

SPELL_S = 6.0
SUBMITTERS = 20


def database_files(data_dir: Path) -> list[Path]:
    return [p for p in (data_dir / name for name in ("jobsup.db", "jobsup.db-wal",
                                                     "jobsup.db-shm")) if p.exists()]


def health(daemon: Daemon) -> dict[str, Any]:
    body: dict[str, Any] = daemon.http.get("/healthz").json()
    return body


def submit(url: str, name: str) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=30) as client:
        return client.post("/api/v1/jobs", json={"name": name,
                                                 "command": python_job("pass")})


def without_dac_override() -> list[str]:
    """The argv prefix that makes file modes bind this process's children."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is needed to drop CAP_DAC_OVERRIDE")
    return WITHOUT_DAC_OVERRIDE


@pytest.fixture
def daemon(tmp_path: Path) -> Any:
    started = Daemon(tmp_path / "data", {"JOBSUP_NOTIFY_ON_SUCCESS": "false"},
                     log_dir=tmp_path, wrapper=without_dac_override()).start()
    yield started
    for path in [started.data_dir, *database_files(started.data_dir)]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    started.shut_down()


def test_a_read_only_spell_is_reported_and_mended_without_a_restart(
        daemon: Daemon, tmp_path: Path) -> None:
    flag = tmp_path / "go"
    ender = daemon.submit(job_module("waits_for_file", flag, 3), name="ender")["id"]
    wait_for(lambda: daemon.job(ender)["pid"], 15, what="the worker started")
    assert health(daemon)["status"] == "ok"

    # the spell
    for path in database_files(daemon.data_dir):
        path.chmod(0o444)
    daemon.data_dir.chmod(0o555)
    spell_began = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(SUBMITTERS) as pool:
        answers = list(pool.map(lambda i: submit(daemon.url, f"during-{i}"),
                                range(SUBMITTERS)))
    flag.touch()  # the job ends during the spell
    for answer in answers:
        assert answer.status_code in (201, 503), answer.text
        if answer.status_code == 503:
            body = answer.json()
            assert "cannot be written" in body["error"], body
            assert "writable" in body["hint"] and answer.headers["retry-after"], body
    acknowledged = [a.json()["id"] for a in answers if a.status_code == 201]
    refused = [a for a in answers if a.status_code == 503]
    assert refused, "no submit met the read-only database"
    degraded = wait_for(lambda: (h := health(daemon))["status"] == "degraded" and h, 5,
                        what="/healthz degraded")
    assert "cannot be written" in degraded["error"], degraded
    time.sleep(max(0.0, SPELL_S - (time.monotonic() - spell_began)))
    assert health(daemon)["status"] == "degraded"

    # the fix
    daemon.data_dir.chmod(0o755)
    for path in database_files(daemon.data_dir):
        path.chmod(0o644)
    fixed_at = time.monotonic()
    wait_for(lambda: health(daemon)["status"] == "ok", 5, what="/healthz ok again")
    healthy_after_s = time.monotonic() - fixed_at
    ended = wait_for(lambda: (j := daemon.job(ender))["state"] != "running"
                     and "not recorded" not in (j["reason"] or "") and j, 15,
                     what="the end recorded once writes go through")
    assert (ended["state"], ended["exit_code"]) == ("failed", 3), ended
    assert [e["to_state"] for e in daemon.events(ender)][-1] == "failed"
    retried = [submit(daemon.url, f"retried-{i}") for i in range(len(refused))]
    assert [a.status_code for a in retried] == [201] * len(refused), [a.text for a in retried]
    for job_id in [*acknowledged, *(a.json()["id"] for a in retried)]:
        daemon.wait_state(job_id, "succeeded", timeout=30)

    log = daemon.log()
    assert "tick step failed" not in log and "tick failed" not in log, log[-3000:]
    assert log.count("the database cannot be written: ") == 1, log[-3000:]
    assert log.count("the database is writable again (it was not") == 1, log[-3000:]
    print(f"{len(refused)} of {SUBMITTERS} submits refused during the spell, "
          f"{len(acknowledged)} acknowledged; /healthz ok {healthy_after_s:.2f} s after "
          "the fix")


def test_only_a_connection_opened_since_the_failure_shows_writes_mended(
        tmp_path: Path) -> None:
    """A write that began before a refusal, or went through a connection opened before
    the spell (which still writes in it), proves nothing: the daemon stays degraded. A
    connection opened in the spell is read-only for good: the write that shows the files
    writable again has it replaced, so no later tick draws it from the pool and finds
    the database "cannot be written" again. And with every connection from before the
    spell closed, one opened in it does not leave the others read-only after the fix
    (the engine's keeper holds the writable index: `database.Lineage`)."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    try:
        ran = subprocess.run([*without_dac_override(), PY,
                              str(REPO / "tests" / "jobs" / "read_only_ticks.py"), str(data_dir)],
                             capture_output=True, text=True, timeout=60, cwd=REPO)
    finally:
        data_dir.chmod(0o755)
    assert ran.returncode == 0, ran.stderr[-3000:]
    lines = ran.stdout.splitlines()
    steps = {step["step"]: step for step in
             (json.loads(line) for line in lines if not line.startswith("LOG "))}
    assert steps["API write in the spell"] == {
        "step": "API write in the spell", "ok": False,
        "reason": "it is read-only (POST /api/v1/jobs)"}
    # its write came before the refusal: it tells nothing of the files since (the log
    # said "writable again" in the spell, then "cannot be written" again)
    ended = steps["the tick from before the spell ends"]
    assert (ended["ok"], ended["reason"]) == (True, "it is read-only (POST /api/v1/jobs)")
    assert steps["tick in the spell"]["ok"] is False
    assert steps["tick in the spell"]["reason"] == "it is read-only (tick in the spell)"
    old = steps["old connection in the spell"]
    assert old["ok"] is True, old  # it wrote: its descriptors are the ones from before
    assert old["reason"] == "it is read-only (tick in the spell)", old
    later = [step for name, step in steps.items() if name.startswith("later tick")]
    assert len(later) == 8
    for step in [steps["tick after the fix"], *later]:
        assert (step["ok"], step["reason"]) == (True, None), (step, ran.stdout)
    logged = [line for line in lines if line.startswith(("LOG ERROR", "LOG WARNING"))]
    assert len(logged) == 2, ran.stdout
    assert logged[0].startswith("LOG ERROR the database cannot be written: it is read-only")
    assert logged[1].startswith("LOG WARNING the database is writable again"), logged
