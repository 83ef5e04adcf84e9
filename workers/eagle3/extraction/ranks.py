"""Data-parallel ranks for a worker: one process per device, each taking every N-th
sample, one shared output tree, one progress figure for the job.

The parent starts the ranks as its children (same process group, so a stop of the job
reaches them all), sums their progress files into its own (the one jobsup reads), and
fails fast: when a rank fails, the others are stopped and the job exits with that
rank's code, naming the rank and its device in the log.

Several tasks (nodes): a launcher that starts the worker once per task (srun through
`supervisor.runtime.rank`, torchrun) says which task this is in RANK and WORLD_SIZE
(`launcher_task`). Each task is then the parent of its own local ranks, and the ranks
are numbered globally (`global_ranks`): task t's i-th of L local ranks is rank t*L + i of
WORLD_SIZE*L, so the shards (index % world == rank) stay disjoint and cover every
sample. The tasks share nothing but the output tree (a shared filesystem), so the
parent holding global rank 0 speaks for the job: it sums every rank's progress file
(`.ranks/progress.rankG.json` in the tree) into the job's, and after its own ranks it
waits for the others' (its `until`) to finish what the single-node parent finishes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.common import ProgressReporter

log = logging.getLogger("workers.eagle3.extraction.ranks")

STOP_GRACE_S = 10.0

RUN_VARIABLES = ("JOBSUP_JOB_ID", "JOBSUP_ATTEMPT", "SLURM_JOB_ID", "SLURM_STEP_ID",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
"""What names one launch of a multi-task job, the same in every task of it and new in
the next (jobsup's attempt, SLURM's job step, torchrun's run and restart)."""


class LaunchError(ValueError):
    """The launcher's RANK / WORLD_SIZE cannot be used."""


@dataclass(frozen=True)
class Task:
    """This process as one of the tasks a launcher started (RANK of WORLD_SIZE)."""

    rank: int
    world_size: int
    run: str
    """`run_identity`: tells this launch's files from an earlier attempt's."""


def run_identity(env: Mapping[str, str]) -> str:
    """The launch's identity from `RUN_VARIABLES` ("" where none is set)."""
    return ",".join(f"{name}={env[name]}" for name in RUN_VARIABLES if env.get(name))


def launcher_task(env: Mapping[str, str]) -> Task | None:
    """This task's place when a launcher started several (WORLD_SIZE > 1), else None."""
    world_text, rank_text = env.get("WORLD_SIZE", "").strip(), env.get("RANK", "").strip()
    if not world_text:
        return None
    try:
        world = int(world_text)
        rank = int(rank_text or "0")
    except ValueError:
        raise LaunchError(f"WORLD_SIZE={world_text!r} RANK={rank_text!r} in the "
                          "environment are not whole numbers") from None
    if world <= 1:
        return None
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is not one of WORLD_SIZE={world}'s ranks 0-{world - 1}")
    run = run_identity(env)
    if not run:
        raise LaunchError(f"WORLD_SIZE={world} but none of {', '.join(RUN_VARIABLES)} is set "
                          "to tell this launch's ranks from an earlier one's")
    return Task(rank, world, run)


def global_ranks(task_rank: int, task_world: int, local_ranks: int) -> tuple[int, int]:
    """(global rank of this task's first local rank, global world size): local rank i of
    task t is t * local_ranks + i. Disjoint and complete only if every task runs the
    same number of local ranks, which the ranks' summaries check (world size in each)."""
    if local_ranks < 1 or task_world < 1 or not 0 <= task_rank < task_world:
        raise ValueError(f"task {task_rank} of {task_world} with {local_ranks} local ranks")
    return task_rank * local_ranks, task_world * local_ranks


def in_shard(index: int, rank: int, world_size: int) -> bool:
    """Sample `index` is rank `rank`'s (every world_size-th, from `rank`)."""
    return index % world_size == rank


def progress_file(state_dir: Path, rank: int) -> Path:
    """Global rank `rank`'s progress file (its JOBSUP_PROGRESS_FILE)."""
    return state_dir / f"progress.rank{rank}.json"


def rank_argv(argv: Sequence[str], *, drop: Sequence[str]) -> list[str]:
    """`argv` without the options in `drop` (each taking one value)."""
    out: list[str] = []
    skip = False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in drop:
            skip = "=" not in token
            continue
        out.append(token)
    return out


def run_ranks(module: str, argv: Sequence[str], *, devices: Sequence[str], state_dir: Path,
              first_rank: int = 0, world_size: int | None = None,
              until: Callable[[], bool] | None = None, poll_s: float = 0.5) -> int:
    """Run `python -m module argv --rank R --world-size W --device devices[r]` for each
    device, R = first_rank + r (W default len(devices)); returns 0 when all succeed,
    else the failing rank's exit code. The parent of global rank 0 writes the job's
    progress, summed over all W ranks; once its own ranks succeeded it keeps doing so
    until `until()` is true (the other tasks' ranks done)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    world = len(devices) if world_size is None else world_size
    ranks = [first_rank + r for r in range(len(devices))]
    procs: list[subprocess.Popen[bytes]] = []
    for rank, device in zip(ranks, devices, strict=True):
        progress_file(state_dir, rank).unlink(missing_ok=True)
        env = {**os.environ, "JOBSUP_PROGRESS_FILE": str(progress_file(state_dir, rank))}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", module, *argv, "--rank", str(rank), "--world-size",
             str(world), "--device", device], env=env))
    log.info("started %d ranks (%s of %d) on %s", len(devices),
             ", ".join(map(str, ranks)), world, ", ".join(devices))
    # "" writes nothing: only the parent of rank 0 speaks for the job
    reporter = ProgressReporter(None, "sample", path=None if first_rank == 0 else "")
    summed = [progress_file(state_dir, rank) for rank in range(world)]
    waiting = False
    try:
        while True:
            codes = [p.poll() for p in procs]
            report(reporter, summed)
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                index, code = failed[0]
                how = (f"killed by signal {-code}" if code < 0 else f"exit code {code}")
                log.error("rank %d (%s) failed (%s); stopping the other ranks", ranks[index],
                          devices[index], how)
                stop(procs)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                if until is None or until():
                    report(reporter, summed, force=True)
                    return 0
                if not waiting:
                    waiting = True
                    log.info("ranks %s done; waiting for the other tasks' ranks",
                             ", ".join(map(str, ranks)))
            time.sleep(poll_s)
    except BaseException:
        stop(procs)
        raise


def report(reporter: ProgressReporter, files: Sequence[Path], force: bool = False) -> None:
    """Sum the ranks' progress (done, total, rates) into the job's progress file."""
    done = total = 0
    metrics: dict[str, float] = {}
    known = 0
    for path in files:
        try:
            data: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        known += 1
        done += int(data.get("done") or 0)
        total += int(data.get("total") or 0)
        for name, value in (data.get("metrics") or {}).items():
            metrics[name] = metrics.get(name, 0.0) + float(value)
    reporter.total = total if known == len(files) and total else None
    metrics["ranks_reporting"] = float(known)
    reporter.update(done, metrics, force=force)


def stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
