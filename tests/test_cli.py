"""The `jobsup` command against a real daemon, as a user types it."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import Daemon, free_port


def jobsup(*args: str, url: str | None, env: dict[str, str] | None = None,
           timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("JOBSUP_")}
    full_env.update({"COLUMNS": "200", **(env or {})})
    if url:
        full_env["JOBSUP_URL"] = url
    return subprocess.run([sys.executable, "-m", "supervisor", *args], capture_output=True,
                          text=True, timeout=timeout, env=full_env)


@pytest.mark.slow
def test_submit_ls_show_logs_follow(daemon: Daemon) -> None:
    submitted = jobsup("submit", "--name", "count", "--label", "step=demo", "--",
                       sys.executable, "-c",
                       "import time\nfor i in range(3): print('tick', i); time.sleep(0.3)",
                       url=daemon.url)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert len(job_id) == 8

    followed = jobsup("logs", job_id, "--follow", url=daemon.url)
    assert followed.returncode == 0, followed.stderr
    assert followed.stdout.splitlines()[-3:] == ["tick 0", "tick 1", "tick 2"]

    listed = jobsup("ls", url=daemon.url)
    assert job_id in listed.stdout and "succeeded" in listed.stdout and "count" in listed.stdout
    shown = jobsup("show", job_id, url=daemon.url)
    assert "state\tsucceeded\n" in shown.stdout and "\tpending\trunning\t" in shown.stdout
    tail = jobsup("logs", job_id, "-n", "1", url=daemon.url)
    assert tail.stdout == "tick 2\n"
    assert tail.stderr == "(the last 1 line; --tail N for more)\n"  # it says it cut
    whole = jobsup("logs", job_id, url=daemon.url)  # 3 lines of the default 100: all
    assert whole.stdout.splitlines()[-3:] == ["tick 0", "tick 1", "tick 2"] and not whole.stderr


@pytest.mark.slow
def test_follow_spans_restarts(make_daemon, tmp_path: Path) -> None:
    daemon = make_daemon(env={"JOBSUP_RESTART_BACKOFF_S": "0.2"})
    job = daemon.submit([sys.executable, "-c", "import os; print('attempt', "
                         "os.environ['JOBSUP_ATTEMPT']); raise SystemExit(1)"],
                        restart_policy="on-failure", max_restarts=1)
    followed = jobsup("logs", job["id"], "-f", url=daemon.url)
    assert "attempt 2" in followed.stdout


@pytest.mark.slow
def test_show_quotes_the_command_and_says_what_a_pending_job_waits_for(daemon: Daemon) -> None:
    """`show` prints the command as a shell would take it back, and a pending job's
    reason names the dependencies it waits for, not "-" (#32 item 9)."""
    first = daemon.submit([sys.executable, "-c", "import time; time.sleep(600)"], name="first")
    command = [sys.executable, "-c", "print('a b')"]
    later = daemon.submit(command, name="later", depends_on=[first["id"]])
    daemon.wait_state(first["id"], "running")
    shown = jobsup("show", later["id"], url=daemon.url)
    assert shown.returncode == 0, shown.stderr
    assert f"command\t{shlex.join(command)}\n" in shown.stdout, shown.stdout
    assert f"reason\twaiting for {first['id']} (first, running)\n" in shown.stdout, shown.stdout
    daemon.http.post(f"/api/v1/jobs/{first['id']}/stop")


@pytest.mark.slow
def test_a_daemon_with_a_token_tells_the_cli_user_about_jobsup_token(make_daemon) -> None:
    """The 401's hint is the CLI user's: set JOBSUP_TOKEN (not an HTTP header), or it
    is not the daemon's (#32 item 9)."""
    daemon = make_daemon(env={"JOBSUP_TOKEN": "s3cret-token-of-this-daemon-0123456789"})
    for env, hint in (({}, "set JOBSUP_TOKEN to it"),
                      ({"JOBSUP_TOKEN": "another-token-0123456789abcdef"},
                       "JOBSUP_TOKEN is not the daemon's token")):
        listed = jobsup("ls", url=daemon.url, env=env)
        lines = listed.stderr.splitlines()
        assert listed.returncode == 1 and "HTTP 401" in lines[0], listed.stderr
        assert lines[1].startswith("hint: ") and hint in lines[1], listed.stderr


@pytest.mark.slow
def test_stop_from_the_cli(daemon: Daemon) -> None:
    job = daemon.submit([sys.executable, "-c", "import time; time.sleep(600)"])
    daemon.wait_state(job["id"], "running")
    stopped = jobsup("stop", job["id"], url=daemon.url)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    again = jobsup("stop", job["id"], url=daemon.url)
    assert again.returncode == 1 and "already ended" in again.stderr
    # several ids, as `jobsup ls -q | xargs jobsup stop` gives them; an unknown one in
    # between is reported and the others are still stopped (#32 item 9)
    two = [daemon.submit([sys.executable, "-c", "import time; time.sleep(600)"])["id"]
           for _ in range(2)]
    for job_id in two:
        daemon.wait_state(job_id, "running")
    many = jobsup("stop", two[0], "nope", two[1], url=daemon.url)
    assert many.returncode == 1 and "no job with id 'nope'" in many.stderr, many
    assert [line.split()[0] for line in many.stdout.splitlines()] == two, many.stdout
    assert all(daemon.job(job_id)["state"] == "stopped" for job_id in two)


@pytest.mark.slow
def test_user_mistakes_give_error_and_hint_without_traceback(daemon: Daemon) -> None:
    """Refused by the daemon: exit 1 (those the CLI refuses before any request exit 2:
    test_cli_scripts)."""
    cases = [
        (("submit", "--name", "x", "--", "no-such-program-xyz"), "not found on PATH"),
        (("show", "nope"), "no job with id 'nope'"),
        (("submit", "--name", "x", "--stall-timeout", "-3", "--", "true"), "stall_timeout_s"),
    ]
    for args, message in cases:
        result = jobsup(*args, url=daemon.url)
        assert result.returncode == 1, (args, result)
        assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_no_daemon_running() -> None:
    result = jobsup("ls", url=f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 1
    assert "error: cannot reach the jobsup daemon" in result.stderr
    assert "hint: start it with `jobsup serve`" in result.stderr


def test_wrong_usage_is_a_usage_error() -> None:
    result = jobsup("submit", "--", "true", url=None)
    assert result.returncode == 2 and "--name" in result.stderr
    assert jobsup("--help", url=None).returncode == 0


@pytest.mark.slow
def test_non_loopback_bind_without_token_refuses(tmp_path: Path) -> None:
    result = jobsup("serve", "--host", "0.0.0.0", "--port", str(free_port()),
                    "--data-dir", str(tmp_path), url=None)
    assert result.returncode == 1
    assert "refusing to listen on 0.0.0.0 without a token" in result.stderr
