"""The contract between the engine and a backend (`Backend`), and what crosses it: the
`Attempt`, a shim's `ShimState`, a launch's `LaunchFate`, a scheduler's `SchedulerEnd`.

The engine talks to a backend only through `Backend`: start an attempt, read what the
shim recorded, ask whether the attempt still lives, stop it. The `local` backend
(`local.py`) runs the shim on this machine; the `slurm` backend (`slurm.py`) implements
the same calls with sbatch/squeue/scancel and a shim inside the allocation. The engine
finds them by name in `registry.py`; what every backend writes to launch an attempt is
`launch.py`'s.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.backends import registry
from supervisor.runtime import files
from supervisor.runtime.files import ExitStatus, WorkerInfo
from supervisor.runtime.procfs import StatReader
from supervisor.spec import ExitReason, JobSpec

if TYPE_CHECKING:
    from supervisor.config import Settings


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
    shim_boot_id: str | None = None
    """The boot it runs in (`procfs.this_boot_id`), with the start ticks."""


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
    scheduler's tools. The abstract methods are what each backend does its own way;
    the others have the answer of a backend without a scheduler or a pidfd."""

    observes_locally: bool = True
    """The daemon can read its jobs' /proc, NVML and output files (they run here). A
    backend whose shims run on other nodes sets it False, asks them to publish their
    readings (`launch.observe_request` in `launch.json`) and the engine reads those
    instead."""

    # -- made by the engine ----------------------------------------------------------------
    @classmethod
    @abstractmethod
    def from_settings(cls, settings: Settings, *, on_exit: Callable[[], None]) -> Backend:
        """The daemon's backend of this kind, made when a job first needs it; `on_exit`
        wakes the engine (a backend that sees an exit as it happens calls it)."""

    @classmethod  # noqa: B027 (a hook: by default nothing to do)
    def check_usable(cls) -> None:
        """InvalidSpec (field `backend`) when a job submitted to this backend could not
        run from this daemon (its scheduler's tools missing): asked at submit."""

    # -- an attempt's life -----------------------------------------------------------------
    @abstractmethod
    def start(self, job_id: str, number: int, spec: JobSpec, *, cwd: str,
              stop_grace_s: float) -> Attempt:
        """Launch attempt `number` of the job through a shim; OSError if it cannot
        (`LaunchDeferred`: not now, maybe later)."""

    @abstractmethod
    def attempt(self, job_id: str, number: int, shim_pid: int | None,
                shim_create_time: float | None, shim_start_ticks: int | None,
                shim_boot_id: str | None = None) -> Attempt:
        """The attempt of a stored job (the shim's identity from the attempt's files
        when the database does not have it)."""

    @abstractmethod
    def settle_launch(self, attempt: Attempt) -> LaunchFate:
        """Claim an attempt whose shim left no trace in time (see `LaunchFate`)."""

    def read_worker(self, attempt: Attempt) -> WorkerInfo | None:
        """The worker the shim started, None before it started one."""
        return files.read_worker(attempt.dir)

    def launch_on_disk(self, attempt: Attempt) -> bool:
        """The attempt's `launch.json` is still there. Every backend writes it before it
        starts the shim (`launch.write_launch`), so once a shim was started its absence
        means the attempt's directory was deleted, moved or emptied since."""
        return (attempt.dir / files.LAUNCH).is_file()

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

    def resume_shim(self, attempt: Attempt) -> None:  # noqa: B027 (a hook: by default nothing to do)
        """Continue a stopped shim (SIGCONT), where `shim_state` can say SUSPENDED."""

    @abstractmethod
    def request_stop(self, attempt: Attempt, worker: WorkerInfo | None) -> None:
        """Ask the shim to stop the job: SIGTERM, SIGKILL after the grace."""

    @abstractmethod
    def kill(self, attempt: Attempt, worker: WorkerInfo | None) -> None:
        """Backstop when the shim did not finish a stop in time: kill the job's
        processes, never the shim, which must live to reap them and record the exit."""

    def watch(self, attempt: Attempt, worker: WorkerInfo | None) -> None:  # noqa: B027 (a hook: by default nothing to do)
        """Wake the engine as soon as the attempt's shim (or shim-less worker) exits;
        without it, the next tick finds the exit."""

    @abstractmethod
    def forget(self, attempt: Attempt) -> None:
        """The attempt ended: stop watching it."""

    # -- what a cluster scheduler adds -----------------------------------------------------
    def scheduler_job_id(self, attempt: Attempt) -> str | None:
        """The cluster scheduler's id of the attempt (a SLURM job id); None here."""
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

    def status_note(self, attempt: Attempt) -> str | None:
        """What the scheduler says of a running attempt (queued, and why), for the job's
        `reason`; None when there is nothing to add."""
        return None

    def scheduler_end(self, attempt: Attempt) -> SchedulerEnd | None:
        """Why the scheduler ended an attempt that `read_exit` reported ended, when the
        scheduler's reason overrides the exit code (None: the exit code tells)."""
        return None

    # -- each tick, and at the end ---------------------------------------------------------
    @abstractmethod
    def reap(self) -> None:
        """A new tick: collect the backend's exited children, drop what it cached."""

    def close(self) -> None:  # noqa: B027 (a hook: by default nothing to do)
        """Release the backend's threads and descriptors."""


def backend_class(name: str) -> type[Backend]:
    """The class of the backend `name` in `registry.BACKENDS`, its module imported now;
    KeyError if there is none of that name."""
    module, _, cls = registry.BACKENDS[name].partition(":")
    found: type[Backend] = getattr(importlib.import_module(module), cls)
    return found
