"""The `jobsup` command against a real daemon, as a user types it."""

from __future__ import annotations

import os
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


@pytest.mark.slow
def test_follow_spans_restarts(make_daemon, tmp_path: Path) -> None:
    daemon = make_daemon(env={"JOBSUP_RESTART_BACKOFF_S": "0.2"})
    job = daemon.submit([sys.executable, "-c", "import os; print('attempt', "
                         "os.environ['JOBSUP_ATTEMPT']); raise SystemExit(1)"],
                        restart_policy="on-failure", max_restarts=1)
    followed = jobsup("logs", job["id"], "-f", url=daemon.url)
    assert "attempt 2" in followed.stdout


@pytest.mark.slow
def test_stop_from_the_cli(daemon: Daemon) -> None:
    job = daemon.submit([sys.executable, "-c", "import time; time.sleep(600)"])
    daemon.wait_state(job["id"], "running")
    stopped = jobsup("stop", job["id"], url=daemon.url)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    again = jobsup("stop", job["id"], url=daemon.url)
    assert again.returncode == 1 and "already ended" in again.stderr


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
