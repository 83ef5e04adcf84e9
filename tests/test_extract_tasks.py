"""Extraction as several tasks of one launch (what srun or torchrun starts): the shard
arithmetic, the launcher's environment, and real tasks on CPU sharing one output tree:
every sample once, one complete manifest and summary, one progress figure, and a
resume after all tasks were killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import make_conversations, wait_for, worker_env
from workers.eagle3.extraction.hidden_files import rank_summary, ranks_finished
from workers.eagle3.extraction.ranks import LaunchError, Task, global_ranks, in_shard, launcher_task

REPO = Path(__file__).resolve().parent.parent


# -- the arithmetic ---------------------------------------------------------------------

@pytest.mark.parametrize("tasks", [1, 2, 3])
@pytest.mark.parametrize("local", [1, 2, 4])
def test_global_ranks_cover_every_sample_once(tasks: int, local: int) -> None:
    owners: dict[int, list[int]] = {index: [] for index in range(101)}
    for task in range(tasks):
        first, world = global_ranks(task, tasks, local)
        assert world == tasks * local
        for rank in range(first, first + local):
            for index in owners:
                if in_shard(index, rank, world):
                    owners[index].append(rank)
    assert all(len(ranks) == 1 for ranks in owners.values()), owners


def test_global_ranks_refuse_nonsense() -> None:
    assert global_ranks(1, 2, 3) == (3, 6)
    for bad in [(2, 2, 1), (-1, 2, 1), (0, 2, 0), (0, 0, 1)]:
        with pytest.raises(ValueError):
            global_ranks(*bad)


def test_the_launchers_environment() -> None:
    run = {"JOBSUP_JOB_ID": "j1", "JOBSUP_ATTEMPT": "2", "SLURM_JOB_ID": "40"}
    assert launcher_task({}) is None
    assert launcher_task({"WORLD_SIZE": "1", "RANK": "0"}) is None  # alone
    assert launcher_task({"WORLD_SIZE": "4", "RANK": "3", **run}) == Task(
        3, 4, "JOBSUP_JOB_ID=j1,JOBSUP_ATTEMPT=2,SLURM_JOB_ID=40")
    for env, words in [
        ({"WORLD_SIZE": "two", "RANK": "0", **run}, "whole numbers"),
        ({"WORLD_SIZE": "2", "RANK": "2", **run}, "RANK=2"),
        ({"WORLD_SIZE": "2", "RANK": "1"}, "earlier one's"),  # nothing names the launch
    ]:
        with pytest.raises(LaunchError, match=words):
            launcher_task(env)


def test_only_this_launchs_summaries_count(tmp_path: Path) -> None:
    def summary(rank: int, world: int, run: str) -> None:
        path = rank_summary(tmp_path, rank)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({"rank": rank, "world_size": world, "run": run}))

    summary(0, 2, "attempt=2")
    assert not ranks_finished(tmp_path, 2, "attempt=2")  # rank 1: none yet
    summary(1, 2, "attempt=1")
    assert not ranks_finished(tmp_path, 2, "attempt=2")  # an earlier attempt's
    summary(1, 2, "attempt=2")
    assert ranks_finished(tmp_path, 2, "attempt=2")
    summary(1, 3, "attempt=2")
    with pytest.raises(ValueError, match="same number of local ranks"):
        ranks_finished(tmp_path, 2, "attempt=2")


# -- real tasks -------------------------------------------------------------------------

def start_tasks(model: Path, data: Path, out: Path, progress: Path, *extra: str,
                tasks: int = 2, attempt: int = 1) -> list[subprocess.Popen[str]]:
    """`tasks` extraction tasks as a launcher starts them: RANK, WORLD_SIZE, the
    launch's identity, and every task the same JOBSUP_PROGRESS_FILE."""
    procs = []
    for rank in range(tasks):
        env = worker_env(RANK=str(rank), WORLD_SIZE=str(tasks), JOBSUP_JOB_ID="tasks",
                         JOBSUP_ATTEMPT=str(attempt), JOBSUP_PROGRESS_FILE=str(progress))
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "workers.extract", "--model", str(model), "--data",
             str(data), "--out", str(out), "--device", "cpu", "--dtype", "fp32", *extra],
            cwd=REPO, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True))
    return procs


def finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    logs = [proc.communicate(timeout=300)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * len(procs), logs[0][-3000:] + \
        logs[-1][-3000:]
    return logs


def check_complete(out: Path, n: int) -> list[dict]:
    """Every sample written once and listed once; nothing of the ranks left to fold."""
    entries = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [e["index"] for e in entries] == list(range(n))
    assert sorted(int(p.stem) for p in out.glob("rows_*/*.safetensors")) == list(range(n))
    assert all((out / e["file"]).is_file() for e in entries)
    assert not list((out / ".ranks").glob("manifest.rank*.jsonl"))
    return entries


@pytest.mark.slow
def test_two_tasks_of_two_ranks_extract_every_sample_once(tiny_model: Path,
                                                          tmp_path: Path) -> None:
    """Task t of 2 with --ranks 2 runs global ranks 2t and 2t+1 of 4; the task of rank 0
    alone writes the job's progress and, after every rank, the manifest and summary."""
    data = make_conversations(tmp_path / "conv.jsonl")  # 32 samples
    out, progress = tmp_path / "out", tmp_path / "progress.json"
    logs = finish(start_tasks(tiny_model, data, out, progress, "--ranks", "2"))
    assert "started 2 ranks (0, 1 of 4)" in logs[0] and "started 2 ranks (2, 3 of 4)" in logs[1]
    assert all(f"rank {r} " in logs[r // 2] for r in range(4))
    check_complete(out, 32)
    summary = json.loads((out / "extract_summary.json").read_text())
    assert (summary["total"], summary["written"], summary["done_before"]) == (32, 32, 0)
    assert "world_size" not in summary and "run" not in summary
    report = json.loads(progress.read_text())
    assert (report["done"], report["total"], report["metrics"]["ranks_reporting"]) == (32, 32, 4)

    # the same launch again (a new attempt): nothing to do, nothing listed twice
    finish(start_tasks(tiny_model, data, out, progress, "--ranks", "2", attempt=2))
    check_complete(out, 32)
    summary = json.loads((out / "extract_summary.json").read_text())
    assert (summary["total"], summary["written"], summary["done_before"]) == (32, 0, 32)


@pytest.mark.slow
def test_a_resume_after_every_task_was_killed(tiny_model: Path, tmp_path: Path) -> None:
    """Killed mid-run (the ranks' manifests unfolded, maybe a torn line), then started
    again with another task count: each sample still written and listed once."""
    data = make_conversations(tmp_path / "conv.jsonl", copies=6)  # 192 samples
    out, progress = tmp_path / "out", tmp_path / "progress.json"
    procs = start_tasks(tiny_model, data, out, progress, "--batch-tokens", "64")
    try:
        wait_for(lambda: len(list(out.glob("rows_*/*.safetensors"))) >= 8, 180,
                 what="some output")
    finally:
        for proc in procs:  # the whole task: its parent and its rank
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    written = len(list(out.glob("rows_*/*.safetensors")))
    assert written < 192 and list((out / ".ranks").glob("manifest.rank*.jsonl"))
    finish(start_tasks(tiny_model, data, out, progress, tasks=3, attempt=2))
    check_complete(out, 192)
    summary = json.loads((out / "extract_summary.json").read_text())
    assert summary["total"] == 192 and summary["written"] + summary["done_before"] == 192
    assert summary["done_before"] >= written - 4  # a kill mid-write loses only that file
