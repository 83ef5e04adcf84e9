"""#32 item 9, the CLI's habits against a real daemon: jobs named by the start of their id
or by their name (as docker and git take them), `ls` with progress and alerts (a stalled
job reads stalled), `watch` through a daemon restart and at 160 columns, flags that take
no value."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from tests.helpers import Daemon, python_job, wait_for
from tests.test_cli import jobsup

pytestmark = pytest.mark.slow


def plain(text: str) -> str:
    """A terminal's output without its escape sequences (bold: NO_COLOR keeps it)."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def test_a_job_is_named_by_the_start_of_its_id_or_its_name(shared: Daemon) -> None:
    daemon = shared
    crash = daemon.submit(python_job("print('boom'); raise SystemExit(3)"), name="train-crash")
    daemon.wait_state(crash["id"], "failed")
    twins = [daemon.submit(python_job("pass"), name="twin") for _ in range(2)]
    for twin in twins:
        daemon.wait_state(twin["id"], "succeeded")

    by_prefix = jobsup("show", crash["id"][:4], url=daemon.url)
    assert by_prefix.returncode == 0, by_prefix.stderr
    assert f"id\t{crash['id']}\n" in by_prefix.stdout
    assert "event\t" in by_prefix.stdout  # its events too, through the resolved id
    by_name = jobsup("show", "train-crash", "--json", url=daemon.url)
    assert by_name.returncode == 0, by_name.stderr
    assert '"id": "' + crash["id"] + '"' in by_name.stdout
    waited = jobsup("wait", crash["id"][:5], twins[0]["id"][:6],
                    url=daemon.url)
    assert waited.returncode == 3, waited  # the crash's own exit code: both resolved
    assert crash["id"] in waited.stdout and twins[0]["id"] in waited.stdout

    # a name given to two jobs: refused, both listed, exit 1
    ambiguous = jobsup("show", "twin", url=daemon.url)
    assert ambiguous.returncode == 1, ambiguous
    assert "'twin' is the name of 2 jobs" in ambiguous.stderr
    assert all(t["id"] in ambiguous.stderr for t in twins), ambiguous.stderr
    assert "hint:" in ambiguous.stderr and "Traceback" not in ambiguous.stderr
    # the API takes the same references
    assert daemon.http.get("/api/v1/jobs/train-crash").json()["id"] == crash["id"]
    answer = daemon.http.get("/api/v1/jobs/twin")
    assert answer.status_code == 400 and answer.json()["field"] == "job_id"

    restarted = jobsup("restart", "train-crash", url=daemon.url)
    assert restarted.returncode == 0, restarted.stderr
    assert restarted.stdout.startswith(crash["id"])


STALLS = """
import json, os, time
path = os.environ["JOBSUP_PROGRESS_FILE"]
def report(done):
    with open(path + ".tmp", "w") as f:
        json.dump({"done": done, "total": 10, "unit": "item"}, f)
    os.replace(path + ".tmp", path)
for done in range(1, 4):
    report(done)
    time.sleep(0.3)
time.sleep(600)
"""


def test_ls_shows_progress_and_alerts_and_a_stalled_job_reads_stalled(
        shared: Daemon) -> None:
    daemon = shared
    job = daemon.submit(python_job(STALLS), name="stalls", expected_items=10,
                        stall_timeout_s=2)
    try:
        wait_for(lambda: "stalled" in [a["rule"] for a in daemon.job(job["id"])["alerts"]],
                 20, what="the stalled alert")
        listed = jobsup("ls", url=daemon.url)
        assert listed.returncode == 0, listed.stderr
        header, *rows = [line.split("\t") for line in listed.stdout.splitlines()]
        # the first eight columns stay where scripts found them
        assert header == ["ID", "NAME", "STATE", "PID", "EXIT", "RESTARTS", "STARTED",
                          "REASON", "PROGRESS", "ALERTS"]
        (row,) = [r for r in rows if r[0] == job["id"]]
        assert row[2] == "running"
        assert row[8] == "3/10 (30%), stalled" and row[9] == "stalled", row
        # on a terminal, beside the state
        tty = jobsup("ls", url=daemon.url, env={"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1",
                                                "NO_COLOR": "1", "COLUMNS": "160"})
        lines = plain(tty.stdout).splitlines()
        assert lines[0].split()[:5] == ["ID", "NAME", "STATE", "PROGRESS", "ALERTS"], lines
        assert re.search(r"running +3/10 \(30%\), stalled +stalled ", plain(tty.stdout)), \
            tty.stdout
    finally:  # the module's daemon: no runner left behind for the next test
        daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")
        daemon.wait_state(job["id"], "stopped")


def watch_env(columns: int) -> dict[str, str]:
    """A terminal for rich (TTY_COMPATIBLE, TTY_INTERACTIVE): Live redraws in place."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBSUP_")}
    return {**env, "COLUMNS": str(columns), "LINES": "50", "TTY_COMPATIBLE": "1",
            "TTY_INTERACTIVE": "1", "NO_COLOR": "1"}


def test_watch_keeps_going_through_a_daemon_restart(daemon: Daemon, tmp_path: Path) -> None:
    job = daemon.submit(python_job("import time; time.sleep(600)"), name="long-runner")
    daemon.wait_state(job["id"], "running")
    out = tmp_path / "watch.out"
    with open(out, "wb") as sink:
        watch = subprocess.Popen(
            [sys.executable, "-m", "supervisor", "watch", "--interval", "0.3", "--url",
             daemon.url], stdout=sink, stderr=subprocess.STDOUT, env=watch_env(160))
    try:
        wait_for(lambda: "long-runner" in out.read_text(errors="replace"), 20,
                 what="the first table")
        daemon.stop()
        wait_for(lambda: "daemon unreachable at" in out.read_text(errors="replace"), 15,
                 what="the unreachable line")
        assert watch.poll() is None, out.read_text(errors="replace")
        seen = len(out.read_bytes())
        daemon.start()
        renamed = daemon.submit(python_job("import time; time.sleep(600)"),
                                name="after-restart")

        def redrawn() -> bool:
            return "after-restart" in out.read_bytes()[seen:].decode(errors="replace")

        wait_for(redrawn, 20, what="a table from the restarted daemon")
        assert watch.poll() is None
        daemon.http.post(f"/api/v1/jobs/{renamed['id']}/stop")
    finally:
        watch.terminate()
        watch.wait(10)
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")


def test_watch_at_160_columns_shows_names_and_one_disk_line(shared: Daemon,
                                                            tmp_path: Path) -> None:
    daemon = shared
    names = [f"extract-hidden-states-shard-{i:02d}-of-03" for i in range(3)]  # 37 chars
    writer = ("import os, sys, time\nout = sys.argv[1]\nos.makedirs(out, exist_ok=True)\n"
              "for i in range(10_000):\n"
              "    open(os.path.join(out, f'item{i}.bin'), 'wb').write(b'x' * 100_000)\n"
              "    time.sleep(0.2)\n")
    jobs = [daemon.submit(python_job(writer) + [str(tmp_path / name)], name=name,
                          output_dir=str(tmp_path / name), pattern="*.bin",
                          expected_items=10_000) for name in names]
    for job in jobs:
        wait_for(lambda job=job: daemon.job(job["id"])["forecast"]["disk_free_bytes"], 20,
                 what="the disk figures")
    shown = subprocess.run([sys.executable, "-m", "supervisor", "watch", "--once", "--url",
                            daemon.url], capture_output=True, text=True, timeout=60,
                           env=watch_env(160))
    assert shown.returncode == 0, shown.stderr
    table = plain(shown.stdout)
    for name in names:  # whole, not cut to 11 characters
        assert name in table, table
    assert table.count(" free") == 1, table  # once, not per row
    assert "disk: " in table and "— 3 jobs" in table, table
    assert max(len(line) for line in table.splitlines()) <= 160
    for job in jobs:
        daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")


def test_flags_take_no_value_and_help_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """`--json true` was 'unexpected extra argument' for ls and a job id for wait; help
    showed `--json <bool>`. One real run for main()'s wiring, the rest in-process."""
    env = {"COLUMNS": "120"}
    refused = jobsup("wait", "abc", "--json", "TRUE", url="http://127.0.0.1:9", env=env)
    assert refused.returncode == 2, refused
    assert "--json is a flag and takes no value" in refused.stderr, refused.stderr
    assert "cannot reach" not in refused.stderr  # refused before any request
    from supervisor.client.cli import app
    from supervisor.client.options import refuse_flag_values

    command = typer.main.get_command(app)
    for args in (["ls", "--json", "true"], ["ls", "--json=false"], ["ls", "-q", "yes"],
                 ["restart", "--wait", "on", "abc"], ["serve", "--rebuild-db", "no"]):
        with pytest.raises(typer.Exit) as exited:
            refuse_flag_values(command, args)
        assert exited.value.exit_code == 2, args
        assert f"{args[1].split('=')[0]} is a flag and takes no value" in \
            capsys.readouterr().err, args
    # an argument that merely looks like a word, and what follows `--` (the job's own
    # command line), are left alone
    refuse_flag_values(command, [])  # `jobsup` alone (it raised: #32)
    refuse_flag_values(command, ["show", "--json", "8a84"])
    refuse_flag_values(command, ["submit", "--name", "x", "--", "tool", "--json", "true"])
    runner = CliRunner()
    for name in ("ls", "show", "wait", "alerts", "submit", "restart", "logs", "watch",
                 "stop", "serve"):
        shown = runner.invoke(app, [name, "--help"], env=env)
        assert shown.exit_code == 0, shown.output
        assert "<bool>" not in shown.output, (name, shown.output)
    assert "  --json  " in runner.invoke(app, ["ls", "--help"], env=env).output
