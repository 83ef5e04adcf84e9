"""A job's outcome as an exit code: `jobsup wait`, `submit --wait`, `logs -f` (the table
in supervisor/client/outcome.py and docs/api.md), against a real daemon."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from supervisor.client import outcome
from tests.helpers import Daemon, python_job, wait_for
from tests.test_cli import jobsup

pytestmark = pytest.mark.slow


def test_exit_codes_of_each_outcome(shared: Daemon) -> None:
    ok = shared.submit(python_job("pass"), name="ok")
    three = shared.submit(python_job("raise SystemExit(3)"), name="three")
    killed = shared.submit(python_job("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"),
                           name="killed")
    after = shared.submit(python_job("pass"), name="after", depends_on=[three["id"]])
    for job, code in ((ok, 0), (three, 3), (killed, 128 + signal.SIGKILL), (after, 1)):
        result = jobsup("wait", job["id"], url=shared.url)
        assert result.returncode == code, (job["name"], result)
        ended = shared.job(job["id"])
        assert result.stdout.startswith(f"{job['id']} {ended['state']} {ended['reason']}")
    assert shared.job(after["id"])["reason"].startswith(f"dependency {three['id']}")

    both = jobsup("wait", ok["id"], three["id"], killed["id"], url=shared.url)
    assert both.returncode == 3 and len(both.stdout.splitlines()) == 3
    reversed_order = jobsup("wait", killed["id"], three["id"], url=shared.url)
    assert reversed_order.returncode == 137
    as_json = jobsup("wait", "--json", ok["id"], three["id"], url=shared.url)
    assert as_json.returncode == 3
    assert [(j["id"], j["state"], j["exit_code"]) for j in json.loads(as_json.stdout)] == \
        [(ok["id"], "succeeded", 0), (three["id"], "failed", 3)]
    quiet = jobsup("wait", "-q", three["id"], url=shared.url)
    assert quiet.returncode == 3 and quiet.stdout == "" and quiet.stderr == ""
    unknown = jobsup("wait", "nope", url=shared.url)
    assert unknown.returncode == 1 and "no job with id 'nope'" in unknown.stderr


def test_stopped_timeout_and_lost(shared: Daemon) -> None:
    sleeper = shared.submit(python_job("import time; time.sleep(600)"), name="sleeper")
    shared.wait_state(sleeper["id"], "running")
    started = time.monotonic()
    timed_out = jobsup("wait", "--timeout", "1", sleeper["id"], url=shared.url)
    assert timed_out.returncode == outcome.EXIT_TIMEOUT == 124
    assert 1 <= time.monotonic() - started < 15
    assert f"timed out after 1s: {sleeper['id']} (running)" in timed_out.stderr
    shared.http.post(f"/api/v1/jobs/{sleeper['id']}/stop")
    stopped = jobsup("wait", sleeper["id"], url=shared.url)
    assert stopped.returncode == outcome.EXIT_STOPPED == 121

    vanishing = shared.submit(python_job("import time; time.sleep(600)"), name="vanishing")
    shared.wait_state(vanishing["id"], "running")
    pid = wait_for(lambda: shared.job(vanishing["id"])["pid"], 10, what="worker pid")
    shim = json.loads((shared.data_dir / "jobs" / vanishing["id"] / "attempt-1" /
                       "shim.json").read_text())
    os.kill(shim["pid"], signal.SIGKILL)
    time.sleep(0.5)
    os.killpg(pid, signal.SIGKILL)
    lost = jobsup("wait", "--timeout", "30", vanishing["id"], url=shared.url)
    assert lost.returncode == outcome.EXIT_LOST == 122, lost
    assert shared.job(vanishing["id"])["state"] == "lost"


def test_submit_wait_and_logs_follow_exit_with_the_outcome(shared: Daemon) -> None:
    code = "import time; print('working', flush=True); time.sleep(0.5); raise SystemExit(7)"
    submitted = jobsup("submit", "--wait", "--name", "seven", "--", sys.executable, "-c", code,
                       url=shared.url)
    assert submitted.returncode == 7, submitted
    job_id = submitted.stdout.strip()
    assert len(job_id) == 8 and shared.job(job_id)["exit_code"] == 7  # stdout: the id only
    assert f"{job_id} failed exited with code 7" in submitted.stderr
    as_json = jobsup("submit", "--wait", "--json", "--name", "ok", "--", "true", url=shared.url)
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["state"] == "succeeded"
    cut = jobsup("submit", "--wait", "--timeout", "0.5", "-q", "--name", "long", "--",
                 "sleep", "600", url=shared.url)
    assert cut.returncode == 124 and cut.stderr == ""
    shared.http.post(f"/api/v1/jobs/{cut.stdout.strip()}/stop")

    followed_job = shared.submit(python_job(code), name="followed")
    followed = jobsup("logs", "-f", followed_job["id"], url=shared.url)
    assert followed.returncode == 7 and followed.stdout == "working\n"
    ok_job = shared.submit(python_job("print('fine')"), name="fine")
    assert jobsup("logs", "-f", ok_job["id"], url=shared.url).returncode == 0
