"""A shim that cannot act on its own (stopped with SIGSTOP) still gets its job's exit
recorded: the stop backstop kills the job's processes but never the shim, and a stopped
shim whose worker has ended is continued so it reaps the worker and writes the exit."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from supervisor.runtime.procfs import is_same_process, process_state
from tests.helpers import PY, Daemon, Recorded, exit_recorded, identity, job_module, wait_for

pytestmark = pytest.mark.slow


def running_worker(daemon: Daemon, job_id: str) -> Recorded:
    wait_for(lambda: daemon.job(job_id)["pid"], 15, what="the worker started")
    return identity(daemon.data_dir, job_id, "worker.json")


@pytest.mark.timeout(60)
def test_stop_backstop_kills_the_job_never_the_shim(make_daemon) -> None:
    daemon: Daemon = make_daemon()
    job = daemon.submit(job_module("ignores_sigterm"), name="held", stop_grace_s=1)
    worker = running_worker(daemon, job["id"])
    shim = identity(daemon.data_dir, job["id"], "shim.json")
    # the shim cannot act: the SIGTERM the stop sends it stays pending, its grace timer
    # never runs, so only the daemon's backstop (grace + 5 s) can end the job
    os.kill(shim[0], signal.SIGSTOP)
    wait_for(lambda: process_state(shim[0]) == "T", 5, what="shim stopped")
    t0 = time.monotonic()
    assert daemon.http.post(f"/api/v1/jobs/{job['id']}/stop").status_code == 202
    done = daemon.wait_state(job["id"], "stopped", "lost", timeout=20)
    took = time.monotonic() - t0
    assert 5.5 < took < 12, took  # the backstop, not the shim's own grace timer
    assert not is_same_process(*worker)
    # the shim lived to reap the worker and record how it ended
    status = daemon.data_dir / "jobs" / job["id"] / "attempt-1" / "status.json"
    assert exit_recorded(status)
    recorded = json.loads(status.read_bytes())
    assert recorded["signal"] == signal.SIGKILL and recorded["stop_requested"] is True
    assert done["state"] == "stopped" and done["signal"] == signal.SIGKILL, done
    assert "unknown" not in done["reason"] and "backstop" in done["reason"], done["reason"]
    wait_for(lambda: not is_same_process(*shim), 5, what="the shim to exit on its own")
    assert "after stop; SIGKILL" in daemon.log()  # the backstop said what it did


@pytest.mark.timeout(60)
def test_stopped_shim_is_continued_when_its_worker_ends(make_daemon, tmp_path: Path) -> None:
    daemon: Daemon = make_daemon()
    flag = tmp_path / "go"
    code = (f"import os, sys, time\nwhile not os.path.exists({str(flag)!r}): "
            "time.sleep(0.05)\nsys.exit(3)")
    job = daemon.submit([PY, "-c", code], name="stopped-shim")
    running_worker(daemon, job["id"])
    shim = identity(daemon.data_dir, job["id"], "shim.json")
    os.kill(shim[0], signal.SIGSTOP)
    wait_for(lambda: process_state(shim[0]) == "T", 5, what="shim stopped")
    daemon.wait_ticks(3)  # ticks with the shim stopped and the worker alive: nothing to do
    assert process_state(shim[0]) == "T"
    assert daemon.job(job["id"])["state"] == "running"
    flag.touch()  # the worker exits 3; only its stopped parent, the shim, can reap it
    done = daemon.wait_state(job["id"], "failed", timeout=10)
    assert (done["exit_code"], done["exit_reason"]) == (3, "exit"), done
    assert "continuing it (SIGCONT)" in daemon.log()


@pytest.mark.timeout(60)
def test_stopped_shim_is_continued_when_its_worker_ends_leaving_a_child(
        make_daemon, tmp_path: Path) -> None:
    """Issue #30, item 9: the worker leaves a child in its group and exits 3 while its
    shim is stopped. The job ended with the worker: the shim is continued, ends the child
    and records the exit; before, the live child kept the shim stopped and the job
    `running` until the child ended."""
    daemon: Daemon = make_daemon()
    flag, child_pid = tmp_path / "go", tmp_path / "child.pid"
    code = ("import os, subprocess, sys, time\n"
            "child = subprocess.Popen(['sleep', '300'])\n"
            f"open({str(child_pid)!r}, 'w').write(str(child.pid))\n"
            f"while not os.path.exists({str(flag)!r}): time.sleep(0.05)\n"
            "os._exit(3)")
    job = daemon.submit([PY, "-c", code], name="stopped-shim-child")
    running_worker(daemon, job["id"])
    wait_for(child_pid.exists, 10, what="the worker's child started")
    child = int(child_pid.read_text())
    shim = identity(daemon.data_dir, job["id"], "shim.json")
    os.kill(shim[0], signal.SIGSTOP)
    wait_for(lambda: process_state(shim[0]) == "T", 5, what="shim stopped")
    t0 = time.monotonic()
    flag.touch()
    done = daemon.wait_state(job["id"], "failed", timeout=15)
    assert (done["exit_code"], done["exit_reason"]) == (3, "exit"), done
    assert time.monotonic() - t0 < 10
    wait_for(lambda: process_state(child) in (None, "Z"), 5, what="the child ended")
