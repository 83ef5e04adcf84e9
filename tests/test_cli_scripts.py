"""`jobsup` in scripts: --version, --json, -q, plain lines in a pipe, filters, restart,
logs of an earlier attempt, and options refused before any request. Real daemon, real
subprocess CLI calls (stdout is a pipe, as in `jobsup ls | grep`)."""

from __future__ import annotations

import json
import socket
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from supervisor import __version__
from tests.helpers import Daemon, python_job, wait_for
from tests.test_cli import jobsup

LONG_NAME = "extract-hidden-states-" + "x" * 90 + "-shard-07"
"""Longer than any terminal's column: rich used to fold it over several lines."""


def test_version() -> None:
    result = jobsup("--version", url=None)
    assert result.returncode == 0 and result.stdout == f"jobsup {__version__}\n"


class Listener:
    """A loopback TCP port that counts the connections made to it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    try:
        yield server
    finally:
        server.close()


def test_wrong_options_exit_2_before_any_request(listener: Listener, tmp_path: Path) -> None:
    a_file = tmp_path / "items.txt"
    a_file.write_text("not a directory")
    cases = [
        (("ls", "--state", "runing"), "--state: 'runing' is not one of pending, running"),
        (("alerts", "--state", "open"), "--state: 'open' is not one of firing, resolved"),
        (("ls", "--label", "team"), "--label 'team' is not of the form KEY=VALUE"),
        (("submit", "--name", "x", "--restart", "always", "--", "true"),
         "--restart: 'always' is not one of never, on-failure"),
        (("submit", "--name", "x", "--output", str(a_file), "--", "true"),
         f"--output: {a_file} exists and is not a directory"),
        (("submit", "--name", "x", "--env", "NOEQUALS", "--", "true"), "KEY=VALUE"),
        (("submit", "--name", "x", "--stall-timeout", "inf", "--", "true"), "finite"),
        (("logs", "abc", "--attempt", "0"), "--attempt: 0 is not an attempt number"),
        (("logs", "abc", "--tail", "-1"), "--tail: -1 is not a number of lines"),
        (("wait", "abc", "--timeout", "-1"), "--timeout: -1.0 is not a number of seconds"),
        (("completion", "tcsh"), "SHELL: 'tcsh' is not one of bash, zsh, fish"),
    ]
    for args, message in cases:
        result = jobsup(*args, url=listener.url)
        assert result.returncode == 2, (args, result)
        lines = result.stderr.splitlines()
        assert lines[0].startswith("error: ") and message in lines[0], (args, result.stderr)
        assert len(lines) == 2 and lines[1].startswith("hint: "), (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert listener.connections == 0


def test_output_that_does_not_exist_yet_is_accepted(listener: Listener, tmp_path: Path) -> None:
    """Only an existing file is refused: a new directory goes on to the request."""
    result = jobsup("submit", "--name", "x", "--output", str(tmp_path / "new"), "--", "true",
                    url=listener.url)
    assert result.returncode == 1 and "cannot reach the jobsup daemon" in result.stderr
    assert listener.connections >= 1


@pytest.mark.slow
def test_json_and_ids_only(shared: Daemon) -> None:
    submitted = jobsup("submit", "--json", "--name", "jsonjob", "--label", "kind=json", "--",
                       sys.executable, "-c", "print('hi')", url=shared.url)
    assert submitted.returncode == 0, submitted.stderr
    job = json.loads(submitted.stdout)
    assert job["name"] == "jsonjob" and job["spec"]["labels"] == {"kind": "json"}
    quiet = jobsup("submit", "-q", "--name", "quietjob", "--", "true", url=shared.url)
    quiet_id = quiet.stdout.strip()
    assert quiet.returncode == 0 and quiet.stdout == quiet_id + "\n" and len(quiet_id) == 8
    shared.wait_state(job["id"], "succeeded")

    listed = json.loads(jobsup("ls", "--json", url=shared.url).stdout)
    assert [j["id"] for j in listed] == [j["id"] for j in shared.http.get(
        "/api/v1/jobs", params={"order": "oldest", "limit": 1000}).json()]
    assert {job["id"], quiet_id} <= {j["id"] for j in listed}
    shown = json.loads(jobsup("show", job["id"], "--json", url=shared.url).stdout)
    api = shared.job(job["id"])
    assert shown["id"] == api["id"] and shown["state"] == "succeeded"
    assert shown.keys() == api.keys() and shown["spec"] == api["spec"]
    ids = jobsup("ls", "-q", url=shared.url).stdout.split()
    assert ids == [j["id"] for j in listed]
    by_label = jobsup("ls", "-q", "--label", "kind=json", url=shared.url)
    assert by_label.stdout.split() == [job["id"]]
    alerts = jobsup("alerts", "--json", url=shared.url)
    assert alerts.returncode == 0 and json.loads(alerts.stdout) == shared.http.get(
        "/api/v1/alerts").json()


@pytest.mark.slow
def test_plain_lines_in_a_pipe_are_never_folded(shared: Daemon) -> None:
    job = shared.submit(python_job("print('x')"), name=LONG_NAME, labels={"long": "yes"})
    shared.wait_state(job["id"], "succeeded")
    listed = jobsup("ls", url=shared.url, env={"COLUMNS": "80"})
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split("\t") == ["ID", "NAME", "STATE", "PID", "EXIT", "RESTARTS",
                                    "STARTED", "REASON", "PROGRESS", "ALERTS"]
    assert all(len(line.split("\t")) == 10 for line in lines), lines
    mine = [line for line in lines if LONG_NAME in line]  # what `grep NAME` finds
    assert len(mine) == 1
    fields = mine[0].split("\t")
    assert fields[:3] == [job["id"], LONG_NAME, "succeeded"]
    assert fields[4] == "0" and fields[7] == "exited with code 0"
    shown = jobsup("show", job["id"], url=shared.url, env={"COLUMNS": "80"}).stdout
    assert f"name\t{LONG_NAME}\n" in shown and "state\tsucceeded\n" in shown
    assert "event\t" in shown and "\tpending\trunning\tstarted (attempt 1)\n" in shown


@pytest.mark.slow
def test_filters_and_their_empty_answers(shared: Daemon) -> None:
    running = jobsup("ls", "--state", "running", url=shared.url)
    assert running.returncode == 0 and running.stdout == ""
    assert running.stderr.strip() == "no running jobs"
    labelled = jobsup("ls", "--state", "failed", "--label", "team=nobody", url=shared.url)
    assert labelled.stderr.strip() == "no failed jobs with label team=nobody"
    assert jobsup("ls", "--json", "--label", "team=nobody", url=shared.url).stdout == "[]\n"
    assert jobsup("alerts", "--state", "firing", url=shared.url).stderr.strip() == \
        "no firing alerts"


@pytest.mark.slow
def test_restart_keeps_history_and_logs_of_each_attempt(shared: Daemon) -> None:
    job = shared.submit(python_job("import os; print('attempt', os.environ['JOBSUP_ATTEMPT']);"
                                   "raise SystemExit(3)"), name="again")
    shared.wait_state(job["id"], "failed")
    restarted = jobsup("restart", job["id"], url=shared.url)
    assert restarted.returncode == 0, restarted.stderr
    assert restarted.stdout.split()[:3] == [job["id"], "pending", "restart"]
    ended = wait_for(lambda: (j := shared.job(job["id"]))["state"] == "failed"
                     and j["attempt"] == 2 and j, 15, what="second attempt failed")
    assert ended["restarts"] == 1 and ended["exit_code"] == 3
    reasons = [(e["from_state"], e["to_state"], e["reason"]) for e in shared.events(job["id"])]
    assert ("failed", "pending", "restart requested") in reasons
    assert reasons[-1] == ("running", "failed", "exited with code 3")
    assert jobsup("logs", job["id"], "--attempt", "1", url=shared.url).stdout == "attempt 1\n"
    assert jobsup("logs", job["id"], "--attempt", "2", url=shared.url).stdout == "attempt 2\n"
    assert jobsup("logs", job["id"], url=shared.url).stdout == "attempt 2\n"
    beyond = jobsup("logs", job["id"], "--attempt", "3", url=shared.url)
    assert beyond.returncode == 1 and "has 2 attempt(s)" in beyond.stderr
    both = jobsup("logs", job["id"], "--attempt", "1", "-f", url=shared.url)
    assert both.stdout == "attempt 1\n--- jobsup: attempt 2 ---\nattempt 2\n"
    assert both.returncode == 3


@pytest.mark.slow
def test_restart_of_a_running_job_needs_stop(shared: Daemon) -> None:
    job = shared.submit(python_job("import time; time.sleep(600)"), name="busy")
    shared.wait_state(job["id"], "running")
    refused = jobsup("restart", job["id"], url=shared.url)
    assert refused.returncode == 1 and "has not ended (running)" in refused.stderr
    assert f"hint: stop it first: `jobsup restart --stop {job['id']}`" in refused.stderr
    assert shared.http.post(f"/api/v1/jobs/{job['id']}/restart").status_code == 409
    assert shared.http.post("/api/v1/jobs/nope/restart").status_code == 404
    restarted = jobsup("restart", "--stop", "--json", job["id"], url=shared.url)
    assert restarted.returncode == 0, restarted.stderr
    assert json.loads(restarted.stdout)["state"] == "pending"
    wait_for(lambda: shared.job(job["id"])["attempt"] == 2
             and shared.job(job["id"])["state"] == "running", 15, what="attempt 2 running")
    reasons = [e["reason"] for e in shared.events(job["id"])]
    assert "stopped on request (SIGTERM)" in reasons and "restart requested" in reasons
    shared.http.post(f"/api/v1/jobs/{job['id']}/stop")
    shared.wait_state(job["id"], "stopped")


@pytest.mark.slow
def test_two_restarts_at_once_requeue_once(shared: Daemon) -> None:
    job = shared.submit(python_job("import time; time.sleep(600)"), name="raced")
    shared.wait_state(job["id"], "running")
    shared.http.post(f"/api/v1/jobs/{job['id']}/stop")
    shared.wait_state(job["id"], "stopped")
    with ThreadPoolExecutor(4) as pool:
        codes = sorted(pool.map(lambda _: shared.http.post(
            f"/api/v1/jobs/{job['id']}/restart").status_code, range(4)))
    assert codes == [202, 409, 409, 409]
    requeued = [e for e in shared.events(job["id"]) if e["reason"] == "restart requested"]
    assert len(requeued) == 1 and shared.job(job["id"])["restarts"] == 1
    shared.wait_state(job["id"], "running")
    shared.http.post(f"/api/v1/jobs/{job['id']}/stop")
    shared.wait_state(job["id"], "stopped")


@pytest.mark.parametrize(("fields", "code"), [
    ({"state": "succeeded", "exit_code": 0}, 0),
    ({"state": "failed", "exit_code": 3}, 3),
    ({"state": "failed", "exit_code": 255}, 255),
    ({"state": "failed", "exit_code": 300}, 1),  # not an exit status a shell can carry
    ({"state": "failed", "signal": 9}, 137),
    ({"state": "failed"}, 1),  # never started, or a dependency failed
    ({"state": "stopped", "signal": 15}, 121),
    ({"state": "stopped", "spec": {"stop_when_ended": ["abc"]}}, 0),  # a server, done
    ({"state": "lost"}, 122),
])
def test_exit_code_of_each_outcome(fields: dict[str, object], code: int) -> None:
    from supervisor.client.outcome import exit_code

    job = {"exit_code": None, "signal": None, "spec": {"stop_when_ended": []}, **fields}
    assert exit_code(job) == code
