"""Processes that run away from the job's tree while its shim lives: the shim is their
subreaper, and the job is not over while it has a descendant. A chain of
setsid-fork-exit generations (each one a new session, its parent gone a moment later)
was missed by the shim's scans of /proc as it passed, and ran on under init after the
job was recorded `succeeded` (issue #30, item 5)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers import Daemon, python_job, wait_for

CHAIN = """
import os, signal, sys, time
beat, pause_s = sys.argv[1], float(sys.argv[2])
deadline = time.time() + 12  # the chain ends itself: an escaped one does not run for ever
if os.fork() == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends a generation
    last = 0.0
    while time.time() < deadline:
        if time.time() - last > 0.05:  # the chain's heartbeat, whichever generation runs
            last = time.time()
            with open(beat, "w") as f:
                f.write(str(last))
        time.sleep(pause_s)
        os.setsid()
        if os.fork():
            os._exit(0)  # the parent goes at once: its child is an orphan each time
    os._exit(0)
time.sleep(2)
"""


def beats_on(beat: Path) -> bool:
    """The chain still writes its heartbeat (one every 0.05 s while a generation runs)."""
    try:
        before = beat.stat().st_mtime_ns
    except FileNotFoundError:
        return False
    time.sleep(0.5)
    return beat.stat().st_mtime_ns != before


@pytest.mark.timeout(120)
def test_a_setsid_fork_exit_chain_dies_with_the_job(daemon: Daemon, tmp_path: Path) -> None:
    """Two jobs whose chains (SIGTERM ignored) pause 1 ms and 2 ms a generation; each
    writes a heartbeat file that shows whether it still runs (a scan of /proc misses it
    as the shim's did). They used to run on after their job's end; now neither does."""
    pauses_s = (0.001, 0.002)
    beats = [tmp_path / f"beat-{i}" for i in range(len(pauses_s))]
    t0 = time.monotonic()
    jobs = [daemon.submit(python_job(CHAIN) + [str(beat), str(pause_s)], name=f"chain-{i}")["id"]
            for i, (beat, pause_s) in enumerate(zip(beats, pauses_s, strict=True))]
    try:
        for job_id, beat in zip(jobs, beats, strict=True):
            done = daemon.wait_state(job_id, "succeeded", "failed", timeout=60)
            assert beat.exists()
            assert not beats_on(beat), f"the chain of job {job_id} runs on after its end"
            assert done["state"] == "succeeded", done
        # the worker's 2 s, the leftovers' 2 s grace, then moments to catch the chain
        assert time.monotonic() - t0 < 15
    finally:
        wait_for(lambda: not any(beats_on(beat) for beat in beats), 30, what="every chain ended")
