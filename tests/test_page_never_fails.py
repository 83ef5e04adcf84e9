"""The status page never fails on data (#45 item 1): jobs in every state and with every
missing field (no progress, no total, a total with no count, no output dir, no
forecast, ended before its first reading, a lost job, a job read through its shim as a
remote node's is), and every page and fragment answers 200 with `-` where a value is
missing. A pending dependent with `--expect` was an HTTP 500 for `/`, `/jobs/ID`,
`/fragments/jobs` and the pipeline's page (`_progress.html` formatted `None` with
`%.0f`). A real daemon over loopback; the browser half is in tests/test_page.py
(`test_every_page_renders_every_kind_of_job`)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.api import listing
from tests.helpers import Daemon, python_job, wait_for

pytestmark = pytest.mark.timeout(180)

PIPELINE = {"pipeline": "eagle3", "pipeline_name": "gaps"}
"""The labels that make a job a pipeline's step (`supervisor/pipeline.py`)."""

NOT_SHOWN = re.compile(r"\bNone\b|\bnan\b|\binf\b|Traceback")
"""What a missing or non-finite value must never read as."""


def progress_writer(report: dict[str, object], then_sleep_s: float = 120) -> list[str]:
    """A job that writes `report` as its progress file, then sleeps."""
    return python_job(
        "import json, os, time\n"
        f"open(os.environ['JOBSUP_PROGRESS_FILE'], 'w').write({json.dumps(report)!r})\n"
        f"time.sleep({then_sleep_s})")


def make_jobs(daemon: Daemon, tmp_path: Path) -> dict[str, str]:
    """One job of each kind the page must survive, by name -> id, each in the state it
    is built for (the lost one after a daemon restart)."""
    jobs: dict[str, str] = {}

    def submit(name: str, command: list[str], **spec: object) -> str:
        jobs[name] = daemon.submit(command, name=name, **spec)["id"]
        return jobs[name]

    blocker = submit("blocker", ["sleep", "120"], expected_items=5,
                     labels={**PIPELINE, "step": "generate"})
    # the report's own cases: a pending dependent that expects items and has no progress
    submit("waiting", ["echo", "hi"], expected_items=5, depends_on=[blocker],
           labels={**PIPELINE, "step": "extract"})
    submit("to-stop", ["echo", "hi"], expected_items=5, depends_on=[blocker],
           labels={**PIPELINE, "step": "vocab"})
    submit("no-output-dir", ["sleep", "120"], expected_items=9,
           output_dir=str(tmp_path / "never-made"), pattern="*.bin")
    submit("done-no-total", progress_writer({"done": 7}))
    # no `done`: no report, so its total is the spec's and its count is not known
    submit("total-no-done", progress_writer({"total": 10, "unit": "sample"}),
           expected_items=10)
    submit("hostile-metrics", progress_writer(
        {"done": 3, "total": 4, "metrics": {"loss": "NaN", "big": 1e308, "acc": None}}))
    submit("past-total", progress_writer({"done": 50, "total": 10}))
    submit("quick", ["true"], expected_items=3, bytes_per_item=1e6)
    failed = submit("failed", ["false"], expected_items=3)
    submit("dependency-failed", ["true"], expected_items=2, depends_on=[failed])
    doomed = submit("doomed", ["sleep", "600"], expected_items=4)

    daemon.wait_state(jobs["quick"], "succeeded")
    daemon.wait_state(jobs["dependency-failed"], "failed")
    stopped = daemon.http.post(f"/api/v1/jobs/{jobs['to-stop']}/stop")
    assert stopped.status_code in (200, 202), stopped.text
    daemon.wait_state(jobs["to-stop"], "stopped")
    for name in ("done-no-total", "hostile-metrics", "past-total"):
        wait_for(lambda name=name: daemon.job(jobs[name])["progress"]["source"], 30,
                 what=f"{name}'s progress read")

    # lost: the daemon dies, then the job's shim and worker with no trace of an exit
    wait_for(lambda: daemon.job(doomed)["pid"], 15, what="doomed's worker pid")
    daemon.kill()
    attempt = daemon.data_dir / "jobs" / doomed / "attempt-1"
    for name in ("shim.json", "worker.json"):
        subprocess.run(["kill", "-9", str(json.loads((attempt / name).read_text())["pid"])],
                       check=True)
    time.sleep(0.5)
    daemon.start()
    daemon.wait_state(doomed, "lost", timeout=15)
    return jobs


def page_paths(jobs: dict[str, str]) -> Iterator[str]:
    """Every page and fragment, with every sort, order and state filter of the table."""
    for base in ("/", "/fragments/jobs"):
        yield base
        for key in listing.SORT_KEYS:
            for order in ("", "-"):
                yield f"{base}?sort={order}{key}"
        for state in ("pending", "running", "succeeded", "failed", "stopped", "lost"):
            yield f"{base}?state={state}"
        yield f"{base}?q=no-such-job"
    for job_id in jobs.values():
        yield f"/jobs/{job_id}"
        yield f"/fragments/jobs/{job_id}"
    yield "/pipelines/gaps"
    yield "/fragments/pipelines/gaps"


@pytest.fixture(params=["local", "shim"])
def gaps(request: pytest.FixtureRequest, make_daemon: Callable[..., Daemon],
         tmp_path: Path) -> tuple[Daemon, dict[str, str]]:
    """A daemon holding one job of each kind; `shim`: read from what each job's shim
    publishes, as a daemon that cannot read a SLURM node does (`JOBSUP_OBSERVE=shim`)."""
    env = {"JOBSUP_OBSERVE": "shim"} if request.param == "shim" else {}
    daemon = make_daemon(env=env)
    return daemon, make_jobs(daemon, tmp_path)


def test_every_page_answers_200_with_dashes_for_what_is_missing(
        gaps: tuple[Daemon, dict[str, str]]) -> None:
    daemon, jobs = gaps
    states = {name: daemon.job(job_id)["state"] for name, job_id in jobs.items()}
    assert {"pending", "running", "succeeded", "failed", "stopped", "lost"} <= set(
        states.values()), states
    for path in page_paths(jobs):
        answer = daemon.http.get(path)
        assert answer.status_code == 200, (path, answer.status_code, answer.text[-2000:])
        # the visible text: no None, nan or inf where a value is missing
        text = re.sub(r"<[^>]*>", " ", answer.text)
        assert not NOT_SHOWN.search(text), (path, NOT_SHOWN.findall(text))

    table = daemon.http.get("/fragments/jobs").text
    waiting = row_of(table, jobs["waiting"])
    assert re.search(r'class="count">-\s*/ 5\b', waiting), waiting  # a count not known yet
    assert ">-<" in waiting  # rate, ETA, written: a dash each
    page = daemon.http.get(f"/fragments/jobs/{jobs['total-no-done']}").text
    assert re.search(r'class="count">-\s*/ 10\b', page), page
    hostile = daemon.http.get(f"/fragments/jobs/{jobs['hostile-metrics']}").text
    assert "1e+308" in hostile  # a finite metric is shown; NaN and null are not metrics
    lost = daemon.http.get(f"/fragments/jobs/{jobs['doomed']}").text
    assert "lost" in lost


def row_of(table: str, job_id: str) -> str:
    match = re.search(rf'<tr id="job-{job_id}".*?</tr>', table, re.S)
    assert match, f"no row for {job_id}"
    return match.group(0)
