"""Slack down for a minute (six times the backoff cap), then back: every alert arrives, in
order, at most 1/s. (Two minutes until 2026-12-02: a minute shows the same retries and
saves one in the suite.)"""

from __future__ import annotations

import time

import pytest

from tests.helpers import Daemon, Receiver, python_job, wait_for

pytestmark = pytest.mark.slow

OUTAGE_S = 60.0


@pytest.mark.timeout(240)
def test_alerts_survive_a_one_minute_outage(make_daemon, receiver: Receiver) -> None:
    receiver.down_until = time.time() + OUTAGE_S
    # the backoff cap bounds how long after the outage the first retry comes
    daemon: Daemon = make_daemon(env={"JOBSUP_SLACK_WEBHOOK_URL": receiver.url,
                                      "JOBSUP_NOTIFY_ON_SUCCESS": "false",
                                      "JOBSUP_NOTIFY_BACKOFF_MAX_S": "10"})
    names = [f"crash-{i}" for i in range(6)]
    for name in names:  # crashes spread over the outage
        job = daemon.submit(python_job("import sys; sys.exit(1)"), name=name)
        daemon.wait_state(job["id"], "failed")
        time.sleep(4)
    assert receiver.posts == [] and len(receiver.attempts) >= 3  # tried, refused
    wait_for(lambda: len(receiver.posts) == len(names), OUTAGE_S + 60, interval=0.5,
             what="every alert after the outage")
    assert receiver.posts[0][0] >= receiver.down_until
    order = [next(n for n in names if f" {n} " in f" {text} ") for text in receiver.texts()]
    assert order == names  # in the order they fired
    times = [t for t, _ in receiver.posts]
    assert min(b - a for a, b in zip(times, times[1:], strict=False)) >= 0.95  # <= 1/s
    time.sleep(3)
    assert len(receiver.posts) == len(names)  # exactly once each
