"""Data-parallel extraction: 2 ranks on CPU give exactly the single-process result,
with one manifest, one progress figure, and a rank's crash failing the whole job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import make_conversations, wait_for, worker_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent


def run(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "workers.extract", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=worker_env(**(env or {})))


def manifest(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


def test_two_ranks_equal_one_process(tiny_model: Path, tmp_path: Path) -> None:
    data = make_conversations(tmp_path / "conv.jsonl", copies=2)  # 64 samples
    single, ranked = tmp_path / "single", tmp_path / "ranked"
    progress = tmp_path / "progress.json"
    first = run("--model", tiny_model, "--data", data, "--out", single, "--dtype", "fp32",
                "--store", "dtype")
    assert first.returncode == 0
    result = run("--model", tiny_model, "--data", data, "--out", ranked, "--dtype", "fp32",
                 "--store", "dtype",
                 "--ranks", "2", "--device", "cpu", env={"JOBSUP_PROGRESS_FILE": str(progress)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "started 2 ranks" in result.stderr and "rank 1 " in result.stderr
    a, b = manifest(single), manifest(ranked)
    assert sorted(e["index"] for e in b) == list(range(64))  # each exactly once
    assert {e["file"] for e in a} == {e["file"] for e in b}
    for entry in b:
        one, two = load_file(single / entry["file"]), load_file(ranked / entry["file"])
        for key in one:
            torch.testing.assert_close(one[key], two[key], atol=1e-4, rtol=1e-4)
    report = json.loads(progress.read_text())
    assert report["done"] == 64 and report["total"] == 64  # one figure for the job
    summary = json.loads((ranked / "extract_summary.json").read_text())
    assert summary["written"] == 64 and summary["total"] == 64
    # resume: nothing left to do, nothing written twice
    again = run("--model", tiny_model, "--data", data, "--out", ranked, "--dtype", "fp32",
                "--store", "dtype",
                "--ranks", "2", "--device", "cpu")
    assert again.returncode == 0 and len(manifest(ranked)) == 64
    # a resume without --store: the ranks write what is missing in the store the
    # extraction began with (dtype), not the default (fp8)
    lost = [b[i]["file"] for i in (0, 1, 2)]
    for name in lost:
        (ranked / name).unlink()
    resumed = run("--model", tiny_model, "--data", data, "--out", ranked, "--dtype", "fp32",
                  "--ranks", "2", "--device", "cpu")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((ranked / "extract_summary.json").read_text())["written"] == 3
    for name in lost:
        assert load_file(ranked / name)["aux_hidden_states"].dtype == torch.float32
    assert len(manifest(ranked)) == 64


def test_a_failing_rank_fails_the_job(tiny_model: Path, tmp_path: Path) -> None:
    data = make_conversations(tmp_path / "conv.jsonl", copies=12)
    out = tmp_path / "out"
    parent = subprocess.Popen(
        [sys.executable, "-m", "workers.extract", "--model", str(tiny_model), "--data", str(data),
         "--out", str(out), "--ranks", "2", "--device", "cpu", "--batch-tokens", "64"],
        cwd=REPO, stderr=subprocess.PIPE, text=True, env=worker_env())
    try:
        ranks = wait_for(lambda: len(psutil.Process(parent.pid).children()) == 2
                         and psutil.Process(parent.pid).children(), 30, what="two ranks")
        wait_for(lambda: len(list(out.glob("rows_*/*.safetensors"))) >= 4, 120,
                 what="some output")
        by_rank = {int(p.cmdline()[p.cmdline().index("--rank") + 1]): p for p in ranks}
        os.kill(by_rank[1].pid, signal.SIGKILL)
        _, stderr = parent.communicate(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
    assert parent.returncode != 0
    assert "rank 1 (cpu) failed (killed by signal 9); stopping the other ranks" in stderr
    assert not by_rank[0].is_running() or by_rank[0].status() == psutil.STATUS_ZOMBIE
