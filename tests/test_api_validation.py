"""Bad input gets a clear error naming the field and changes nothing; the API's answers
on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import Daemon, python_job

BAD_SPECS = [
    ({"name": "x", "command": []}, "command"),
    ({"name": "x", "command": [""]}, "command"),
    ({"name": "x", "command": ["surely-not-a-program-xyz"]}, "command"),
    ({"name": "x", "command": ["./missing.sh"]}, "command"),
    ({"name": "x", "command": ["true"], "cwd": "/does/not/exist"}, "cwd"),
    ({"name": "x", "command": ["true"], "depends_on": ["deadbeef"]}, "depends_on"),
    ({"name": "x", "command": ["true"], "stall_timeout_s": -1}, "stall_timeout_s"),
    ({"name": "x", "command": ["true"], "startup_timeout_s": 0}, "startup_timeout_s"),
    ({"name": "x", "command": ["true"], "stop_grace_s": -5}, "stop_grace_s"),
    ({"name": "x", "command": ["true"], "max_restarts": -1}, "max_restarts"),
    ({"name": "x", "command": ["true"], "expected_items": 0}, "expected_items"),
    ({"name": "x", "command": ["true"], "restart_policy": "always"}, "restart_policy"),
    ({"name": "", "command": ["true"]}, "name"),
    ({"name": "x" * 129, "command": ["true"]}, "name"),
    ({"command": ["true"]}, "name"),
    ({"name": "x", "command": ["true"], "env": {"A=B": "c"}}, "env"),
    ({"name": "x", "command": ["true"], "bogus": 1}, "bogus"),
    ({"name": "x", "command": "true"}, "command"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "field"), BAD_SPECS, ids=[f for _, f in BAD_SPECS])
def test_bad_spec_is_refused_naming_the_field(daemon: Daemon, spec: dict, field: str) -> None:
    response = daemon.http.post("/api/v1/jobs", json=spec)
    assert response.status_code == 422, response.text
    assert field in response.json()["error"]
    assert daemon.http.get("/api/v1/jobs").json() == []


def test_non_executable_file(daemon: Daemon, tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\n")
    response = daemon.http.post("/api/v1/jobs", json={"name": "x", "command": [str(script)]})
    assert response.status_code == 422
    assert "not executable" in response.json()["error"] and "chmod" in response.json()["hint"]


@pytest.mark.both_databases
def test_relative_program_resolves_against_cwd(daemon: Daemon, tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\necho relative ok\n")
    script.chmod(0o755)
    job = daemon.submit(["./run.sh"], cwd=str(tmp_path))
    daemon.wait_state(job["id"], "succeeded")
    assert daemon.logs(job["id"]) == "relative ok\n"


@pytest.mark.both_databases
def test_unknown_job_is_404_everywhere(daemon: Daemon) -> None:
    for method, path in [("GET", "/api/v1/jobs/nope"), ("POST", "/api/v1/jobs/nope/stop"),
                         ("GET", "/api/v1/jobs/nope/logs"), ("GET", "/api/v1/jobs/nope/events")]:
        response = daemon.http.request(method, path)
        assert response.status_code == 404, (path, response.text)
        assert response.json()["error"] == "no job with id 'nope'"


def test_malformed_json_body(daemon: Daemon) -> None:
    response = daemon.http.post("/api/v1/jobs", content=b"{not json",
                                headers={"content-type": "application/json"})
    assert response.status_code == 422


@pytest.mark.both_databases
def test_job_response_has_the_contract_fields(daemon: Daemon) -> None:
    job = daemon.submit(python_job("pass"), name="fields")
    for key in ("id", "name", "spec", "state", "pid", "exit_code", "signal", "exit_reason",
                "restarts", "created_at", "started_at", "ended_at", "progress", "forecast",
                "resources", "alerts"):
        assert key in job
    assert set(job["progress"]) >= {"items_done", "items_total", "files", "bytes_written",
                                     "source", "last_progress_at", "metrics"}
    assert set(job["forecast"]) >= {"rate_items_per_s", "eta_s", "eta_at", "bytes_per_item",
                                     "projected_total_bytes", "disk_free_bytes",
                                     "disk_full_in_s", "will_fit"}
    assert set(job["resources"]) >= {"status", "num_procs", "num_threads", "cpu_percent",
                                      "rss_bytes", "read_bytes", "gpu_memory_bytes"}
    assert job["created_at"].endswith("Z")
    assert job["spec"]["pattern"] == "**/*" and job["spec"]["stall_timeout_s"] == 600


@pytest.mark.both_databases
def test_token_guards_every_route_but_healthz(make_daemon) -> None:
    daemon: Daemon = make_daemon(env={"JOBSUP_TOKEN": "s3cret"})
    assert daemon.http.get("/healthz").status_code == 200
    assert daemon.http.get("/api/v1/jobs").status_code == 401
    wrong = daemon.http.get("/api/v1/jobs", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    right = daemon.http.get("/api/v1/jobs", headers={"Authorization": "Bearer s3cret"})
    assert right.status_code == 200
