"""Hidden-state extraction as several SLURM tasks (`tasks_per_node: 2` on the one-node
test cluster, `tests/slurm_cluster.py`), through a real daemon: srun starts
`workers.extract` once per task through the rank wrapper, each task takes its shard
from RANK / WORLD_SIZE, and the job ends with every sample written once, one manifest
and summary, and its progress at the total. A rank killed mid-run fails the job, named;
with a restart policy the next attempt finishes the rest. Then the whole tiny EAGLE-3
pipeline with its extract step on two tasks."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers import PY, Daemon, make_conversations, wait_for
from tests.slurm_cluster import SlurmCluster
from workers.fixtures.tiny import DEMO_PROMPTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def daemon(cluster: SlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose default backend is `slurm` (JOBSUP_SAMPLE_INTERVAL 1: progress
    read every second); its jobs inherit OMP_NUM_THREADS=1 (`worker_env`)."""
    d = Daemon(tmp_path_factory.mktemp("slurm-extract") / "data",
               {"JOBSUP_BACKEND": "slurm", "JOBSUP_SAMPLE_INTERVAL": "1",
                "OMP_NUM_THREADS": "1"}).start()
    try:
        yield d
    finally:
        d.shut_down()


def extraction(model: Path, data: Path, out: Path, *extra: str) -> dict:
    return {"command": [PY, "-m", "workers.extract", "--model", str(model), "--data", str(data),
                        "--out", str(out), "--device", "cpu", "--dtype", "fp32", *extra],
            "cwd": str(REPO), "output_dir": str(out), "pattern": "rows_*/*.safetensors",
            "slurm": {"tasks_per_node": 2}}


def rank_process(out: Path, rank: int) -> psutil.Process | None:
    """The extraction process running `rank` into `out` (the cluster is this machine)."""
    for proc in psutil.process_iter(["cmdline"]):
        argv = proc.info["cmdline"] or []
        if str(out) in argv and "--rank" in argv and argv[argv.index("--rank") + 1] == str(rank):
            return proc
    return None


def manifest_indexes(out: Path) -> list[int]:
    lines = (out / "manifest.jsonl").read_text().splitlines()
    return [json.loads(line)["index"] for line in lines]


def test_two_tasks_extract_every_sample_once(daemon: Daemon, tiny_model: Path,
                                             tmp_path: Path) -> None:
    data = make_conversations(tmp_path / "conv.jsonl", copies=2)  # 64 samples
    out = tmp_path / "hidden"
    job = daemon.submit(name="extract-2", expected_items=64,
                        **extraction(tiny_model, data, out))
    done = daemon.wait_state(job["id"], "succeeded", "failed", "lost", timeout=300)
    log = daemon.logs(job["id"], tail=400)
    assert done["state"] == "succeeded", (done["reason"], log)
    assert "task 0 " in log and "task 1 " in log  # srun's two tasks, each a parent
    assert "started 1 ranks (0 of 2)" in log and "started 1 ranks (1 of 2)" in log
    assert manifest_indexes(out) == list(range(64))
    assert sorted(int(p.stem) for p in out.glob("rows_*/*.safetensors")) == list(range(64))
    summary = json.loads((out / "extract_summary.json").read_text())
    assert (summary["total"], summary["written"]) == (64, 64)
    progress = done["progress"]
    assert (progress["items_done"], progress["items_total"], progress["files"]) == (64, 64, 64)
    # the figure is the workers' (rank 0's task sums both ranks), not a count of files
    report = json.loads((daemon.data_dir / "jobs" / job["id"] / "progress.json").read_text())
    assert (report["done"], report["total"], report["metrics"]["ranks_reporting"]) == (64, 64, 2)


def test_a_killed_rank_fails_the_job_naming_it(daemon: Daemon, tiny_model: Path,
                                               tmp_path: Path) -> None:
    data = make_conversations(tmp_path / "conv.jsonl", copies=12)
    out = tmp_path / "hidden"
    job = daemon.submit(name="extract-fail", **extraction(tiny_model, data, out,
                                                          "--batch-tokens", "64"))

    rank = wait_for(lambda: rank_process(out, 1), 120, interval=0.2, what="rank 1")
    wait_for(lambda: len(list(out.glob("rows_*/*.safetensors"))) >= 4, 120, what="some output")
    os.kill(rank.pid, signal.SIGKILL)
    done = daemon.wait_state(job["id"], "succeeded", "failed", "lost", timeout=60)
    log = daemon.logs(job["id"], tail=400)
    assert done["state"] == "failed", (done["reason"], log)
    # the worker's global rank and device, from its task's log line (srun's own line,
    # task 1 and the node, comes after it)
    assert done["reason"].endswith("rank 1 (cpu) failed first: killed by signal 9"), done
    assert "rank 1 (cpu) failed (killed by signal 9)" in log


def test_a_restarted_attempt_finishes_what_the_killed_one_left(daemon: Daemon,
                                                                tiny_model: Path,
                                                                tmp_path: Path) -> None:
    """Rank 1 killed mid-run, the job restarted (on-failure): attempt 2's tasks skip
    what attempt 1 wrote and fold the manifests it left; every sample ends written and
    listed once. (Summaries an earlier attempt left not counting is
    test_extract_tasks.py's test_only_this_launchs_summaries_count.)"""
    data = make_conversations(tmp_path / "conv.jsonl", copies=4)  # 128 samples
    out = tmp_path / "hidden"
    job = daemon.submit(name="extract-again", restart_policy="on-failure", max_restarts=1,
                        **extraction(tiny_model, data, out, "--batch-tokens", "64"))
    rank = wait_for(lambda: rank_process(out, 1), 120, interval=0.2, what="rank 1")
    wait_for(lambda: len(list(out.glob("rows_*/*.safetensors"))) >= 4, 120, what="some output")
    os.kill(rank.pid, signal.SIGKILL)
    done = daemon.wait_state(job["id"], "succeeded", "failed", "lost", timeout=300)
    log = daemon.logs(job["id"], tail=400)
    assert (done["state"], done["attempt"]) == ("succeeded", 2), (done["reason"], log)
    assert manifest_indexes(out) == list(range(128))
    summary = json.loads((out / "extract_summary.json").read_text())
    assert summary["total"] == 128 and summary["written"] + summary["done_before"] == 128
    assert summary["done_before"] >= 3  # attempt 1's files were kept, not written again
    assert not list((out / ".ranks").glob("manifest.rank*.jsonl"))


def test_the_pipeline_extracts_on_two_tasks(daemon: Daemon, tiny_model: Path,
                                            tmp_path: Path) -> None:
    """Every step of the tiny pipeline in the cluster, extraction as two tasks."""
    out = tmp_path / "run"
    response = daemon.http.post("/api/v1/pipelines/eagle3", json={
        "model": str(tiny_model), "prompts": str(DEMO_PROMPTS), "out": str(out),
        "name": "multi", "device": "cpu", "dtype": "fp32", "draft_vocab_size": 64,
        "max_tokens": 8, "eval_prompts": 0, "slurm": {"extract": {"tasks_per_node": 2}}})
    assert response.status_code == 201, response.text
    jobs = response.json()
    final: dict[str, dict] = {}
    for job in jobs:
        final[job["name"]] = daemon.wait_state(job["id"], "succeeded", "failed", "lost",
                                               "stopped", timeout=300)
    states = {name: (j["state"], j["reason"]) for name, j in final.items()}
    assert all(j["state"] == "succeeded" for j in final.values()), states
    extract = final["multi-extract"]
    assert extract["spec"]["slurm"]["tasks_per_node"] == 2
    assert manifest_indexes(out / "hidden_states") == list(range(32))
    assert (extract["progress"]["items_done"], extract["progress"]["items_total"]) == (32, 32)
    assert (out / "train" / "draft" / "model.safetensors").is_file()
