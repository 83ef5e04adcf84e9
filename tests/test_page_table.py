"""The status page's jobs table at scale and in people's habits (#30, #32 items 5 and 12),
in the real headless Chromium against a real daemon: it pages (newest first), sorts by
column, searches names, shows duration and the command, fits 1440 px with a
128-character name and a 390 px phone with progress visible, and has Restart beside
Stop and a "restart all failed" (`POST /api/v1/jobs:restart`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests import test_page
from tests.helpers import Daemon, python_job, wait_for
from tests.test_page import Tab, metric_reporter, screenshot

browser, tab = test_page.browser, test_page.tab  # the fixtures, shared

pytestmark = pytest.mark.timeout(120)

LONG_NAME = "x" * 128
"""A name with no break point, the longest a spec allows."""


def row_ids(page: Any) -> list[str]:
    return page.eval_on_selector_all("#jobs tbody tr", "rows => rows.map(r => r.id.slice(4))")


def right_edges(page: Any) -> dict[str, float]:
    """The right edge of each header cell shown (by its text) and the page's scroll
    width, in CSS pixels."""
    return page.evaluate("""() => {
        const out = {};
        for (const th of document.querySelectorAll('#jobs thead th')) {
            const box = th.getBoundingClientRect();
            if (box.width > 0) out[th.textContent.trim() || 'actions'] = box.right;
        }
        out.scroll_width = Math.max(document.documentElement.scrollWidth,
                                    document.querySelector('#jobs').getBoundingClientRect().right);
        return out; }""")


def test_the_table_fits_1440_px_and_a_phone_with_a_128_character_name(
        daemon: Daemon, tab: Tab, tmp_path: Path) -> None:
    out = tmp_path / "out"
    writer = daemon.submit(metric_reporter(out, 10000, 0.2), name=LONG_NAME,
                           output_dir=str(out), pattern="item*.bin", expected_items=10000,
                           labels={"sweep": "y" * 100})["id"]
    daemon.submit(python_job("raise SystemExit(3)"), name="crasher")
    wait_for(lambda: daemon.job(writer)["forecast"]["eta_s"] is not None, 40,
             what="the writer's ETA")  # every column as wide as it gets
    page = tab.page
    page.set_viewport_size({"width": 1440, "height": 900})
    assert page.goto(daemon.url + "/").status == 200
    page.wait_for_function(f"() => document.querySelector('#job-{writer} .count')"
                           ".textContent.includes('/ 10000')")
    edges = right_edges(page)
    # before: the name pushed progress, rate, ETA, disk and alerts past the right edge
    assert edges["scroll_width"] <= 1440, edges
    for column in ("progress", "rate", "ETA", "disk runway", "alerts"):
        assert edges[column] <= 1440, (column, edges)
    name = page.locator(f"#job-{writer} a.name")
    assert name.get_attribute("title") == LONG_NAME  # the whole name, on hover
    assert page.evaluate("(el) => el.scrollWidth > el.clientWidth",
                         page.locator(f"#job-{writer} td.job .clip").element_handle())  # cut
    screenshot(page, "jobs-1440")

    page.set_viewport_size({"width": 390, "height": 844})
    page.reload()
    page.wait_for_selector(f"#job-{writer} .bar")
    phone = right_edges(page)
    assert phone["scroll_width"] <= 390, phone  # before: no @media rule, 1,800 px wide
    bar = page.locator(f"#job-{writer} .bar").bounding_box()
    assert bar is not None and bar["x"] >= 0 and bar["x"] + bar["width"] <= 390, bar
    assert page.locator(f"#job-{writer} .count").is_visible()
    screenshot(page, "jobs-390")
    assert tab.errors == []


def test_newest_first_sortable_searchable_with_duration_and_command(
        daemon: Daemon, tab: Tab) -> None:
    ids = {}
    for name in ("beta", "alpha", "gamma"):
        ids[name] = daemon.submit(["sleep", "0.2"], name=f"{name}-run")["id"]
        daemon.wait_state(ids[name], "succeeded")
    page = tab.page
    assert page.goto(daemon.url + "/").status == 200
    # before: oldest first, so a new failure sank to the bottom
    assert row_ids(page) == [ids["gamma"], ids["alpha"], ids["beta"]]
    headers = page.eval_on_selector_all("#jobs thead th", "ths => ths.map(t => t.textContent)")
    assert any("duration" in h for h in headers) and "command" in headers
    assert page.inner_text(f"#job-{ids['alpha']} code.command") == "sleep 0.2"
    assert page.inner_text(f"#job-{ids['alpha']} .col-duration").endswith("s")

    page.evaluate("window.__notReloaded = true")
    page.click("#jobs thead a.sort[data-sort=name]")
    page.wait_for_function(f"() => document.querySelector('#jobs tbody tr').id"
                           f" === 'job-{ids['alpha']}'")
    assert row_ids(page) == [ids["alpha"], ids["beta"], ids["gamma"]]
    assert "sort=name" in page.url
    page.click("#jobs thead a.sort[data-sort=name]")  # again: Z to A
    page.wait_for_function(f"() => document.querySelector('#jobs tbody tr').id"
                           f" === 'job-{ids['gamma']}'")
    page.fill("#filter-search", "ALPH")  # any case, a part of the name
    page.click("#filters button[type=submit]")
    page.wait_for_function("() => document.querySelectorAll('#jobs tbody tr').length === 1")
    assert row_ids(page) == [ids["alpha"]]
    assert page.evaluate("window.__notReloaded === true")
    page.goto(daemon.url + f"/?q={ids['beta'][:5]}")  # a part of the id, server-side
    assert row_ids(page) == [ids["beta"]]
    assert tab.errors == []


def test_restart_beside_stop_and_restart_all_failed(daemon: Daemon, tab: Tab) -> None:
    first = daemon.submit(python_job("raise SystemExit(2)"), name="fails-1")["id"]
    second = daemon.submit(python_job("raise SystemExit(2)"), name="fails-2")["id"]
    running = daemon.submit(["sleep", "60"], name="runs")["id"]
    for job_id in (first, second):
        daemon.wait_state(job_id, "failed")
    daemon.wait_state(running, "running")
    page = tab.page
    assert page.goto(daemon.url + "/").status == 200
    assert page.inner_text(f"#job-{running} button[data-action]") == "Stop"
    page.click(f"#job-{first} button[data-action=restart]")  # before: no such button
    wait_for(lambda: daemon.job(first)["attempt"] == 2, 20, what="the first's second attempt")
    daemon.wait_state(first, "failed")
    page.evaluate("document.querySelector('#action-result').textContent = ''")
    page.click("#restart-failed")
    page.wait_for_function("() => document.querySelector('#action-result').textContent")
    assert page.inner_text("#action-result") == "2 failed job(s) restarted"
    wait_for(lambda: daemon.job(second)["attempt"] == 2 and daemon.job(first)["attempt"] == 3,
             20, what="both failed jobs restarted")
    page.click(f"#job-{running} button[data-action=stop]")
    daemon.wait_state(running, "stopped")
    # the route itself: only ended jobs of the state asked, 202 with what it restarted
    answer = daemon.http.post("/api/v1/jobs:restart", params={"state": "stopped"})
    assert answer.status_code == 202 and [j["id"] for j in answer.json()] == [running]
    assert tab.errors == []


def test_the_table_pages_through_many_jobs(daemon: Daemon, tab: Tab) -> None:
    blocker = daemon.submit(["sleep", "60"], name="blocker")["id"]
    waiting = [daemon.submit(["true"], name=f"waiting-{i:03d}", depends_on=[blocker])["id"]
               for i in range(104)]
    page = tab.page
    assert page.goto(daemon.url + "/").status == 200
    rows = row_ids(page)
    assert len(rows) == 100 and rows[0] == waiting[-1]  # before: all 105 at once
    assert "1–100 of 105 jobs" in page.inner_text("#summary")
    page.click("#page-older")
    page.wait_for_function("() => document.querySelectorAll('#jobs tbody tr').length === 5")
    assert row_ids(page) == [*reversed(waiting[:4]), blocker]
    assert "page=2" in page.url and "101–105 of 105" in page.inner_text("#summary")
    page.click("#page-newer")
    page.wait_for_function("() => document.querySelectorAll('#jobs tbody tr').length === 100")
    assert tab.errors == []


def test_a_pipeline_submitted_after_a_view_is_listed_at_the_next(daemon: Daemon) -> None:
    """The pipelines' names are kept between views of `/` while no job is added (#30: a
    search of every stored spec each view); a job that is added shows its pipeline."""
    blocker = daemon.submit(["sleep", "60"], name="blocker")["id"]
    first = daemon.http.get("/")
    assert first.status_code == 200 and "/pipelines/" not in first.text
    daemon.submit(["true"], name="sweep-generate", depends_on=[blocker],
                  labels={"pipeline": "eagle3", "pipeline_name": "sweep", "step": "generate"})
    for route in ("/", "/fragments/jobs"):
        assert 'href="/pipelines/sweep"' in daemon.http.get(route).text, route
