"""What every backend shares: the abstract `Backend`, the `Attempt`, its paths and its
`launch.json`, and the check that a spec can run at all.

The engine talks to a backend only through `Backend`: start an attempt, read what the
shim recorded, ask whether the attempt still lives, stop it. The `slurm` backend
(`slurm.py`) implements the same calls with sbatch/squeue/scancel and a shim inside
the allocation; the `local` backend (`local.py`) runs the shim on this machine.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from supervisor.errors import InvalidSpec
from supervisor.runtime import files
from supervisor.runtime.fileio import atomic_write_json
from supervisor.runtime.files import ExitStatus, WorkerInfo
from supervisor.runtime.procfs import (
    StatReader,
    all_stats,
    is_same_process,
    is_started_at,
    read_stat,
)
from supervisor.spec import ExitReason, JobSpec

log = logging.getLogger(__name__)

SCRUBBED_ENV = frozenset({"JOBSUP_TOKEN", "JOBSUP_SLACK_WEBHOOK_URL", "JOBSUP_WEBHOOK_URL",
                          "JOBSUP_DATABASE_URL", "JOBSUP_WEBHOOK_SECRET", "PGPASSWORD",
                          "PGPASSFILE"})
"""Daemon settings a job must not inherit (secrets), upper-case: see `scrubbed_env`."""


def scrubbed_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without `SCRUBBED_ENV`, matched whatever the case: settings are read
    case-insensitively, so `jobsup_token=X jobsup serve` turns the token on too."""
    return {k: v for k, v in environ.items() if k.upper() not in SCRUBBED_ENV}


# built per job per tick, not changed once shown: not frozen (4x the cost to build: #15)
@dataclass(slots=True)
class Attempt:
    """One launch of a job: where its files live and which processes run it."""

    job_id: str
    number: int
    dir: Path
    shim_pid: int | None = None
    shim_create_time: float | None = None
    shim_start_ticks: int | None = None
    """The shim's identity with its pid (`procfs.is_same_process`)."""


PATHS_CACHED = 4096
"""Paths kept built (immutable `Path`s): the tick asks for each running job's several
times, and joining a `Path` costs ~3 us of Python each time (#15)."""


@functools.lru_cache(maxsize=PATHS_CACHED)
def attempt_dir(jobs_dir: Path, job_id: str, number: int) -> Path:
    return jobs_dir / job_id / f"attempt-{number}"


@functools.lru_cache(maxsize=PATHS_CACHED)
def log_path(jobs_dir: Path, job_id: str, number: int) -> Path:
    """stdout+stderr of one attempt."""
    return attempt_dir(jobs_dir, job_id, number) / files.OUTPUT_LOG


@functools.lru_cache(maxsize=PATHS_CACHED)
def progress_path(jobs_dir: Path, job_id: str) -> Path:
    """The file a cooperating worker replaces with its progress JSON (JOBSUP_PROGRESS_FILE)."""
    return jobs_dir / job_id / "progress.json"


def job_environment(base: Mapping[str, str], spec: JobSpec, job_id: str, number: int,
                    progress_file: Path) -> dict[str, str]:
    env = scrubbed_env(base)
    env.update(spec.env)
    env["JOBSUP_JOB_ID"] = job_id
    env["JOBSUP_ATTEMPT"] = str(number)
    env["JOBSUP_PROGRESS_FILE"] = str(progress_file)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def observe_request(spec: JobSpec, interval_s: float) -> files.Observe:
    """`launch.json`'s `observe` for a job whose shim publishes its readings."""
    return files.Observe(interval_s=interval_s, output_dir=spec.output_dir,
                         pattern=spec.pattern, gpu=True)


def write_launch(jobs_dir: Path, job_id: str, number: int, spec: JobSpec, *, cwd: str,
                 stop_grace_s: float, argv: list[str] | None = None,
                 inherit_env: Sequence[str] = (),
                 observe: files.Observe | None = None) -> Path:
    """Create the attempt's directory and its `launch.json` (what the shim runs: `argv`,
    default the spec's command; `inherit_env`, prefixes of variables the worker takes
    from the shim's own environment, such as the allocation's `SLURM_`; `observe`, the
    shim publishes its readings); the directory."""
    adir = attempt_dir(jobs_dir, job_id, number)
    adir.mkdir(parents=True, exist_ok=True)
    env = job_environment(os.environ, spec, job_id, number, progress_path(jobs_dir, job_id))
    launch = files.Launch(
        job_id=job_id, attempt=number, argv=argv or spec.command, cwd=cwd, env=env,
        log_path=str(adir / files.OUTPUT_LOG), stop_grace_s=stop_grace_s,
    )
    if inherit_env:
        launch["inherit_env"] = list(inherit_env)
    if observe is not None:
        launch["observe"] = observe
    atomic_write_json(adir / files.LAUNCH, launch)
    return adir


class LaunchDeferred(OSError):
    """The backend cannot launch now but may later (a scheduler that does not answer):
    the job goes back to `pending` and the launch is tried again."""


@dataclass(frozen=True)
class SchedulerEnd:
    """How a cluster scheduler says an attempt ended, when that, not the worker's exit
    code, is the reason (a time limit, a cancel, a preemption, a failed node)."""

    state: str
    """The scheduler's own word (SLURM: TIMEOUT, CANCELLED, NODE_FAIL, ...)."""
    exit_reason: ExitReason
    reason: str
    """In words, with the scheduler's job id."""
    restartable: bool = True
    """False for a cancel from outside jobsup: a person ended it, the restart policy does
    not undo that (the job ends `stopped`)."""


class LaunchFate(StrEnum):
    """What became of a launch whose shim left no trace in time."""

    ABANDONED = "abandoned"
    """The daemon now owns the attempt; a late shim will not start the job: launch it
    again."""
    WAIT = "wait"
    """A live shim owns it and is still starting, or the claim cannot be written (a
    full disk): ask again next tick."""
    DEAD = "dead"
    """A shim owned it and died before recording anything: the job is lost."""


class ShimState(StrEnum):
    """The attempt's shim, from one look at it."""

    GONE = "gone"
    """Not the live process it was (exited, a zombie, or its pid reused)."""
    RUNNING = "running"
    SUSPENDED = "suspended"
    """Alive but stopped (SIGSTOP): it can neither reap the worker nor record its exit
    until it is continued."""


class Backend(ABC):
    """What the engine needs of a launcher. `LocalBackend` runs shims on this machine;
    a cluster backend (`slurm.SlurmBackend`) implements the same calls with its
    scheduler's tools."""

    def scheduler_end(self, attempt: Attempt) -> SchedulerEnd | None:
        """Why the scheduler ended an attempt that `read_exit` reported ended, when the
        scheduler's reason overrides the exit code (None: the exit code tells)."""
        return None

    def status_note(self, attempt: Attempt) -> str | None:
        """What the scheduler says of a running attempt (queued, and why), for the job's
        `reason`; None when there is nothing to add."""
        return None

    def queued(self, attempt: Attempt) -> bool:
        """The attempt waits in a cluster scheduler's queue: launched, not yet running on
        a node, so it can neither work nor stall (`running_since`). Never here: a local
        attempt runs from its launch."""
        return False

    def running_since(self, attempt: Attempt, now: float) -> float | None:
        """When an attempt that left a scheduler's queue began running on its node, on
        the daemon's clock (`now` is its reading): where its stall and startup clocks
        start. None while it is `queued`, and on a backend without a queue (the attempt's
        launch, its `started_at`, is its start)."""
        return None

    observes_locally: bool = True
    """The daemon can read its jobs' /proc, NVML and output files (they run here). A
    backend whose shims run on other nodes sets it False, asks them to publish their
    readings (`observe_request` in `launch.json`) and the engine reads those instead."""

    @abstractmethod
    def start(self, job_id: str, number: int, spec: JobSpec, *, cwd: str,
              stop_grace_s: float) -> Attempt:
        """Launch attempt `number` of the job through a shim; OSError if it cannot."""

    @abstractmethod
    def attempt(self, job_id: str, number: int, shim_pid: int | None,
                shim_create_time: float | None, shim_start_ticks: int | None) -> Attempt:
        """The attempt of a stored job (the shim's identity from the attempt's files
        when the database does not have it)."""

    def scheduler_job_id(self, attempt: Attempt) -> str | None:
        """The cluster scheduler's id of the attempt (a SLURM job id); None here."""
        return None

    @abstractmethod
    def read_worker(self, attempt: Attempt) -> WorkerInfo | None:
        """The worker the shim started, None before it started one."""

    @abstractmethod
    def worker_alive(self, worker: WorkerInfo) -> bool:
        """The worker, or what it left in its process group, still runs."""

    def worker_running(self, worker: WorkerInfo) -> bool:
        """The worker process itself still runs (not a zombie), whatever it left in its
        group: what tells whether a stopped shim has an exit to reap and record."""
        return self.worker_alive(worker)

    @abstractmethod
    def read_exit(self, attempt: Attempt) -> ExitStatus | None:
        """What the shim recorded when the worker ended; None while it runs."""

    @abstractmethod
    def shim_state(self, attempt: Attempt, stat_of: StatReader | None = None) -> ShimState:
        """Whether the attempt's shim is the live process it was (pid and create time),
        and whether it is stopped. `stat_of`: where a local shim's /proc stat is read
        (the tick's sampler, which keeps the jobs' files open), else `procfs.read_stat`."""

    def shim_alive(self, attempt: Attempt) -> bool:
        return self.shim_state(attempt) is not ShimState.GONE

    @abstractmethod
    def resume_shim(self, attempt: Attempt) -> None:
        """Continue a stopped shim (SIGCONT)."""

    @abstractmethod
    def request_stop(self, attempt: Attempt, worker: WorkerInfo | None) -> None:
        """Ask the shim to stop the job: SIGTERM, SIGKILL after the grace."""

    @abstractmethod
    def kill(self, attempt: Attempt, worker: WorkerInfo | None) -> None:
        """Backstop when the shim did not finish a stop in time: kill the job's
        processes, never the shim, which must live to reap them and record the exit."""

    @abstractmethod
    def watch(self, attempt: Attempt, worker: WorkerInfo | None) -> None:
        """Wake the engine as soon as the attempt's shim (or shim-less worker) exits."""

    @abstractmethod
    def settle_launch(self, attempt: Attempt) -> LaunchFate:
        """Claim an attempt whose shim left no trace in time (see `LaunchFate`)."""

    @abstractmethod
    def forget(self, attempt: Attempt) -> None:
        """The attempt ended: stop watching it."""

    @abstractmethod
    def reap(self) -> None:
        """Collect the backend's exited children."""

    @abstractmethod
    def close(self) -> None:
        """Release the backend's threads and descriptors."""


def worker_group_alive(worker: WorkerInfo) -> bool:
    """True while the worker's process group holds a live process of this job: the worker
    itself or, once it has ended with no shim left to clean up, what it left in its group.

    The group's id is the worker's pid, and the kernel keeps a pid number reserved while
    any process still has it as its group id. So the group is still the worker's unless
    another process now holds that pid (then the group, if any, is that stranger's)."""
    if is_same_process(worker.pid, worker.create_time, worker.start_ticks):
        return True
    holder = read_stat(worker.pid)  # our worker as a zombie, or a stranger
    if holder is not None and not is_started_at(holder, worker.start_ticks, worker.create_time):
        return False
    return any(stat.pgid == worker.pid and stat.state not in ("Z", "X")
               for stat in all_stats())


def _package_root_on_path() -> str:
    """PYTHONPATH that lets the shim import `supervisor` even from a source checkout."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding supervisor/
    existing = os.environ.get("PYTHONPATH")
    return f"{root}{os.pathsep}{existing}" if existing else root


def check_runnable(spec: JobSpec, *, default_cwd: str) -> JobSpec:
    """The spec with an absolute cwd, or InvalidSpec naming what cannot run: a cwd that
    does not exist, a program not found on PATH or not executable."""
    cwd = Path(spec.cwd or default_cwd)
    if not cwd.is_absolute():
        cwd = Path(default_cwd) / cwd
    try:
        is_dir = cwd.is_dir()
    except OSError as exc:  # a name too long, a loop of links
        raise InvalidSpec(f"cwd: {exc.strerror}", field="cwd") from None
    if not is_dir:
        raise InvalidSpec(f"cwd: directory {str(cwd)!r} does not exist", field="cwd")
    program = spec.command[0]
    if "/" in program:
        path = Path(program) if Path(program).is_absolute() else cwd / program
        if not path.is_file():
            raise InvalidSpec(f"command: executable {program!r} not found (looked at {path})",
                              field="command")
        if not os.access(path, os.X_OK):
            raise InvalidSpec(f"command: {program!r} is not executable",
                              hint=f"chmod +x {path}", field="command")
    else:
        search_path = spec.env.get("PATH", os.environ.get("PATH", os.defpath))
        if shutil.which(program, path=search_path) is None:
            raise InvalidSpec(f"command: executable {program!r} not found on PATH",
                              hint="give an absolute path or set PATH in the job's env",
                              field="command")
    return spec.model_copy(update={"cwd": str(cwd.resolve())})
