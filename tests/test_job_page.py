"""The job page (#32 item 10) and what every page shares: the run's facts (command, cwd,
dependencies, times, exit), the Restart button and earlier attempts' logs, the banner of
a daemon gone, the summary's firing alerts, a one-sample chart, /docs with the login's
cookie. A real daemon and headless Chromium (the `browser`/`tab` fixtures of
tests/test_page.py)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from supervisor.api.guard import SESSION_COOKIE
from tests import test_page
from tests.helpers import Daemon, job_module, python_job, wait_for
from tests.test_page import TOKEN, Tab

pytestmark = pytest.mark.slow

browser = test_page.browser  # the fixtures, under their own names (pytest finds them so)
tab = test_page.tab


def counter_job(counter: Path) -> list[str]:
    """Fails its first run (exit 3), succeeds the next; each prints its run's number."""
    return python_job(
        "import pathlib, sys\n"
        f"p = pathlib.Path({str(counter)!r})\n"
        "n = int(p.read_text()) + 1 if p.exists() else 1\n"
        "p.write_text(str(n))\n"
        "print(f'this is run {n}')\n"
        "sys.exit(3 if n == 1 else 0)\n")


def test_job_page_shows_the_run_restarts_it_and_keeps_earlier_attempts_logs(
        daemon: Daemon, tab: Tab, tmp_path: Path) -> None:
    first = daemon.submit(counter_job(tmp_path / "count"), name="flaky step",
                          cwd=str(tmp_path))
    later = daemon.submit(python_job("print('after')"), name="next step",
                          depends_on=[first["id"]])
    daemon.wait_state(first["id"], "failed")
    daemon.wait_state(later["id"], "failed")
    page = tab.page

    # the start of an id (or a name) opens the job's page at its id
    answer = page.goto(f"{daemon.url}/jobs/{first['id'][:5]}")
    assert answer.status == 200 and page.url == f"{daemon.url}/jobs/{first['id']}"
    run = page.locator("#job-run")
    assert "this is run" in run.inner_text() and "sys.exit" in run.inner_text()  # command
    assert str(tmp_path) in run.inner_text()  # cwd
    assert "depends on nothing" in run.inner_text()
    assert page.inner_text("#job-exit").startswith("exit code 3")
    assert re.search(r"ended \S", run.inner_text()) and "ended -" not in run.inner_text()
    assert page.inner_text("#job-duration") not in ("", "-")
    assert page.is_disabled("#stop") and page.is_enabled("#restart")

    page.goto(f"{daemon.url}/jobs/{later['id']}")
    link = page.locator("#job-run a")
    assert link.inner_text() == "flaky step"
    assert link.get_attribute("href") == f"/jobs/{first['id']}"
    assert "failed" in page.inner_text("#job-run")  # the dependency's state beside it
    assert page.is_disabled("#restart") is False

    page.goto(f"{daemon.url}/jobs/{first['id']}")
    page.wait_for_function("() => document.getElementById('log').textContent"
                           ".includes('this is run 1')", timeout=10000)
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#restart")
    page.wait_for_function("() => document.getElementById('job-state').textContent"
                           " === 'succeeded'", timeout=20000)
    page.wait_for_function("() => document.getElementById('log').textContent"
                           ".includes('this is run 2')", timeout=10000)
    assert page.inner_text("#job-exit").startswith("exit code 0")
    assert daemon.job(first["id"])["attempt"] == 2
    # the earlier attempt's log, chosen in the select that gained the new attempt
    page.wait_for_function("() => document.querySelectorAll('#log-attempt option').length"
                           " === 3", timeout=10000)
    page.select_option("#log-attempt", "1")
    page.wait_for_function("() => document.getElementById('log').textContent"
                           ".includes('this is run 1')", timeout=10000)
    assert "this is run 2" not in page.inner_text("#log")
    page.select_option("#log-attempt", "")
    page.wait_for_function("() => document.getElementById('log').textContent"
                           ".includes('this is run 2')", timeout=10000)
    assert page.is_disabled("#stop") and page.is_enabled("#restart")
    assert not tab.errors, tab.errors


def test_a_daemon_gone_is_a_banner_not_a_fade(daemon: Daemon, tab: Tab) -> None:
    job = daemon.submit(python_job("import time; time.sleep(600)"), name="long")
    page = tab.page
    page.goto(f"{daemon.url}/jobs/{job['id']}")
    assert not page.is_visible("#offline")
    daemon.stop()
    page.wait_for_selector("#offline", state="visible", timeout=10000)
    assert "does not answer" in page.inner_text("#offline")
    assert page.evaluate("getComputedStyle(document.querySelector('main')).opacity") == "1"
    daemon.start()
    page.wait_for_selector("#offline", state="hidden", timeout=15000)
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")


def test_the_summary_counts_firing_alerts(daemon: Daemon, tab: Tab) -> None:
    crash = daemon.submit(python_job("raise SystemExit(2)"), name="crasher")
    daemon.submit(python_job("pass"), name="fine")
    daemon.wait_state(crash["id"], "failed")
    wait_for(lambda: daemon.job(crash["id"])["alerts"], 15, what="the crashed alert")
    tab.page.goto(daemon.url + "/")
    assert tab.page.inner_text("#firing") == "1 alert firing"


def test_a_chart_of_one_sample_spans_minutes_not_years(make_daemon: Callable[..., Daemon],
                                                       tab: Tab, tmp_path: Path) -> None:
    # a sample a minute, and a job that runs on: one sample, taken by the tick a submit
    # wakes (a job waiting on it, so no exit wakes another). A job of 4 s, sampled only by
    # the tick its exit woke, had none when that tick found its processes gone (load)
    daemon = make_daemon(env={"JOBSUP_SAMPLE_INTERVAL": "60"})
    job = daemon.submit(job_module("waits_for_file", tmp_path / "never"), name="brief")
    daemon.wait_state(job["id"], "running")
    daemon.submit(python_job("pass"), name="after", depends_on=[job["id"]])

    def samples() -> list[dict] | None:
        return daemon.http.get(f"/api/v1/jobs/{job['id']}/samples").json() or None

    assert len(wait_for(samples, 75, what="the job's sample")) == 1
    page = tab.page
    page.goto(f"{daemon.url}/jobs/{job['id']}")
    page.wait_for_function("() => (window.jobsup?.samples?.length ?? 0) === 1", timeout=10000)
    span_s = page.evaluate("(() => { const x = window.jobsup.charts.items.scales.x;"
                           " return x.max - x.min; })()")
    assert 0 < span_s <= 3600, span_s  # was 2027-2029 around a sample of today
    daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")


def test_docs_open_with_the_logins_cookie(make_daemon: Callable[..., Daemon],
                                          tab: Tab) -> None:
    """/docs after logging in: it answered 401 (bearer only, as its script came from a
    CDN); now Swagger UI is served from the daemon's files and the cookie opens it."""
    daemon = make_daemon(env={"JOBSUP_TOKEN": TOKEN})
    page = tab.page
    assert page.goto(f"{daemon.url}/docs").status == 401  # the login form, back to /docs
    page.fill("#token", TOKEN)
    page.click("form#login button")
    page.wait_for_selector(".swagger-ui .info .title", timeout=20000)
    assert page.url == f"{daemon.url}/docs"
    assert "jobsup" in page.inner_text(".swagger-ui .info .title")
    page.get_by_text("/api/v1/jobs/{job_id}/restart").first.wait_for(timeout=10000)
    tab.errors.clear()  # the login form's 401 was expected
    page.reload()
    page.wait_for_selector(".swagger-ui .info .title", timeout=20000)
    assert not tab.errors, tab.errors  # no CSP refusal, nothing failed to load
    assert all(url.startswith(daemon.url) or url.startswith("data:") for url in tab.urls), \
        [u for u in tab.urls if not u.startswith(daemon.url)]
    (cookie,) = [c for c in tab.context.cookies() if c["name"] == SESSION_COOKIE]
    session = {cookie["name"]: cookie["value"]}
    assert httpx.get(f"{daemon.url}/docs", cookies=session).status_code == 200
    assert httpx.get(f"{daemon.url}/docs").status_code == 401
    assert httpx.get(f"{daemon.url}/redoc", cookies=session).status_code == 401


