"""/metrics stays bounded with thousands of jobs (#30: 5.6 MB a scrape at 10,000 jobs):
only the most recently ended `JOBSUP_METRICS_ENDED_MAX` and the first
`JOBSUP_METRICS_PENDING_MAX` pending jobs keep their per-job series, and
`jobsup_jobs{state}` still counts every job. A real daemon over loopback."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from tests.helpers import Daemon, wait_for

pytestmark = pytest.mark.timeout(90)


def test_only_the_most_recently_ended_jobs_keep_their_series(
        make_daemon: Callable[..., Daemon]) -> None:
    daemon = make_daemon(env={"JOBSUP_METRICS_ENDED_MAX": "3",
                              "JOBSUP_METRICS_PENDING_MAX": "2"})
    ended = []
    for i in range(5):  # one after another: each ends after the one before
        ended.append(daemon.submit(["true"], name=f"done-{i}")["id"])
        daemon.wait_state(ended[-1], "succeeded")
    running = daemon.submit(["sleep", "60"], name="runs")["id"]
    daemon.wait_state(running, "running")
    waiting = [daemon.submit(["true"], name=f"waits-{i}", depends_on=[running])["id"]
               for i in range(4)]

    def scraped() -> str:
        return daemon.http.get("/metrics").text

    text = wait_for(lambda: (t := scraped()) and 'jobsup_jobs{state="running"} 1.0' in t and t,
                    15, what="the running job counted")
    with_series = set(re.findall(r'jobsup_job_state\{job_id="([0-9a-f]+)"', text))
    # before: every job that ended within the hour, and every pending job, had series
    assert with_series == {*ended[-3:], running, *waiting[:2]}, (with_series, ended, waiting)
    assert 'jobsup_jobs{state="succeeded"} 5.0' in text  # all of them counted
    assert 'jobsup_jobs{state="pending"} 4.0' in text
