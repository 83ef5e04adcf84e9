"""The shim <-> daemon contract: the files of one attempt directory,
`DATA_DIR/jobs/ID/attempt-N/`, their names, their JSON fields, and the one reader of each.

The daemon (`backends/`, `daemon/rebuild.py`) and the per-job shim (`shim.py`) both
import this module, so a file or a field is named in one place; the TypedDicts let mypy
check every writer's keys. Stdlib only: the shim imports it.

Who writes what, in order:

- `launch.json` (`Launch`), the daemon, before it starts the shim: what to run.
- `status.json` (`Status`), the shim, first as `RESERVED` at its full size, then
  overwritten in place with the exit when the worker ends.
- `claim.json` (`Claim`), created exactly once (hard link of a whole temp file): by the
  shim before it starts the worker, or by a daemon that gave the launch up. Whoever
  creates it owns the attempt.
- `shim.json` (`Identity`), the shim, once it owns the attempt.
- `worker.json` (`WorkerRecord`), the shim, once the worker runs.
- `observed.jsonl` (`Observed`, one JSON line per reading), the shim, every
  `Observe.interval_s` while the worker runs, when `launch.json` asks for it with an
  `observe` object: what the daemon cannot read itself when the job runs on another
  node (its process tree, GPU memory, output files, free disk). Append-only, rotated to
  `observed.jsonl.1` at `Observe.max_bytes` (`runtime/publish.py` writes it,
  `observe/remote.py` reads it; its line format is `observed.py`'s).

A process is named by (pid, start ticks, boot id), never by its pid alone (`procfs`). Every file
lives in a directory the job can write to: the readers here trust no type, and answer
None for a missing, unreadable or malformed file.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

from supervisor.runtime.fileio import create_json_exclusive, read_json
from supervisor.runtime.observed import float_or_none, int_or_none, str_or_none
from supervisor.runtime.procfs import boot_id_or_none, is_same_process

LAUNCH = "launch.json"
CLAIM = "claim.json"
SHIM = "shim.json"
WORKER = "worker.json"
STATUS = "status.json"
OUTPUT_LOG = "output.log"
"""The worker's stdout and stderr (`Launch.log_path` names it)."""
SHIM_LOG = "shim.log"
"""The shim's own stdout and stderr."""
OBSERVED = "observed.jsonl"
"""The shim's readings of its job, one JSON line each (`Observed`)."""
OBSERVED_ROTATED = "observed.jsonl.1"
"""`OBSERVED` renamed when it reached `Observe.max_bytes` (the one before is dropped)."""
OBSERVED_MAX_BYTES = 1 << 20
"""Default cap of `OBSERVED`: ~2,500 readings, 80 minutes at a 2 s interval; with the
rotated file, what a daemon away that long finds when it comes back."""
OBSERVED_MIN_BYTES = 4096
"""The least `Observe.max_bytes` taken: a reading is a few hundred bytes."""

PATHS_CACHED = 4096
"""Paths kept built (immutable `Path`s): the tick asks for each running job's several
times, and joining a `Path` costs ~3 us of Python each time (#15)."""


DATA_DIR_ID = "data_dir.json"
"""`DATA_DIR/data_dir.json`: {"id": a random hex id}, made by the first daemon on the data
dir; it moves with the directory (renamed, symlinked, mounted elsewhere)."""


def data_dir_id(data_dir: Path) -> str | None:
    """The data dir's identity (`DATA_DIR_ID`), made on first use: a daemon on another
    data dir, or on another host at the same path, has another one. None when it can be
    neither read nor made (a read-only or full data dir, where a daemon still starts)."""
    path = data_dir / DATA_DIR_ID
    try:
        for _ in range(2):
            record = read_json(path)
            if isinstance(record, dict) and isinstance(record.get("id"), str) and record["id"]:
                return str(record["id"])
            if path.exists():  # unreadable or foreign: replaced (a job's check falls back
                path.unlink(missing_ok=True)  # to its files being here)
            create_json_exclusive(path, {"id": os.urandom(16).hex()})
    except OSError:
        return None
    return None


def launched_from(data_dir: Path, jobs_dir: Path) -> tuple[str | None, str]:
    """What an attempt records of where it was launched (`Job.data_dir_id`,
    `Job.jobs_dir`): the data dir's id and the real path of its jobs dir."""
    return data_dir_id(data_dir), os.path.realpath(jobs_dir)


@functools.lru_cache(maxsize=PATHS_CACHED)
def attempt_dir(jobs_dir: Path, job_id: str, number: int) -> Path:
    """`DATA_DIR/jobs/ID/attempt-N/`: the files of attempt `number` of the job."""
    return jobs_dir / job_id / f"attempt-{number}"


@functools.lru_cache(maxsize=PATHS_CACHED)
def log_path(jobs_dir: Path, job_id: str, number: int) -> Path:
    """stdout+stderr of one attempt."""
    return attempt_dir(jobs_dir, job_id, number) / OUTPUT_LOG


@functools.lru_cache(maxsize=PATHS_CACHED)
def progress_path(jobs_dir: Path, job_id: str) -> Path:
    """The file a cooperating worker replaces with its progress JSON (JOBSUP_PROGRESS_FILE)."""
    return jobs_dir / job_id / "progress.json"


Claimant = Literal["shim", "daemon"]


class Observe(TypedDict):
    """`launch.json`'s `observe`: the shim publishes readings of its job (`OBSERVED`)."""

    interval_s: float
    """Seconds between two readings (the daemon's sample interval)."""
    output_dir: str | None
    """The job's output directory, scanned on the node (None: no scan)."""
    pattern: str
    """Its item pattern (`JobSpec.pattern`)."""
    gpu: bool
    """Read the tree's GPU memory through NVML (where it imports and answers)."""
    max_bytes: NotRequired[int]
    """Cap of `OBSERVED` before it rotates (`OBSERVED_MAX_BYTES`)."""


class Launch(TypedDict):
    """`launch.json`: what the shim runs."""

    job_id: str
    attempt: int
    argv: list[str]
    cwd: str
    env: dict[str, str]
    log_path: str
    """Absolute path of the attempt's `OUTPUT_LOG`."""
    stop_grace_s: float
    """Seconds between the SIGTERM of a stop and the SIGKILL."""
    inherit_env: NotRequired[list[str]]
    """Prefixes of variables the worker takes from the shim's own environment on top of
    `env` (the `slurm` backend: `SLURM_`, the allocation's, which srun needs)."""
    observe: NotRequired[Observe]
    """Present: the shim publishes readings (`OBSERVED`); absent: the daemon reads the
    job's processes and files itself."""


class Claim(TypedDict):
    """`claim.json`: who owns the attempt."""

    by: Claimant
    pid: int | None
    create_time: NotRequired[float | None]
    """The shim's; a daemon's claim has none (the daemon's liveness does not matter)."""
    start_ticks: NotRequired[int | None]
    """The shim's start ticks (`procfs.start_ticks_of`), its identity with `pid`."""
    boot_id: NotRequired[str | None]
    """The boot the shim runs in (`procfs.this_boot_id`), its identity with the two."""


class Identity(TypedDict):
    """`shim.json`: the shim's identity."""

    pid: int
    create_time: float | None
    """Seconds since the epoch, as `procfs.create_time` computes it (for people: the
    identity is `start_ticks`)."""
    start_ticks: NotRequired[int | None]
    """Start time after boot in clock ticks (`procfs.start_ticks_of`); absent in files
    of an older shim, which `procfs.is_same_process` then matches by create time."""
    boot_id: NotRequired[str | None]
    """The boot it started in (`procfs.this_boot_id`): start ticks count from each
    boot. Absent in files of a shim older than boot ids (#46), which
    `procfs.is_same_process` then tells from another boot's by create time."""


class WorkerRecord(Identity):
    """`worker.json`: the worker's identity (its pid is also its process group id)."""

    started_at: float
    """Seconds since the epoch (wall clock) when the shim started it."""


class Reserved(TypedDict):
    reserved: Literal[True]


RESERVED: Reserved = {"reserved": True}
"""What `status.json` holds while the worker runs."""


class Status(TypedDict):
    """`status.json` once the worker ended."""

    pid: int | None
    """The worker's; None when it could not be started."""
    exit_code: int | None
    """None when a signal ended it."""
    signal: int | None
    ended_at: float
    """Seconds since the epoch (wall clock); its presence marks a recorded exit."""
    stop_requested: bool
    killed_after_grace: bool
    max_rss_bytes: int
    """Peak RSS of the worker (wait4's ru_maxrss)."""
    spawn_error: str | None
    """Why the worker could not be started (at most 300 characters)."""
    oom_kills: int | None
    """OOM kills in the shim's memory cgroup during the run; None without one."""


@dataclass(frozen=True)
class WorkerInfo:
    """`worker.json` as read back."""

    pid: int
    create_time: float | None
    started_at: float
    start_ticks: int | None = None
    boot_id: str | None = None


@dataclass(frozen=True)
class ExitStatus:
    """`status.json` as read back: what the shim wrote when the worker ended."""

    exit_code: int | None
    signal: int | None
    ended_at: float
    stop_requested: bool
    killed_after_grace: bool
    max_rss_bytes: int
    spawn_error: str | None
    oom_kills: int | None = None
    """OOM kills in the shim's cgroup during the run (None: no readable cgroup)."""


def _observe(value: Any) -> Observe | None:
    if not isinstance(value, dict):
        return None
    interval = float_or_none(value.get("interval_s"))
    max_bytes = int_or_none(value.get("max_bytes"))
    return Observe(
        interval_s=interval if interval is not None and interval > 0 else 2.0,
        output_dir=str_or_none(value.get("output_dir")) or None,
        pattern=str_or_none(value.get("pattern")) or "**/*", gpu=value.get("gpu") is not False,
        max_bytes=max(max_bytes or OBSERVED_MAX_BYTES, OBSERVED_MIN_BYTES))


def read_launch(adir: str | os.PathLike[str]) -> Launch | None:
    """The attempt's `launch.json`, None unless it names at least an argv (a list of
    strings). Fields a daemon of an older version did not write get their defaults:
    `cwd` "/", `env` {}, `log_path` the attempt's output.log, `stop_grace_s` 10."""
    data = read_json(Path(adir) / LAUNCH)
    if not isinstance(data, dict):
        return None
    argv, env = data.get("argv"), data.get("env")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        return None
    grace = float_or_none(data.get("stop_grace_s"))
    launch = Launch(
        job_id=str_or_none(data.get("job_id")) or "", attempt=int_or_none(data.get("attempt")) or 0,
        argv=argv, cwd=str_or_none(data.get("cwd")) or "/",
        env={str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {},
        log_path=str_or_none(data.get("log_path")) or str(Path(adir) / OUTPUT_LOG),
        stop_grace_s=grace if grace is not None and grace > 0 else 10.0,
    )
    inherit = data.get("inherit_env")
    if isinstance(inherit, list):
        launch["inherit_env"] = [p for p in inherit if isinstance(p, str) and p]
    observe = _observe(data.get("observe"))
    if observe is not None:
        launch["observe"] = observe
    return launch


def read_claim(adir: str | os.PathLike[str]) -> Claim | None:
    """The attempt's `claim.json`, None when there is none or it names no claimant."""
    data = read_json(Path(adir) / CLAIM)
    if not isinstance(data, dict) or data.get("by") not in ("shim", "daemon"):
        return None
    return Claim(by=data["by"], pid=int_or_none(data.get("pid")),
                 create_time=float_or_none(data.get("create_time")),
                 start_ticks=int_or_none(data.get("start_ticks")),
                 boot_id=boot_id_or_none(data.get("boot_id")))


def read_shim(adir: str | os.PathLike[str]) -> Identity | None:
    """The attempt's `shim.json`, None before the shim wrote it."""
    data = read_json(Path(adir) / SHIM)
    if not isinstance(data, dict) or int_or_none(data.get("pid")) is None:
        return None
    return Identity(pid=data["pid"], create_time=float_or_none(data.get("create_time")),
                    start_ticks=int_or_none(data.get("start_ticks")),
                    boot_id=boot_id_or_none(data.get("boot_id")))


def read_worker(adir: str | os.PathLike[str]) -> WorkerInfo | None:
    """The attempt's `worker.json`, None before the shim started a worker."""
    data = read_json(Path(adir) / WORKER)
    if not isinstance(data, dict) or int_or_none(data.get("pid")) is None:
        return None
    return WorkerInfo(data["pid"], float_or_none(data.get("create_time")),
                      float_or_none(data.get("started_at")) or 0.0,
                      int_or_none(data.get("start_ticks")), boot_id_or_none(data.get("boot_id")))


def live_processes(jobs_dir: str | os.PathLike[str]) -> Iterator[tuple[str, int]]:
    """(SHIM or WORKER, pid) of every attempt's shim and worker under `jobs_dir` that
    is still the process its file recorded (pid, start ticks, boot): what a test or a
    benchmark must kill when it tears a data dir down."""
    for adir in sorted(Path(jobs_dir).glob("*/attempt-*")):
        shim, worker = read_shim(adir), read_worker(adir)
        if shim is not None and is_same_process(shim["pid"], shim["create_time"],
                                                shim.get("start_ticks"), shim.get("boot_id")):
            yield SHIM, shim["pid"]
        if worker is not None and is_same_process(worker.pid, worker.create_time,
                                                  worker.start_ticks, worker.boot_id):
            yield WORKER, worker.pid


def read_exit(adir: str | os.PathLike[str]) -> ExitStatus | None:
    """The attempt's recorded exit; None while the worker runs (`status.json` holds
    only the reservation, or a torn overwrite) and when there is no `status.json`."""
    data = read_json(Path(adir) / STATUS)
    if not isinstance(data, dict):
        return None
    ended_at = float_or_none(data.get("ended_at"))
    if ended_at is None:
        return None
    return ExitStatus(
        exit_code=int_or_none(data.get("exit_code")), signal=int_or_none(data.get("signal")),
        ended_at=ended_at, stop_requested=bool(data.get("stop_requested")),
        killed_after_grace=bool(data.get("killed_after_grace")),
        max_rss_bytes=int_or_none(data.get("max_rss_bytes")) or 0,
        spawn_error=str_or_none(data.get("spawn_error")),
        oom_kills=int_or_none(data.get("oom_kills")),
    )
