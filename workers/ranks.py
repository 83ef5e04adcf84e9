"""Data-parallel ranks for a worker: one process per device, each taking every N-th
sample, one shared output tree and manifest, one progress figure for the job.

The parent starts the ranks as its children (same process group, so a stop of the job
reaches them all), sums their progress files into its own (the one jobsup reads), and
fails fast: when a rank fails, the others are stopped and the job exits with that
rank's code, naming the rank and its device in the log.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workers.common import ProgressReporter

log = logging.getLogger("workers.ranks")

STOP_GRACE_S = 10.0


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
              poll_s: float = 0.5) -> int:
    """Run `python -m module argv --rank r --world-size N --device devices[r]` for each
    rank; returns 0 when all succeed, else the failing rank's exit code."""
    state_dir.mkdir(parents=True, exist_ok=True)
    world = len(devices)
    procs: list[subprocess.Popen[bytes]] = []
    progress_files = [state_dir / f"progress.rank{r}.json" for r in range(world)]
    for r, device in enumerate(devices):
        progress_files[r].unlink(missing_ok=True)
        env = {**os.environ, "JOBSUP_PROGRESS_FILE": str(progress_files[r])}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", module, *argv, "--rank", str(r), "--world-size", str(world),
             "--device", device], env=env))
    log.info("started %d ranks on %s", world, ", ".join(devices))
    reporter = ProgressReporter(None, "sample")
    try:
        while True:
            codes = [p.poll() for p in procs]
            report(reporter, progress_files)
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                how = (f"killed by signal {-code}" if code < 0 else f"exit code {code}")
                log.error("rank %d (%s) failed (%s); stopping the other ranks", rank,
                          devices[rank], how)
                stop(procs)
                return code if code > 0 else 128 - code
            if all(c == 0 for c in codes):
                report(reporter, progress_files, force=True)
                return 0
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
