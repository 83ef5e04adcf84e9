"""The system clock steps while jobs run (NTP, a resumed VM, `date -s`): no timeout of
the daemon moves, and none moves when the daemon restarts after the step. The daemon and
its jobs run under libfaketime (Debian's `libfaketime`, installed by `./dev.sh test`),
whose offset the test changes on the fly; the monotonic and boot-time clocks are left
alone, as a real clock step leaves them.

libfaketime fakes the clock calls, not the kernel's files: /proc/stat's `btime` (the
wall clock minus the time since boot) moves with a real step, and a daemon started after
the step reads it moved. Where that matters, the restarted daemon runs in a mount
namespace of its own whose /proc/stat has `btime` moved by the step (`moved_boot_time`);
everything else is the machine's."""

from __future__ import annotations

import os
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Daemon, cpu_wait_s, job_module, python_job, wait_for

pytestmark = pytest.mark.slow

LIBFAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"))),
                   Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"))

# libfaketime's clock_nanosleep fails (EINVAL) while the monotonic clock is left alone,
# so the jobs here wait with Event.wait and signal.pause, never time.sleep
# (tests/jobs/progress_ticker.py, tests/jobs/ignores_sigterm.py)


@pytest.fixture
def clock_file(tmp_path: Path) -> Path:
    if not LIBFAKETIME.exists():
        pytest.fail(f"{LIBFAKETIME} is missing: ./dev.sh test installs Debian's libfaketime")
    path = tmp_path / "faketime"
    path.write_text("+0\n")
    return path


def faked(clock_file: Path, **env: str) -> dict[str, str]:
    return {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME_TIMESTAMP_FILE": str(clock_file),
            "FAKETIME_NO_CACHE": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1", **env}


def step(clock_file: Path, offset_s: int) -> None:
    clock_file.write_text(f"{offset_s:+d}\n")
    time.sleep(0.05)


def moved_boot_time(tmp_path: Path, offset_s: int) -> list[str]:
    """A command prefix that runs a daemon in a mount namespace of its own where
    /proc/stat says the machine booted `offset_s` later: what a step of the wall clock
    by `offset_s` does to `btime` for every process that reads it afterwards (the shims
    the daemon launches there too). Needs root (CI and the dev machines run as root)."""
    if os.geteuid() != 0:
        pytest.fail("this test bind-mounts a file over /proc/stat and needs root")
    stat = tmp_path / f"proc-stat{offset_s:+d}"
    lines = Path("/proc/stat").read_text().splitlines(keepends=True)
    stat.write_text("".join(f"btime {int(line.split()[1]) + offset_s}\n"
                            if line.startswith("btime ") else line for line in lines))
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
              f'mount --bind {stat} /proc/stat && exec "$@"', "sh"]
    seen = subprocess.run([*prefix, "grep", "^btime", "/proc/stat"], capture_output=True,
                          text=True, check=True).stdout.split()
    real = next(line for line in lines if line.startswith("btime ")).split()
    assert int(seen[1]) == int(real[1]) + offset_s, seen  # the namespace sees it moved
    return prefix


WAITS = "import threading; threading.Event().wait()"
"""A job that runs until signalled, without clock calls (see above)."""


@pytest.mark.timeout(90)
def test_a_forward_step_fires_no_stall_and_no_early_sigkill(make_daemon,
                                                            clock_file: Path) -> None:
    daemon: Daemon = make_daemon(env=faked(clock_file))
    busy = daemon.submit(job_module("progress_ticker"), name="busy", stall_timeout_s=5)
    held = daemon.submit(job_module("ignores_sigterm"), name="held", stop_grace_s=20)
    for job in (busy, held):
        wait_for(lambda j=job: daemon.job(j["id"])["pid"], 15, what="worker started")
    wait_for(lambda: (daemon.job(busy["id"])["progress"]["items_done"] or 0) > 2, 10,
             what="progress")
    assert daemon.http.post(f"/api/v1/jobs/{held['id']}/stop").status_code == 202
    daemon.wait_ticks(1)  # the stop acted on (SIGTERM sent) before the step

    step(clock_file, +3600)  # an hour forward
    daemon.wait_ticks(8)  # 8 ticks after the step
    alerts = daemon.http.get("/api/v1/alerts").json()
    assert not any(a["rule"] == "stalled" for a in alerts), alerts
    # the stop's grace (20 s) is not over: the backstop has not killed the job
    assert daemon.job(held["id"])["state"] == "running"
    assert "; SIGKILL" not in daemon.log()  # "still running N s after stop; SIGKILL"
    before = daemon.job(busy["id"])["progress"]["items_done"]
    wait_for(lambda: daemon.job(busy["id"])["progress"]["items_done"] > before, 15,
             what=f"progress past {before} items after the step")  # still watched


@pytest.mark.timeout(90)
def test_a_backward_step_does_not_hold_a_restart_back(make_daemon, clock_file: Path) -> None:
    daemon: Daemon = make_daemon(env=faked(clock_file, JOBSUP_RESTART_BACKOFF_S="3"))
    job = daemon.submit(python_job("import sys; sys.exit(1)"), name="flaky",
                        restart_policy="on-failure", max_restarts=1)
    wait_for(lambda: daemon.job(job["id"])["restarts"] == 1, 15, what="the first failure")
    step(clock_file, -3600)  # an hour back, during the 3 s backoff
    # attempt 2 is recorded as it launches (`store.start_attempt`), before its processes
    # start. A backoff read off the stepped clock would hold it an hour (3,603 s); the
    # bound is the 3 s backoff and a few ticks, counted without the time the daemon waited
    # for a CPU (a 2-core CI box under a parallel suite took 6.6 s once)
    wait_for(lambda: daemon.job(job["id"])["attempt"] == 2, 12, what="the second attempt",
             cpu_wait=lambda: cpu_wait_s(daemon.proc.pid))
    done = daemon.wait_state(job["id"], "failed", timeout=30)
    assert done["attempt"] == 2, done


@pytest.mark.timeout(90)
def test_a_job_submitted_after_a_step_keeps_its_events_in_order(make_daemon,
                                                                 clock_file: Path) -> None:
    """A submit is stamped on the daemon's clock, as the job's later events are: stamped
    with the system clock, one hour ahead after this step, "submitted" sorted after the
    job's whole run (seen once in a full run as a restarted job's last event)."""
    daemon: Daemon = make_daemon(env=faked(clock_file))
    step(clock_file, +3600)
    job = daemon.submit(python_job("raise SystemExit(3)"), name="after-the-step")
    daemon.wait_state(job["id"], "failed")
    events = [(e["from_state"], e["to_state"]) for e in daemon.events(job["id"])]
    assert events[0] == (None, "pending") and events[-1] == ("running", "failed"), events
    shown = daemon.job(job["id"])
    assert shown["created_at"] <= shown["started_at"] <= shown["ended_at"], shown


@pytest.mark.parametrize("offset_s", [+7200, -7200])
@pytest.mark.timeout(90)
def test_a_job_stays_its_own_across_a_step_and_a_daemon_restart(
        make_daemon, clock_file: Path, tmp_path: Path, offset_s: int) -> None:
    """Two hours either way, then a daemon restart: the job's shim and worker are the
    processes recorded (pid, start ticks, boot id), whatever create time the moved
    `btime` gives them now. Before #46 the restarted daemon compared create times, two
    hours apart, past its one-hour limit for "another boot": `lost` at its first tick,
    the job running on unsupervised and a stop answered 409."""
    daemon: Daemon = make_daemon(env=faked(clock_file))
    job = daemon.submit(python_job(WAITS), name="steady")
    pid = wait_for(lambda: daemon.job(job["id"])["pid"], 15, what="worker started")
    daemon.wait_ticks(1)

    step(clock_file, offset_s)
    daemon.kill()
    daemon.wrapper = moved_boot_time(tmp_path, offset_s)
    daemon.start()
    daemon.wait_ticks(3)  # the restart's re-adoption and a few ticks of checks
    shown = daemon.job(job["id"])
    assert (shown["state"], shown["pid"], shown["attempt"]) == ("running", pid, 1), (
        shown["state"], shown["reason"], daemon.log()[-3000:])
    response = daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")
    assert response.status_code == 202, response.text

    def ended() -> dict[str, Any] | None:
        shown = daemon.job(job["id"])
        return shown if shown["state"] != "running" else None

    done = wait_for(ended, 20, what="the job's end",
                    cpu_wait=lambda: cpu_wait_s(daemon.proc.pid))
    assert (done["state"], done["signal"]) == ("stopped", 15), (done["state"], done["reason"])


@pytest.mark.timeout(90)
def test_a_restart_backoff_survives_a_backward_step_and_a_daemon_restart(
        make_daemon, clock_file: Path) -> None:
    """The job fails, the clock goes two hours back in its backoff, the daemon is killed
    and started again: the restart comes when the backoff is over, on the boot-time clock
    the next daemon continues (`clock.SteadyClock.of_boot`). Before #46 the new daemon
    took the stepped wall clock as its own, and the restart's due time, stored on the old
    one, lay two hours ahead: the job stayed `pending` for 2 h 0 min 8 s."""
    backoff_s = 8
    daemon: Daemon = make_daemon(env=faked(clock_file,
                                           JOBSUP_RESTART_BACKOFF_S=str(backoff_s)))
    job = daemon.submit(python_job("import sys; sys.exit(1)"), name="flaky",
                        restart_policy="on-failure", max_restarts=1)
    wait_for(lambda: daemon.job(job["id"])["restarts"] == 1, 15, what="the first failure")
    step(clock_file, -7200)
    daemon.kill()
    daemon.start()
    # the failure was at most a few ticks ago: the backoff and a few ticks bound the
    # second attempt, counted without the time the daemon waited for a CPU
    wait_for(lambda: daemon.job(job["id"])["attempt"] == 2, backoff_s + 4,
             what="the second attempt", cpu_wait=lambda: cpu_wait_s(daemon.proc.pid))
    events = [(e["from_state"], e["to_state"], datetime.fromisoformat(e["t"]))
              for e in daemon.events(job["id"])]
    failed = next(t for before, after, t in events if (before, after) == ("running", "pending"))
    relaunched = next(t for _, after, t in events if after == "running" and t > failed)
    waited_s = (relaunched - failed).total_seconds()  # both on the one clock of this boot
    assert backoff_s - 0.5 <= waited_s <= backoff_s + 6, (waited_s, events)
    done = daemon.wait_state(job["id"], "failed", timeout=30)
    assert done["attempt"] == 2, done


@pytest.mark.timeout(90)
def test_a_forward_step_then_a_daemon_restart_fires_no_stall(make_daemon,
                                                             clock_file: Path) -> None:
    """Two hours forward, then a daemon restart: the ages of the stall rules (since the
    start, since the last activity, since the last item) are read on the clock the
    stored times were taken on. Before #46 the new daemon's clock was two hours ahead of
    them: "no first item 2h00m after start", "no activity ... for 2h00m" at its first
    tick."""
    daemon: Daemon = make_daemon(env=faked(clock_file))
    warming = daemon.submit(python_job(WAITS), name="warming", startup_timeout_s=600)
    quiet = daemon.submit(python_job(WAITS), name="quiet", expected_items=10,
                          stall_timeout_s=60)
    busy = daemon.submit(job_module("progress_ticker"), name="busy", stall_timeout_s=30)
    for job in (warming, quiet, busy):
        wait_for(lambda j=job: daemon.job(j["id"])["pid"], 15, what="worker started")
    wait_for(lambda: (daemon.job(busy["id"])["progress"]["items_done"] or 0) > 2, 10,
             what="progress")
    daemon.wait_ticks(2)  # samples of every job stored

    step(clock_file, +7200)
    daemon.kill()
    daemon.start()
    daemon.wait_ticks(6)
    alerts = daemon.http.get("/api/v1/alerts").json()
    assert not [a["message"] for a in alerts if a["rule"] == "stalled"]
    for job in (warming, quiet, busy):
        assert daemon.job(job["id"])["state"] == "running"


@pytest.mark.timeout(90)
def test_a_job_ending_after_a_backward_step_ends_after_it_began(make_daemon,
                                                               clock_file: Path) -> None:
    """The shim stamps the end with the system clock, two hours behind the daemon's after
    this step: taken as it was (never later than the daemon's clock, so never moved
    forward, but moved back whole), the job ended two hours before it started."""
    daemon: Daemon = make_daemon(env=faked(clock_file))
    step(clock_file, -7200)
    job = daemon.submit(python_job("raise SystemExit(3)"), name="fails-after-the-step")
    done = daemon.wait_state(job["id"], "failed")
    began, ended = (datetime.fromisoformat(done[k]) for k in ("started_at", "ended_at"))
    assert 0 <= (ended - began).total_seconds() < 10, done
    wait_for(lambda: any(a["rule"] == "crashed" and a["job_id"] == job["id"]
                         for a in daemon.http.get("/api/v1/alerts").json()), 10,
             what="the crashed alert")
