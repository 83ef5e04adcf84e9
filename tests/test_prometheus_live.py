"""A real Prometheus on loopback scrapes a running daemon: the scrape passes
`promtool check metrics`, the alert rules evaluate (a crash and a lost job from before
Prometheus started, and a restart loop, fire within seconds of its start, naming job and
host), and every query of every dashboard panel returns data."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from supervisor import __version__
from tests.helpers import Daemon, Receiver, free_port, job_module, python_job, wait_for
from tests.test_dashboards import DEFAULT_SUBSTITUTIONS, RULES, dashboard_queries

pytestmark = pytest.mark.slow


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: run `./dev.sh test`, which installs Debian's prometheus")
    return path


@pytest.fixture
def prometheus(tmp_path: Path) -> dict:
    return {"port": free_port(), "dir": tmp_path / "prom"}


def test_live_scrape_rules_and_every_dashboard_query(make_daemon, receiver: Receiver,
                                                     tmp_path: Path, prometheus: dict) -> None:
    daemon: Daemon = make_daemon(env={"JOBSUP_SLACK_WEBHOOK_URL": receiver.url,
                                      "JOBSUP_RESTART_BACKOFF_S": "0.2",
                                      "JOBSUP_RESTART_BACKOFF_MAX_S": "0.5"})
    out = tmp_path / "out"
    writing = daemon.submit(job_module("sample_writer", out), name="extract",
                            output_dir=str(out), pattern="*.bin")
    crashed = daemon.submit(python_job("import sys; sys.exit(3)"), name="vocab")
    looping = daemon.submit(python_job("import sys; sys.exit(1)"), name="train",
                            restart_policy="on-failure", max_restarts=100_000)
    vanishing = daemon.submit(python_job("import time; time.sleep(600)"), name="evaluate")
    daemon.wait_state(crashed["id"], "failed")
    # lost: its shim dies, then its worker, with no exit record (as in test_core)
    daemon.wait_state(vanishing["id"], "running")
    worker_pid = wait_for(lambda: daemon.job(vanishing["id"])["pid"], 15, what="worker pid")
    shim = daemon.data_dir / "jobs" / vanishing["id"] / "attempt-1" / "shim.json"
    os.kill(json.loads(shim.read_text())["pid"], signal.SIGKILL)
    os.killpg(worker_pid, signal.SIGKILL)
    daemon.wait_state(vanishing["id"], "lost")
    wait_for(lambda: daemon.job(looping["id"])["restarts"] >= 3, 15, what="3 restarts")
    wait_for(lambda: daemon.job(writing["id"])["forecast"]["disk_full_in_s"], 15,
             what="a disk runway")

    # the scrape parses and lints clean (promtool exits 1 on a parse error, 3 on lint
    # findings: the gauge once named `jobsup_job_items_total` was one, #16)
    scrape = daemon.http.get("/metrics").text
    assert "jobsup_job_items_expected{" in scrape
    hostname = socket.gethostname()
    assert f'jobsup_host_info{{hostname="{hostname}"}} 1.0' in scrape.splitlines()
    assert (f'jobsup_build_info{{python="{platform.python_version()}",version="{__version__}"}}'
            f' 1.0') in scrape.splitlines()
    ended = re.search(rf'^jobsup_job_ended_timestamp_seconds{{job_id="{crashed["id"]}",'
                      rf'job_name="vocab"}} (\S+)$', scrape, re.MULTILINE)
    assert ended and abs(float(ended[1]) - time.time()) < 60, ended

    def series(text: str, name: str, job: dict) -> str | None:
        found = re.search(rf'^{name}{{job_id="{job["id"]}",[^}}]*}} (\S+)$', text, re.MULTILINE)
        return found[1] if found else None

    # not ended: a restart's pending is no end; the first start stays put across restarts
    for job in (writing, looping):
        assert series(scrape, "jobsup_job_ended_timestamp_seconds", job) is None, job["name"]
    first_started = series(scrape, "jobsup_job_first_started_timestamp_seconds", looping)
    restarts = float(series(scrape, "jobsup_job_restarts", looping) or 0)
    events = daemon.events(looping["id"])
    first_run = datetime.fromisoformat(next(e["t"] for e in events if e["to_state"] == "running"))
    assert first_started and abs(float(first_started) - first_run.timestamp()) < 1e-3

    def restarted() -> str | None:
        text = daemon.http.get("/metrics").text
        return text if float(series(text, "jobsup_job_restarts", looping) or 0) > restarts else None

    later = wait_for(restarted, 15, what="another restart")
    assert series(later, "jobsup_job_first_started_timestamp_seconds", looping) == first_started
    check = subprocess.run([tool("promtool"), "check", "metrics"], input=scrape,
                           capture_output=True, text=True, timeout=30)
    findings = (check.stdout + check.stderr).strip().splitlines()
    assert check.returncode == 0 and findings == [], findings

    prom_dir: Path = prometheus["dir"]
    prom_dir.mkdir()
    config = prom_dir / "prometheus.yml"
    shutil.copy(RULES, prom_dir / "rules.yml")
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yml"],
        "scrape_configs": [{"job_name": "jobsup",
                            "static_configs": [{"targets": [f"127.0.0.1:{daemon.port}"]}]}],
    }))
    url = f"http://127.0.0.1:{prometheus['port']}"
    log = open(prom_dir / "prometheus.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={prom_dir / 'data'}",
         f"--web.listen-address=127.0.0.1:{prometheus['port']}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        http = httpx.Client(base_url=url, timeout=10)

        def query(expr: str) -> list:
            answer = http.get("/api/v1/query", params={"query": expr}).json()
            assert answer["status"] == "success", (expr, answer)
            return answer["data"]["result"]

        def scraped() -> bool:
            try:  # 503 "Service Unavailable" until Prometheus has opened its storage
                if http.get("/-/ready").status_code != 200:
                    return False
                return bool(query('up{job="jobsup"} == 1'))
            except httpx.TransportError:
                return False

        wait_for(scraped, 30, interval=0.5, what="Prometheus scraping the daemon")

        # The crash, the lost job and the loop all came before Prometheus started: its
        # first evaluations see them (the `offset 15m` rule was blind for 15 minutes).
        def firing() -> dict[tuple[str, str], dict] | None:
            alerts = http.get("/api/v1/alerts").json()["data"]["alerts"]
            found = {(a["labels"]["alertname"], a["labels"].get("job_name", "")): a
                     for a in alerts if a["state"] == "firing"}
            wanted = {("JobsupJobCrashed", "vocab"), ("JobsupJobCrashed", "evaluate"),
                      ("JobsupJobRestartLoop", "train")}
            return found if wanted <= set(found) else None

        alerts = wait_for(firing, 30, interval=0.5, what="crash, lost and restart-loop alerts")
        for (_, job_name), alert in alerts.items():
            labels = alert["labels"]
            assert labels["hostname"] == hostname and labels["job"] == "jobsup", labels
            assert hostname in alert["annotations"]["summary"], alert
            if job_name:
                assert job_name in alert["annotations"]["summary"], alert
        lost = alerts[("JobsupJobCrashed", "evaluate")]
        assert lost["labels"]["state"] == "lost" and "was lost" in lost["annotations"]["summary"]
        assert ("JobsupJobCrashed", "extract") not in alerts  # running, not crashed

        evaluated: list[dict] = []

        def every_rule_evaluated() -> bool:  # each group on its own first evaluation
            groups = http.get("/api/v1/rules").json()["data"]["groups"]
            evaluated[:] = [r for g in groups for r in g["rules"]]
            return bool(evaluated) and all(r["health"] != "unknown" for r in evaluated)

        wait_for(every_rule_evaluated, 30, interval=0.5,
                 what=lambda: f"every rule evaluated: {evaluated}")
        assert all(r["health"] == "ok" for r in evaluated), evaluated

        gpu_available = query("jobsup_gpu_available")[0]["value"][1] == "1"
        substitutions = {**DEFAULT_SUBSTITUTIONS, "__rate_interval": "10s"}
        empty: list[tuple[str, str]] = []
        expected_empty: list[tuple[str, str]] = []

        def every_query_answered() -> bool:
            """rate()/increase() over 10 s answer once two scrapes are in their window:
            waited for, however slowly Prometheus scrapes on a busy machine."""
            empty[:] = [(title, expr) for title, expr in dashboard_queries(substitutions)
                        if not query(expr)]
            # without NVML the daemon exports no GPU memory series, and says so
            expected_empty[:] = [] if gpu_available else [
                (t, e) for t, e in empty
                if re.search(r"jobsup_job_gpu_(device_)?memory_bytes", e)]
            return empty == expected_empty

        wait_for(every_query_answered, 40, interval=1,
                 what=lambda: f"an answer to every dashboard query; empty: {empty}")
        assert len(dashboard_queries(substitutions)) >= 20
        names = http.get("/api/v1/label/job_name/values",
                         params={"match[]": "jobsup_job_state"}).json()["data"]
        assert {"extract", "vocab"} <= set(names)
        instances = http.get("/api/v1/label/instance/values",
                             params={"match[]": "jobsup_build_info"}).json()["data"]
        assert instances == [f"127.0.0.1:{daemon.port}"]
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
        for job in (writing, looping):
            daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")
