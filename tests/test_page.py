"""The status page (issue #17) in a real headless Chromium (Debian's `chromium`, installed
by dev.sh), driven by Playwright, against a real daemon over loopback.

Screenshots go to build/screenshots/ (gitignored); with JOBSUP_UPDATE_SCREENSHOTS=1 also
to docs/img/ (the README's)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import sync_playwright

from supervisor.api.guard import SESSION_COOKIE, session_valid, session_value
from supervisor.api.metrics import mountpoint
from supervisor.api.page import safe_next
from tests.helpers import PY, REPO, Daemon, free_port, python_job, wait_for
from tests.test_page_never_fails import NOT_SHOWN, make_jobs

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = REPO / "build" / "screenshots"
TOKEN = "page-token-0123456789abcdef0123456789"
TICKER = [PY, str(REPO / "tests" / "jobs" / "progress_ticker.py")]


def metric_reporter(out: Path, n: int, delay: float) -> list[str]:
    return [PY, str(REPO / "tests" / "jobs" / "metric_reporter.py"), str(out), str(n),
            str(delay)]


# -- the browser ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    assert Path(CHROMIUM).exists(), "chromium is missing: ./dev.sh test installs it (apt)"
    with sync_playwright() as p:
        args = ["--no-sandbox"] if os.geteuid() == 0 else []  # root in containers
        launched = p.chromium.launch(executable_path=CHROMIUM, args=args)
        yield launched
        launched.close()


@dataclass
class Tab:
    """A page in a fresh browser context, with every console error, page error and
    requested URL recorded."""

    page: Any
    context: Any
    errors: list[str] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)


@pytest.fixture
def tab(browser: Any) -> Iterator[Tab]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    opened = Tab(page, context)
    page.on("console", lambda m: opened.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: opened.errors.append(str(e)))
    page.on("request", lambda r: opened.urls.append(r.url))
    yield opened
    context.close()


def screenshot(page: Any, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
    if os.environ.get("JOBSUP_UPDATE_SCREENSHOTS") == "1":
        (REPO / "docs" / "img").mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(REPO / "docs" / "img" / f"status-{name}.png"),
                        full_page=False)


def count_of(page: Any, job_id: str) -> int:
    text = page.inner_text(f"#job-{job_id} .count")
    return int(text.split("/")[0].strip())


# -- the jobs page -------------------------------------------------------------------------

@pytest.mark.slow
def test_jobs_page_updates_live_and_shows_a_crash(daemon: Daemon, tab: Tab,
                                                  tmp_path: Path) -> None:
    tick = daemon.submit(TICKER, name="ticker", labels={"team": "vision"})["id"]
    crash = daemon.submit(python_job("print('boom'); raise SystemExit(3)"), name="crasher",
                          labels={"team": "nlp"})["id"]
    out = tmp_path / "out"
    writer = daemon.submit(metric_reporter(out, 300, 0.2), name="writer", output_dir=str(out),
                           pattern="item*.bin", expected_items=300)["id"]
    daemon.wait_state(crash, "failed")
    wait_for(lambda: daemon.job(crash)["alerts"], 15, what="the crashed alert")
    wait_for(lambda: (daemon.job(tick)["progress"]["items_done"] or 0) >= 1, 15,
             what="the ticker's first step")
    wait_for(lambda: daemon.job(writer)["forecast"]["disk_free_bytes"], 15,
             what="the writer's disk figures")

    page = tab.page
    answer = page.goto(daemon.url + "/")
    assert answer.status == 200
    page.evaluate("window.__notReloaded = true")
    first = count_of(page, tick)
    # the ticker advances by about 3 a second; the table follows without a reload
    page.wait_for_function(
        f"() => parseInt(document.querySelector('#job-{tick} .count').textContent) > {first}",
        timeout=8000)
    assert page.evaluate("window.__notReloaded === true && window.jobsup.refreshes >= 1")
    assert count_of(page, tick) > first

    crashed = page.locator(f"#job-{crash}")
    assert crashed.locator(".state").inner_text() == "failed"
    assert crashed.locator(".alert").inner_text() == "crashed"
    assert "exited with code 3" in (crashed.locator(".alert").get_attribute("title") or "")
    running = page.locator(f"#job-{writer}")
    assert "/ 300" in running.locator(".count").inner_text()
    assert "free" in running.inner_text() and "/s" in running.inner_text()
    # the writer's filesystem's runway
    assert page.inner_text("#filesystems tbody td code") == mountpoint(str(out))
    screenshot(page, "jobs")

    # filters by state and by label, without a reload
    page.select_option("#filter-state", "failed")
    page.wait_for_function("() => document.querySelectorAll('#jobs tbody tr').length === 1")
    assert page.locator("#jobs tbody tr").get_attribute("id") == f"job-{crash}"
    assert page.url.endswith("/?state=failed")
    page.select_option("#filter-state", "")
    page.fill("#filter-label", "team=vision")
    page.click("#filters button[type=submit]")
    page.wait_for_function(f"() => {{ const rows = document.querySelectorAll('#jobs tbody tr');"
                           f" return rows.length === 1 && rows[0].id === 'job-{tick}'; }}")
    assert page.evaluate("window.__notReloaded === true")
    # the filtered URL, opened afresh, renders the same rows server-side
    page.goto(daemon.url + "/?state=failed")
    assert page.locator("#jobs tbody tr").count() == 1
    assert tab.errors == []
    assert all(url.startswith(daemon.url + "/") for url in tab.urls), tab.urls  # offline


# -- one job's page ------------------------------------------------------------------------

class CrossSite:
    """Another origin (a second loopback port) serving one hostile HTML page."""

    def __init__(self, html: str) -> None:
        body = html.encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_selection_survives_the_live_refresh(daemon: Daemon, tab: Tab,
                                               tmp_path: Path) -> None:
    """An ended job's id, selected to be copied, stays selected while the table refreshes
    around it with a running job's progress (#32 item 3: the refresh replaced the whole
    fragment every 2 s and the selection went with it)."""
    ended = daemon.submit(python_job("raise SystemExit(3)"), name="ended-one")["id"]
    daemon.wait_state(ended, "failed")
    out = tmp_path / "out"
    writer = daemon.submit(metric_reporter(out, 600, 0.1), name="writer", output_dir=str(out),
                           pattern="item*.bin", expected_items=600)["id"]
    wait_for(lambda: (daemon.job(writer)["progress"]["items_done"] or 0) >= 1, 20,
             what="the writer's first item")
    page = tab.page
    assert page.goto(daemon.url + "/").status == 200
    page.wait_for_function("() => window.jobsup.refreshes >= 1")
    selected = page.evaluate("""(id) => {
        const code = document.querySelector('#job-' + id + ' code.id');
        const range = document.createRange(); range.selectNodeContents(code);
        const selection = window.getSelection();
        selection.removeAllRanges(); selection.addRange(range);
        return selection.toString(); }""", ended)
    assert selected == ended
    before = count_of(page, writer)
    start = page.evaluate("window.jobsup.refreshes")
    page.wait_for_function(f"() => window.jobsup.refreshes >= {start + 2}", timeout=20000)
    wait_for(lambda: count_of(page, writer) > before, 20, what="the writer's count moving")
    assert page.evaluate("window.getSelection().toString()") == ended
    assert not tab.errors, tab.errors


def test_job_page_log_shows_text_not_colour_codes_or_nul(daemon: Daemon, tab: Tab) -> None:
    """A coloured log line with a NUL and a window-title escape in it reads as its words in
    the log pane (#32 item 8); the API's /logs keeps the bytes (a terminal shows them)."""
    job_id = daemon.submit(python_job(
        "import time; print('\\x1b[1;32mready\\x1b[0m \\x1b]0;title\\x07step\\x00 7',"
        " flush=True); time.sleep(60)"), name="colourful")["id"]
    wait_for(lambda: "ready" in daemon.http.get(f"/api/v1/jobs/{job_id}/logs").text, 20,
             what="the line in the log")
    assert "\x1b[1;32m" in daemon.http.get(f"/api/v1/jobs/{job_id}/logs").text
    page = tab.page
    assert page.goto(f"{daemon.url}/jobs/{job_id}").status == 200
    page.wait_for_function("() => document.getElementById('log').textContent.includes('step')")
    shown = page.evaluate("document.getElementById('log').textContent")
    assert "ready step 7" in shown, repr(shown)
    assert not set(shown) & {"\x1b", "\x00", "\x07"}, repr(shown)
    assert not tab.errors, tab.errors
    daemon.http.post(f"/api/v1/jobs/{job_id}/stop")


@pytest.mark.slow
def test_job_page_charts_logs_and_stop(daemon: Daemon, tab: Tab, browser: Any,
                                       tmp_path: Path) -> None:
    out = tmp_path / "out"
    job_id = daemon.submit(metric_reporter(out, 600, 0.1), name="reporter",
                           output_dir=str(out), pattern="item*.bin", expected_items=600)["id"]
    samples_url = f"/api/v1/jobs/{job_id}/samples"
    wait_for(lambda: len(daemon.http.get(samples_url).json()) >= 4, 20, what="4 samples")

    page = tab.page
    assert page.goto(f"{daemon.url}/jobs/{job_id}").status == 200
    page.wait_for_function("() => (window.jobsup?.samples?.length ?? 0) >= 4")
    # the chart holds exactly the stored samples: same times, same item counts (read
    # from the API after the chart, so that every sample drawn is there)
    drawn = page.evaluate("""() => ({
        t: window.jobsup.samples.map(s => s.t),
        x: Array.from(window.jobsup.charts.items.data[0]),
        items: Array.from(window.jobsup.charts.items.data[1]),
        bytes: Array.from(window.jobsup.charts.bytes.data[1]),
        rss: Array.from(window.jobsup.charts.cpu.data[2]) })""")
    stored = {s["t"]: s for s in daemon.http.get(samples_url, params={"limit": 5000}).json()}
    assert len(drawn["x"]) == len(drawn["t"]) >= 4
    for t, x, items, written in zip(drawn["t"], drawn["x"], drawn["items"], drawn["bytes"],
                                    strict=True):
        assert t in stored, t
        assert x == pytest.approx(time_of(t), abs=1e-3)
        assert (items, written) == (stored[t]["items_done"], stored[t]["bytes_written"])
    assert max(i or 0 for i in drawn["items"]) > 0 and max(drawn["rss"]) > 0
    # the canvas has lines on it, not only a blank plot area
    inked = page.evaluate("""() => {
        const c = document.querySelector('#chart-items canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; }""")
    assert inked > 500
    # the worker's metrics, charted as the page polls; the log tail
    page.wait_for_function("() => window.jobsup.charts.metrics !== null"
                           " && window.jobsup.charts.metrics.data[0].length >= 2", timeout=10000)
    names = page.evaluate("window.jobsup.charts.metrics.series.slice(1).map(s => s.label)")
    assert names == ["accuracy", "loss"]
    page.wait_for_function(
        "() => document.getElementById('log').textContent.includes('step 5/600')")
    assert "loss" in page.inner_text("#job-summary")
    screenshot(page, "job")

    # a cross-origin POST, from a real page of another origin in the same browser, does
    # not stop it; nor does one from a script
    target = f"{daemon.url}/api/v1/jobs/{job_id}/stop"
    other = CrossSite(f"""<!doctype html><html><body>
<form id="f" method="post" action="{target}" enctype="text/plain">
<input name="x" value="y"></form>
<script>fetch("{target}", {{method: "POST", mode: "no-cors"}}).finally(
  () => document.getElementById("f").submit());</script></body></html>""")
    try:
        hostile = browser.new_page()
        hostile.goto(other.url)
        hostile.wait_for_url(f"{daemon.url}/**", timeout=5000)  # the form was sent
        assert "not allowed" in hostile.content()
        hostile.close()
    finally:
        other.close()
    # nor can another site frame the page to trick a click on its Stop button
    framing = CrossSite(f'<!doctype html><iframe id="f" src="{daemon.url}/jobs/{job_id}">'
                        '</iframe>')
    try:
        hostile = browser.new_page()
        hostile.goto(framing.url)
        hostile.wait_for_timeout(1000)
        framed = hostile.frames[1] if len(hostile.frames) > 1 else None
        assert framed is None or framed.evaluate("document.getElementById('stop')") is None
        hostile.close()
    finally:
        framing.close()
    headers = daemon.http.get(f"/jobs/{job_id}").headers
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY"
    refused = daemon.http.post(f"/api/v1/jobs/{job_id}/stop",
                               headers={"Origin": "http://evil.example"})
    assert refused.status_code == 403
    time.sleep(1.0)
    assert daemon.job(job_id)["state"] == "running"
    assert [e["to_state"] for e in daemon.events(job_id)] == ["pending", "running"]

    # the Stop button works, and the page shows the end without a reload
    page.evaluate("window.__notReloaded = true")
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#stop")
    daemon.wait_state(job_id, "stopped", timeout=20)
    page.wait_for_function("() => document.getElementById('job-state').textContent === 'stopped'",
                           timeout=8000)
    assert page.is_disabled("#stop")
    assert page.evaluate("window.__notReloaded === true")
    assert tab.errors == []
    assert all(url.startswith(daemon.url + "/") for url in tab.urls), tab.urls  # offline


def time_of(iso_text: str) -> float:
    from supervisor.formatting import from_iso

    value = from_iso(iso_text)
    assert value is not None
    return value


# -- with a token --------------------------------------------------------------------------

@pytest.mark.slow
def test_with_a_token_the_page_asks_for_it(make_daemon: Callable[..., Daemon],
                                           tab: Tab) -> None:
    daemon = make_daemon(env={"JOBSUP_TOKEN": TOKEN})
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    answer = daemon.http.post("/api/v1/jobs", headers=bearer,
                              json={"name": "guarded", "command": TICKER})
    job_id = answer.json()["id"]
    page = tab.page

    # no cookie: the page asks for the token; the API stays closed to the page
    first = page.goto(f"{daemon.url}/jobs/{job_id}")
    assert first.status == 401
    assert page.locator("form#login input[type=password]").count() == 1
    assert page.locator("#job-summary").count() == 0
    assert page.evaluate("fetch('/api/v1/jobs').then(r => r.status)") == 401
    assert page.evaluate(f"fetch('/fragments/jobs/{job_id}').then(r => r.status)") == 401

    page.fill("#token", "wrong-token")
    page.click("form#login button")
    page.wait_for_selector("#login-error")
    assert page.locator("#job-summary").count() == 0

    page.fill("#token", TOKEN)
    page.click("form#login button")
    page.wait_for_selector("#job-summary")
    assert page.url == f"{daemon.url}/jobs/{job_id}"  # back where it was asked for
    tab.errors.clear()  # the 401s above were expected
    page.wait_for_function(
        "() => (window.jobsup?.refreshes ?? 0) >= 1"  # page.js may not have run yet
        " && (window.jobsup?.samples?.length ?? 0) >= 1",
        timeout=10000)
    (cookie,) = [c for c in tab.context.cookies() if c["name"] == SESSION_COOKIE]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/"
    assert TOKEN not in cookie["value"]
    assert page.evaluate("document.cookie") == ""  # HttpOnly: scripts never see it
    assert page.evaluate("fetch('/api/v1/jobs').then(r => r.status)") == 200
    assert page.evaluate("fetch('/openapi.json').then(r => r.status)") == 200
    # /docs too (its Swagger UI is the daemon's own files), but not /redoc: ReDoc's script
    # comes from a CDN (guard.BEARER_ONLY_PATHS)
    session = {cookie["name"]: cookie["value"]}
    assert httpx.get(f"{daemon.url}/openapi.json", cookies=session).status_code == 200
    assert httpx.get(f"{daemon.url}/docs", cookies=session).status_code == 200
    assert httpx.get(f"{daemon.url}/redoc", cookies=session).status_code == 401

    # the cookie opens the API to other clients too, while it is valid and untampered
    def with_cookie(value: str) -> dict[str, str]:
        return {"Cookie": f"{SESSION_COOKIE}={value}"}

    with httpx.Client(base_url=daemon.url, timeout=10) as client:
        assert client.get("/api/v1/jobs", headers=with_cookie(cookie["value"])).status_code \
            == 200
        for bad in (cookie["value"][:-1] + ("0" if cookie["value"][-1] != "0" else "1"),
                    session_value(TOKEN, int(time.time()) - 1),
                    session_value("another-token", int(time.time()) + 3600), "", "x.y"):
            assert client.get("/api/v1/jobs", headers=with_cookie(bad)).status_code == 401
        # a cross-origin login is refused before the token is looked at: no cookie
        forged = client.post("/login", content=f"token={TOKEN}&next=/",
                             headers={"Origin": "http://evil.example",
                                      "Content-Type": "application/x-www-form-urlencoded"})
        assert forged.status_code == 403 and "set-cookie" not in forged.headers

    # the page's own POST (Stop) goes through with the cookie
    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#stop")
    wait_for(lambda: daemon.http.get(f"/api/v1/jobs/{job_id}", headers=bearer).json()["state"]
             == "stopped", 20, what="the job stopped")
    assert tab.errors == []
    assert not any(TOKEN in url for url in tab.urls), "the token appeared in a URL"
    assert TOKEN not in page.url

    # logging out ends the session in this browser
    page.click("header .logout button")
    page.wait_for_selector("form#login")
    assert not [c for c in tab.context.cookies() if c["name"] == SESSION_COOKIE]


def test_session_cookie_rules() -> None:
    now = 1_800_000_000.0
    value = session_value(TOKEN, int(now) + 60)
    assert session_valid(TOKEN, value, now)
    assert TOKEN not in value
    assert not session_valid(TOKEN, value, now + 61)  # expired
    assert not session_valid("other", value, now)
    expires, _, mac = value.partition(".")
    assert not session_valid(TOKEN, f"{int(expires) + 3600}.{mac}", now)  # extended
    for bad in ("", ".", "x", f"{expires}.", f"{expires}.{mac}0", f"-1.{mac}", "é.é",
                "9" * 13 + "." + mac):
        assert not session_valid(TOKEN, bad, now), bad


def test_login_returns_only_to_this_site() -> None:
    assert safe_next("/jobs/abc?x=1") == "/jobs/abc?x=1"
    for bad in ("//evil.example/", "/\\evil.example", "https://evil.example/", "evil",
                "/a\r\nSet-Cookie: x=1", ""):
        assert safe_next(bad) == "/"


# -- a pipeline ----------------------------------------------------------------------------

@pytest.mark.slow
def test_pipeline_view_shows_its_steps_and_where_it_is(daemon: Daemon, tab: Tab) -> None:
    labels = {"pipeline": "eagle3", "pipeline_name": "demo"}
    generate = daemon.submit(python_job("pass"), name="demo-generate",
                             labels={**labels, "step": "generate"})["id"]
    extract = daemon.submit(TICKER, name="demo-extract", depends_on=[generate],
                            labels={**labels, "step": "extract"})["id"]
    daemon.submit(python_job("pass"), name="demo-vocab", depends_on=[extract],
                  labels={**labels, "step": "vocab"})
    daemon.wait_state(extract, "running", timeout=20)

    page = tab.page
    page.goto(daemon.url + "/")
    page.click("a[href='/pipelines/demo']")
    page.wait_for_selector("#steps")
    steps = page.eval_on_selector_all("#steps li", "els => els.map(e => e.dataset.step)")
    assert steps == ["generate", "extract", "vocab"]
    assert page.get_attribute("#steps li.current", "data-step") == "extract"
    assert "at step extract (running)" in page.inner_text("#pipeline-where")
    states = page.eval_on_selector_all("#steps li .state", "els => els.map(e => e.textContent)")
    assert states == ["succeeded", "running", "pending"]
    assert page.goto(daemon.url + "/pipelines/nope").status == 404
    assert tab.errors == [] or all("404" in e for e in tab.errors)


def test_every_page_renders_every_kind_of_job(daemon: Daemon, tab: Tab,
                                             tmp_path: Path) -> None:
    """#45 item 1 in the browser: the jobs of tests/test_page_never_fails.py (every
    state, every missing field) on the jobs page, each job's page and the pipeline's,
    through a live refresh each, with no error and `-` where a value is missing."""
    jobs = make_jobs(daemon, tmp_path)
    page = tab.page
    paths = ["/", "/pipelines/gaps", *(f"/jobs/{job_id}" for job_id in jobs.values())]
    for path in paths:
        answer = page.goto(daemon.url + path)
        assert answer.status == 200, path
        page.wait_for_function("() => window.jobsup && window.jobsup.refreshes >= 1",
                               timeout=15000)
        shown = page.inner_text("main")
        assert not NOT_SHOWN.search(shown), (path, NOT_SHOWN.findall(shown))
    page.goto(daemon.url + "/")
    assert page.inner_text(f"#job-{jobs['waiting']} .count").split() == ["-", "/", "5"]
    assert tab.errors == [], tab.errors


# -- render time ---------------------------------------------------------------------------

@pytest.mark.slow
def test_jobs_page_renders_100_jobs_in_under_a_second(daemon: Daemon, tab: Tab) -> None:
    """10 running jobs and 90 pending ones waiting on the first; the page, its fragment
    and the browser's full load are timed. The server's two (0.15-0.2 s on 2 loaded
    cores) are held under a second; the browser's load is recorded, not held: it is
    Chromium's scheduling on a shared machine as much as ours (1.17 s once, with a core
    kept busy and two other test files running, #33) — a speed goal for a benchmark."""
    blocker = daemon.submit(["sleep", "600"], name="blocker")["id"]
    for i in range(9):
        daemon.submit(["sleep", "600"], name=f"running-{i}", labels={"i": str(i)})
    for i in range(90):
        daemon.submit(["true"], name=f"waiting-{i}", depends_on=[blocker],
                      labels={"batch": str(i % 7)})
    wait_for(lambda: len(daemon.http.get("/api/v1/jobs", params={"state": "running"}).json())
             == 10, 30, what="10 running jobs")

    def timed(path: str) -> float:
        start = time.perf_counter()
        answer = daemon.http.get(path)
        assert answer.status_code == 200
        return time.perf_counter() - start

    server = statistics.median(timed("/") for _ in range(5))
    fragment = statistics.median(timed("/fragments/jobs") for _ in range(5))
    page = tab.page
    loads = []
    for _ in range(3):
        start = time.perf_counter()
        page.goto(daemon.url + "/")
        page.wait_for_function("() => document.querySelectorAll('#jobs tbody tr').length === 100")
        loads.append(time.perf_counter() - start)
    browser_load = statistics.median(loads)
    times = {"jobs": 100, "server_render_s": round(server, 4),
             "fragment_s": round(fragment, 4), "browser_load_s": round(browser_load, 4)}
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    (SCREENSHOTS / "render-times.json").write_text(json.dumps(times) + "\n")
    print("status page with 100 jobs:", times)
    assert server < 1.0 and fragment < 1.0, times
    assert tab.errors == []
