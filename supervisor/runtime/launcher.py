"""Start, stop and re-adopt jobs. Backend `local`: the shim runs on this machine.

The engine talks to a backend only through `Backend`: start an attempt, read what the
shim recorded, ask whether the attempt still lives, stop it. The `slurm` backend
(`slurm.py`) implements the same calls with sbatch/squeue/scancel and a shim inside
the allocation.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from supervisor.errors import InvalidSpec
from supervisor.runtime import files
from supervisor.runtime.fileio import atomic_write_json, create_json_exclusive
from supervisor.runtime.files import ExitStatus, WorkerInfo
from supervisor.runtime.procfs import (
    all_stats,
    is_same_process,
    is_started_at,
    read_stat,
    signal_group,
    start_ticks_to_time,
)
from supervisor.spec import ExitReason, JobSpec

log = logging.getLogger(__name__)

SCRUBBED_ENV = ("JOBSUP_TOKEN", "JOBSUP_SLACK_WEBHOOK_URL", "JOBSUP_WEBHOOK_URL",
                "JOBSUP_DATABASE_URL", "JOBSUP_WEBHOOK_SECRET", "PGPASSWORD", "PGPASSFILE")
"""Daemon settings a job must not inherit (secrets)."""


@dataclass(frozen=True)
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
    env = {k: v for k, v in base.items() if k not in SCRUBBED_ENV}
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

    @abstractmethod
    def read_exit(self, attempt: Attempt) -> ExitStatus | None:
        """What the shim recorded when the worker ended; None while it runs."""

    @abstractmethod
    def shim_state(self, attempt: Attempt) -> ShimState:
        """Whether the attempt's shim is the live process it was (pid and create time),
        and whether it is stopped."""

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


class LocalBackend(Backend):
    """Shims as children of the daemon on this machine."""

    def __init__(self, jobs_dir: Path, on_exit: Callable[[], None], *,
                 publish_interval_s: float | None = None):
        """`publish_interval_s`: the shims publish their readings this often
        (`JOBSUP_OBSERVE=shim`); None: the daemon reads the jobs itself."""
        self.jobs_dir = jobs_dir
        self.publish_interval_s = publish_interval_s
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._watcher = ExitWatcher(on_exit)

    def start(self, job_id: str, number: int, spec: JobSpec, *, cwd: str,
              stop_grace_s: float) -> Attempt:
        adir = write_launch(
            self.jobs_dir, job_id, number, spec, cwd=cwd, stop_grace_s=stop_grace_s,
            observe=(observe_request(spec, self.publish_interval_s)
                     if self.publish_interval_s is not None else None))
        with open(adir / files.SHIM_LOG, "ab") as shim_log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "supervisor.runtime.shim", str(adir)],
                stdin=subprocess.DEVNULL, stdout=shim_log, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True, cwd="/",
                env={**{k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV},
                     "PYTHONPATH": _package_root_on_path()},
            )
        self._children[proc.pid] = proc
        stat = read_stat(proc.pid)
        attempt = Attempt(job_id, number, adir, proc.pid,
                          start_ticks_to_time(stat.start_ticks) if stat else None,
                          stat.start_ticks if stat else None)
        self._watcher.add(proc.pid)
        return attempt

    def attempt(self, job_id: str, number: int, shim_pid: int | None,
                shim_create_time: float | None, shim_start_ticks: int | None) -> Attempt:
        """The attempt of a stored job; the shim's identity from its own `shim.json` when
        the daemon died before recording it."""
        adir = attempt_dir(self.jobs_dir, job_id, number)
        if shim_pid is None:
            shim = files.read_shim(adir)
            if shim is not None:
                shim_pid, shim_create_time = shim["pid"], shim["create_time"]
                shim_start_ticks = shim.get("start_ticks")
        return Attempt(job_id, number, adir, shim_pid, shim_create_time, shim_start_ticks)

    def settle_launch(self, attempt: Attempt) -> LaunchFate:
        """Claim an attempt whose shim left no trace (see `LaunchFate`)."""
        try:
            attempt.dir.mkdir(parents=True, exist_ok=True)
            claimed = create_json_exclusive(attempt.dir / files.CLAIM,
                                            files.Claim(by="daemon", pid=os.getpid()))
        except OSError as exc:
            log.warning("job %s: cannot claim attempt %d's launch (%s); asking again next "
                        "tick", attempt.job_id, attempt.number, exc)
            return LaunchFate.WAIT
        if claimed:
            return LaunchFate.ABANDONED
        claim = files.read_claim(attempt.dir)
        if claim is not None and claim["by"] == "daemon":
            return LaunchFate.ABANDONED  # by an earlier daemon that died before relaunching
        if claim is not None and is_same_process(claim["pid"], claim.get("create_time"),
                                                 claim.get("start_ticks")):
            return LaunchFate.WAIT
        return LaunchFate.DEAD

    def worker_alive(self, worker: WorkerInfo) -> bool:
        """The worker, or what it left in its process group, still runs."""
        return worker_group_alive(worker)

    def read_worker(self, attempt: Attempt) -> WorkerInfo | None:
        return files.read_worker(attempt.dir)

    def read_exit(self, attempt: Attempt) -> ExitStatus | None:
        return files.read_exit(attempt.dir)

    def shim_state(self, attempt: Attempt) -> ShimState:
        stat = read_stat(attempt.shim_pid) if attempt.shim_pid is not None else None
        if (stat is None or stat.state in ("Z", "X")
                or not is_started_at(stat, attempt.shim_start_ticks, attempt.shim_create_time)):
            return ShimState.GONE
        return ShimState.SUSPENDED if stat.state in ("T", "t") else ShimState.RUNNING

    def request_stop(self, attempt: Attempt, worker: WorkerInfo | None) -> None:
        """Ask the shim to stop the job (it runs SIGTERM -> grace -> SIGKILL). Without a
        live shim, signal the worker's group directly, while it is still the job's."""
        if self.shim_alive(attempt) and attempt.shim_pid is not None:
            os.kill(attempt.shim_pid, signal.SIGTERM)
        elif worker is not None and worker_group_alive(worker):
            signal_group(worker.pid, signal.SIGTERM)

    def kill(self, attempt: Attempt, worker: WorkerInfo | None) -> None:
        """SIGKILL the worker's group and the shim's other children (orphans it
        adopted), never the shim itself; then continue the shim in case it was stopped
        (SIGSTOP), so it reaps them and records the exit."""
        if worker is not None and worker_group_alive(worker):
            signal_group(worker.pid, signal.SIGKILL)
        if self.shim_alive(attempt) and attempt.shim_pid is not None:
            for stat in all_stats():
                if stat.ppid == attempt.shim_pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(stat.pid, signal.SIGKILL)
            self.resume_shim(attempt)

    def resume_shim(self, attempt: Attempt) -> None:
        if attempt.shim_pid is not None and self.shim_alive(attempt):
            with contextlib.suppress(ProcessLookupError):
                os.kill(attempt.shim_pid, signal.SIGCONT)

    def watch(self, attempt: Attempt, worker: WorkerInfo | None) -> None:
        """Wake the engine as soon as this attempt's shim (or shim-less worker) exits."""
        if self.shim_alive(attempt) and attempt.shim_pid is not None:
            self._watcher.add(attempt.shim_pid)
        elif worker is not None and is_same_process(worker.pid, worker.create_time,
                                                    worker.start_ticks):
            self._watcher.add(worker.pid)

    def forget(self, attempt: Attempt) -> None:
        if attempt.shim_pid is not None:
            self._watcher.remove(attempt.shim_pid)

    def reap(self) -> None:
        """Collect exited shims we started, so none stays a zombie."""
        for pid, proc in list(self._children.items()):
            if proc.poll() is not None:
                del self._children[pid]

    def close(self) -> None:
        self._watcher.close()


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


class ExitWatcher:
    """A thread polling pidfds: a process exit wakes the engine at once instead of at
    the next tick. pidfds work for processes that are not our children (re-adopted
    shims after a daemon restart)."""

    def __init__(self, on_exit: Callable[[], None]):
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}  # fd -> pid
        self._poll = select.poll()
        self._wake_r, self._wake_w = os.pipe()
        self._poll.register(self._wake_r, select.POLLIN)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="jobsup-exit-watcher",
                                        daemon=True)
        self._thread.start()

    def add(self, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # already gone (the tick will notice), or no pidfd support
            self._on_exit()
            return
        with self._lock:
            if pid in self._fds.values():
                os.close(fd)
                return
            self._fds[fd] = pid
            self._poll.register(fd, select.POLLIN)
        os.write(self._wake_w, b"x")

    def remove(self, pid: int) -> None:
        with self._lock:
            for fd, watched in list(self._fds.items()):
                if watched == pid:
                    self._drop(fd)

    def _drop(self, fd: int) -> None:
        self._poll.unregister(fd)
        del self._fds[fd]
        os.close(fd)

    def _run(self) -> None:
        while not self._closed:
            events = self._poll.poll(1000)
            exited = False
            with self._lock:
                for fd, _mask in events:
                    if fd == self._wake_r:
                        os.read(self._wake_r, 4096)
                    elif fd in self._fds:
                        self._drop(fd)
                        exited = True
            if exited:
                self._on_exit()

    def close(self) -> None:
        self._closed = True
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=2)
        with self._lock:
            for fd in list(self._fds):
                self._drop(fd)
        os.close(self._wake_r)
        os.close(self._wake_w)


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
