"""Every number of a spec is finite and within the store's range, no string that reaches
the filesystem or a process holds a NUL byte, and a row stored before these rules (a
null where a number belongs) is read with defaults instead of breaking the daemon."""

from __future__ import annotations

import json
import logging
import sqlite3
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from supervisor.observe.view import WARNED_PROGRESS_MAX, stored_progress
from supervisor.spec import MAX_INT64, STORED_SPECS_CACHED, JobSpec, stored_spec
from tests.helpers import Daemon, python_job, wait_for
from tests.test_cli import jobsup

INF, NAN = float("inf"), float("nan")

BAD_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({"stall_timeout_s": INF}, "stall_timeout_s"),
    ({"stall_timeout_s": NAN}, "stall_timeout_s"),
    ({"stall_timeout_s": 1e12}, "stall_timeout_s"),  # past ten years
    ({"startup_timeout_s": INF}, "startup_timeout_s"),
    ({"stop_grace_s": INF}, "stop_grace_s"),
    ({"stop_grace_s": -INF}, "stop_grace_s"),
    ({"bytes_per_item": INF}, "bytes_per_item"),
    ({"bytes_per_item": NAN}, "bytes_per_item"),
    ({"bytes_per_item": 1e300}, "bytes_per_item"),
    ({"expected_items": 1e20}, "expected_items"),
    ({"expected_items": 10**20}, "expected_items"),
    ({"expected_items": 2**63}, "expected_items"),
    ({"max_restarts": 2**63}, "max_restarts"),
    ({"output_dir": "/tmp/a\x00b"}, "output_dir"),
    ({"cwd": "/tmp\x00"}, "cwd"),
    ({"pattern": "*.pt\x00"}, "pattern"),
    ({"name": "x\x00"}, "name"),
    ({"labels": {"step": "a\x00"}}, "labels"),
    ({"labels": {"st\x00ep": "a"}}, "labels"),
    ({"depends_on": ["ab\x00cd"]}, "depends_on"),
    ({"stop_when_ended": ["ab\x00cd"]}, "stop_when_ended"),
]


def post_raw(daemon: Daemon, path: str, body: dict[str, Any]) -> Any:
    """POST what `json.dumps` writes: `Infinity` and `NaN` included, as a Python client
    sends them (httpx's own `json=` refuses them)."""
    return daemon.http.post(path, content=json.dumps(body),
                            headers={"content-type": "application/json"})


@pytest.mark.parametrize(("extra", "field"), BAD_FIELDS, ids=[repr(e) for e, _ in BAD_FIELDS])
def test_out_of_range_or_nul_is_422_naming_the_field(shared: Daemon, extra: dict[str, Any],
                                                     field: str) -> None:
    response = post_raw(shared, "/api/v1/jobs", {"name": "x", "command": ["true"], **extra})
    assert response.status_code == 422, response.text
    assert response.json()["error"].startswith(f"{field}:"), response.text
    assert shared.http.get("/api/v1/jobs").json() == []


@pytest.mark.parametrize(("extra", "field"), [
    ({"stall_timeout_s": INF}, "stall_timeout_s"), ({"lr": INF}, "lr"),
    ({"temperature": INF}, "temperature"), ({"epochs": 2**63}, "epochs"),
    ({"out": "/tmp/\x00"}, "out"), ({"labels": {"a": "\x00"}}, "labels"),
    ({"env": {"A=B": "c"}}, "env"),  # valid for the pipeline, refused by the job spec
])
def test_pipeline_params_are_bounded(shared: Daemon, tmp_path: Path, extra: dict[str, Any],
                                     field: str) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"id": "{i}", "messages": []}}\n' for i in range(40)))
    response = post_raw(shared, "/api/v1/pipelines/eagle3", {
        "model": str(tmp_path), "prompts": str(prompts), "out": str(tmp_path / "out"), **extra})
    assert response.status_code == 422, response.text
    assert field in response.json()["error"]
    assert shared.http.get("/api/v1/jobs").json() == []


def test_log_query_parameters_are_bounded(daemon: Daemon) -> None:
    job = daemon.submit(["true"])
    daemon.wait_state(job["id"], "succeeded")
    for name in ("offset", "tail", "attempt"):
        response = daemon.http.get(f"/api/v1/jobs/{job['id']}/logs", params={name: 2**63})
        assert response.status_code == 422, (name, response.text)
        assert response.json()["error"].startswith(f"{name}:")
    last = daemon.http.get(f"/api/v1/jobs/{job['id']}/logs", params={"offset": MAX_INT64})
    assert last.status_code == 200 and last.text == ""


def test_a_huge_count_no_longer_stops_every_jobs_samples(daemon: Daemon) -> None:
    """`expected_items` 10**20 used to be accepted; SQLite's INTEGER could not hold it, so
    each tick's sample insert failed and no running job got samples. It is refused now,
    and the largest count the store holds, 2**63-1, is accepted and stored."""
    huge = post_raw(daemon, "/api/v1/jobs", {
        "name": "huge", "command": python_job("import time; time.sleep(600)"),
        "expected_items": 10**20})
    job = daemon.submit(python_job("import time; time.sleep(600)"), expected_items=MAX_INT64)
    other = daemon.submit(python_job("import time; time.sleep(600)"), name="other")
    def stored(job_id: str) -> list[dict[str, Any]]:
        return daemon.http.get(f"/api/v1/jobs/{job_id}/samples").json()

    for j in (job, other):
        wait_for(partial(stored, j["id"]), 10, what=f"stored samples of {j['name']}")
    samples = daemon.http.get(f"/api/v1/jobs/{job['id']}/samples").json()
    assert samples[-1]["items_total"] == MAX_INT64
    assert huge.status_code == 422 and huge.json()["error"].startswith("expected_items:")
    assert "OverflowError" not in daemon.log()


def test_stored_spec_falls_back_to_defaults(caplog: pytest.LogCaptureFixture) -> None:
    good = JobSpec(name="x", command=["true"], stop_grace_s=5).model_dump()
    broken = json.dumps({**good, "stall_timeout_s": None, "expected_items": 10**20,
                         "max_restarts": None, "output_dir": "/a\x00b", "bogus": 1})
    with caplog.at_level(logging.WARNING, logger="supervisor.spec"):
        spec = stored_spec(broken)
        again = stored_spec(broken)
    assert spec == again
    assert (spec.stall_timeout_s, spec.expected_items, spec.max_restarts, spec.output_dir) \
        == (600.0, None, 0, None)
    assert (spec.name, spec.command, spec.stop_grace_s) == ("x", ["true"], 5)  # kept
    assert len(caplog.records) == 1, "warned once per stored spec"
    assert "stall_timeout_s" in caplog.text and "expected_items" in caplog.text
    assert stored_spec("not json").command == ["(invalid)"]
    assert stored_spec(json.dumps({**good, "name": "\x00"})).name == "(invalid)"


def test_what_is_remembered_of_stored_specs_and_progress_is_bounded(
        caplog: pytest.LogCaptureFixture) -> None:
    """The parsed specs, and the warnings about unreadable ones and unreadable stored
    progress, are bounded (#31): a broken spec is warned about again once more specs
    than the cache holds were read since, and an unreadable progress text once more
    such texts than are remembered were seen since (they grew without bound)."""
    good = JobSpec(name="x", command=["true"]).model_dump()
    broken = json.dumps({**good, "stall_timeout_s": None, "name": "bounded"})
    with caplog.at_level(logging.WARNING, logger="supervisor.spec"):
        stored_spec(broken)
        for n in range(STORED_SPECS_CACHED):
            stored_spec(json.dumps({**good, "name": f"job {n}"}))
        stored_spec(broken)
    assert sum("'bounded'" in r.getMessage() for r in caplog.records) == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="supervisor.observe.view"):
        for n in range(WARNED_PROGRESS_MAX + 1):
            assert stored_progress(f"not progress {n}") is None
        stored_progress("not progress 0")
    assert len(caplog.records) == WARNED_PROGRESS_MAX + 2


@pytest.mark.slow
def test_a_stored_null_breaks_nothing_after_a_restart(make_daemon) -> None:
    """What a daemon without the bounds stored for `"stall_timeout_s": Infinity` (a
    null), written into the real database of a stopped daemon: list, get, stop, /metrics
    and `jobsup ls` all answer, with the default in its place."""
    daemon: Daemon = make_daemon()
    running = daemon.submit(python_job("import time; time.sleep(600)"), name="runs")
    ended = daemon.submit(["true"], name="ended")
    daemon.wait_state(running["id"], "running")
    daemon.wait_state(ended["id"], "succeeded")
    daemon.stop()  # the job runs on under its shim

    with sqlite3.connect(daemon.data_dir / "jobsup.db") as db:
        db.execute("UPDATE jobs SET spec_json = json_set(spec_json, '$.stall_timeout_s', "
                   "json('null'), '$.expected_items', json('100000000000000000000'))")
    daemon.start()

    listed = daemon.http.get("/api/v1/jobs")
    assert listed.status_code == 200, listed.text
    assert {j["spec"]["stall_timeout_s"] for j in listed.json()} == {600.0}
    assert daemon.job(ended["id"])["spec"]["expected_items"] is None
    metrics = daemon.http.get("/metrics")
    assert metrics.status_code == 200 and f'job_id="{running["id"]}"' in metrics.text
    shown = jobsup("ls", url=daemon.url)
    assert shown.returncode == 0 and running["id"] in shown.stdout, shown.stderr
    stop = daemon.http.post(f"/api/v1/jobs/{running['id']}/stop")
    assert stop.status_code == 202, stop.text
    daemon.wait_state(running["id"], "stopped", timeout=20)  # the engine reads it too
    log = daemon.log()
    assert "Traceback" not in log, log
    assert log.count("stored spec has invalid") == 2, log  # once per row


@pytest.mark.slow
@pytest.mark.parametrize("value", ["inf", "nan", "-inf", "-3", "1e12"])
def test_cli_stall_timeout_error_and_hint(shared: Daemon, value: str) -> None:
    result = jobsup("submit", "--name", "x", "--stall-timeout", value, "--", sys.executable,
                    "-c", "pass", url=shared.url)
    # not a finite number: refused by the CLI before any request (a usage error, 2);
    # out of bounds: by the daemon (422, 1)
    assert result.returncode == (2 if value in ("inf", "nan", "-inf") else 1), result
    assert result.stderr.startswith("error: ") and "stall" in result.stderr, result.stderr
    assert "\nhint: --stall-timeout: seconds" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert shared.http.get("/api/v1/jobs").json() == []


def test_cli_shows_the_daemons_422_for_any_field(shared: Daemon) -> None:
    result = jobsup("submit", "--name", "x", "--expect", str(2**64), "--", sys.executable,
                    "-c", "pass", url=shared.url)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result
    assert result.stderr.startswith("error: expected_items: ")
    assert "\nhint: --expect: a whole number > 0" in result.stderr
