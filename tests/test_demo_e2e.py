"""`jobsup demo` end to end: the four EAGLE-3 steps on a tiny local Llama, under a real
daemon, with the training metrics visible in the API and in /metrics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import Daemon

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_demo_runs_the_whole_pipeline(make_daemon, tmp_path: Path) -> None:
    daemon: Daemon = make_daemon(env={"JOBSUP_SAMPLE_INTERVAL": "1"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBSUP_")}
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "demo", "--url", daemon.url,
         "--data-dir", str(tmp_path / "demo-data"), "--max-tokens", "24"],
        capture_output=True, text=True, timeout=580, cwd=REPO, env={**env, "COLUMNS": "200"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "using the jobsup daemon at" in result.stdout
    assert "all steps succeeded" in result.stdout

    jobs = daemon.http.get("/api/v1/jobs", params={"label": "demo=1"}).json()
    steps = {job["spec"]["labels"]["step"]: job for job in jobs}
    assert set(steps) == {"generate", "extract", "vocab", "train"}
    assert all(job["state"] == "succeeded" for job in jobs), [
        (j["name"], j["state"], j["reason"]) for j in jobs]
    assert steps["extract"]["progress"]["files"] == 32
    train = steps["train"]
    metrics = train["progress"]["metrics"]
    assert "loss" in metrics and "acc_0" in metrics, metrics
    out = Path(train["spec"]["output_dir"])
    assert (out / "draft" / "config.json").exists()
    assert (out / "draft" / "model.safetensors").exists()

    scrape = daemon.http.get("/metrics").text
    assert f'jobsup_job_metric{{job_id="{train["id"]}",job_name="demo-train",name="loss"}}' \
        in scrape
