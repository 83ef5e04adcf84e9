"""The parent of `workers.extract`'s ranks: one rank per device of this process, and
with several tasks (nodes) this task's share of the global ranks. Owns the order that
keeps the manifest whole: it is settled (`hidden_files.restore_manifest`) only while
no rank writes, and with several tasks only by the task of rank 0, once every rank of
this launch has written its summary (`hidden_files.ranks_finished`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from workers.common import fail
from workers.eagle3.extraction.hidden_files import (
    RANKS_DIR,
    merge_summaries,
    ranks_finished,
    restore_manifest,
)
from workers.eagle3.extraction.ranks import Task, global_ranks, rank_argv, run_ranks


def run_parent(args: argparse.Namespace, argv: Sequence[str], devices: list[str],
               task: Task | None) -> int:
    """The parent of this process's ranks (workers/eagle3/extraction/ranks.py): one per device,
    numbered globally when this is one task of several. The manifest is settled while no rank
    runs: here before and after them; with several tasks, only by the task of rank 0
    once every rank of this launch has finished (the others may still be writing)."""
    # the store this parent resolved (--store, the resumed extraction's, or the default):
    # a rank that read a half-written extract_config.json must not choose another
    own = [*rank_argv(argv, drop=("--gpus", "--gpus-per-model", "--ranks", "--device",
                                  "--store")), "--store", args.store]
    if task is None:
        first, world, until = 0, len(devices), None
        restore_manifest(args.out)
    else:
        first, world = global_ranks(task.rank, task.world_size, len(devices))
        until = None if first else (lambda: ranks_finished(args.out, world, task.run))
    try:
        code = run_ranks("workers.extract", own, devices=devices,
                         state_dir=args.out / RANKS_DIR, first_rank=first, world_size=world,
                         until=until)
    except ValueError as exc:  # ranks_finished: the tasks disagree on their rank count
        fail(str(exc))
    if code == 0 and first == 0:
        restore_manifest(args.out)
        merge_summaries(args.out, world)
    return code
