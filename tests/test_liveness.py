"""/healthz says whether the engine loop still ticks, not only that the HTTP server
answers: a loop blocked in I/O turns it 503 within seconds, and 200 once unblocked."""

from __future__ import annotations

import sqlite3
import time

import httpx
import pytest

from supervisor.api.routes import tick_stalled_after_s
from tests.helpers import Daemon, python_job, wait_for

pytestmark = pytest.mark.slow

INTERVAL = 0.5  # JOBSUP_SAMPLE_INTERVAL of the test daemon
STALLED_AFTER = tick_stalled_after_s(INTERVAL)


def health(daemon: Daemon) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = daemon.http.get("/healthz", timeout=2)
    return response, time.monotonic() - started


def test_healthz_turns_503_while_the_engine_is_blocked(daemon: Daemon) -> None:
    job = daemon.submit(python_job("import time; time.sleep(600)"))
    daemon.wait_state(job["id"], "running")
    response, _ = health(daemon)
    assert response.status_code == 200
    assert response.json()["status"] == "ok"
    assert 0 <= response.json()["last_tick_age_s"] < STALLED_AFTER
    tick_gauge = next(line for line in daemon.http.get("/metrics").text.splitlines()
                      if line.startswith("jobsup_last_tick_timestamp_seconds "))
    assert abs(float(tick_gauge.split()[1]) - time.time()) < STALLED_AFTER

    # Hold the database's write lock: the engine's next write waits out SQLite's busy
    # timeout (10 s), fails, and the next waits again. The API's reads go on (WAL).
    lock = sqlite3.connect(daemon.data_dir / "jobsup.db", timeout=5, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        locked_at = time.monotonic()

        def stalled() -> httpx.Response | None:
            answer, took = health(daemon)
            assert took < 1, f"/healthz took {took:.1f} s"
            return answer if answer.status_code == 503 else None

        answer = wait_for(stalled, STALLED_AFTER + 5, interval=0.2, what="/healthz 503")
        assert time.monotonic() - locked_at < STALLED_AFTER + 5
        body = answer.json()
        assert body["status"] == "stalled"
        assert STALLED_AFTER < body["last_tick_age_s"] < STALLED_AFTER + 5
        assert "has not finished a tick" in body["error"] and "Restarting" in body["hint"]
        # It stays 503 while the lock is held, also right after a tick that waited out
        # the busy timeout finished (its age drops): such ticks finish, yet supervise
        # nothing, and their duration counts. Watched until 2 s past such a tick.
        ages: list[float] = []
        deadline = time.monotonic() + 40
        ticked_at = None
        while ticked_at is None or time.monotonic() < ticked_at + 2:
            assert time.monotonic() < deadline, f"no tick finished under the lock: {ages}"
            answer, took = health(daemon)
            assert answer.status_code == 503 and took < 1, (answer.text, took, ages)
            ages.append(answer.json()["last_tick_age_s"])
            if ticked_at is None and len(ages) > 1 and ages[-1] < ages[-2]:
                ticked_at = time.monotonic()
                assert answer.json()["last_tick_duration_s"] > STALLED_AFTER
            time.sleep(0.2)
        listed = daemon.http.get("/api/v1/jobs")  # reads still answer meanwhile
        assert listed.status_code == 200
    finally:
        lock.rollback()
        lock.close()
    released_at = time.monotonic()
    wait_for(lambda: health(daemon)[0].status_code == 200, 15, interval=0.2,
             what="/healthz 200 after the lock is released")
    assert time.monotonic() - released_at < 12
    assert daemon.job(job["id"])["state"] == "running"
