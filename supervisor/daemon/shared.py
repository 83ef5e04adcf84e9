"""Two parts of the engine its other parts share (`wiring.build_engine` makes them and
hands them over): the backends (`Backends`: each job's by name, made when first needed,
a job's attempt on its backend and the worker that attempt started) and the loop's
wake-ups (`Waker`: a tick now, or at a time).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from supervisor.backends import registry
from supervisor.backends.base import Attempt, Backend, backend_class
from supervisor.config import Settings
from supervisor.runtime.files import WorkerInfo
from supervisor.spec import stored_spec
from supervisor.storage import store
from supervisor.storage.tables import Job


class Backends:
    """The backends the engine's jobs run on, by name (`backends/registry.py`): the
    default from the start, the others made when a job first needs one."""

    def __init__(self, settings: Settings, on_exit: Callable[[], None],
                 local: Backend | None = None):
        self.settings = settings
        self.on_exit = on_exit
        """Handed to each backend made: a job's process exited (wakes the loop)."""
        self.backend: Backend = local or backend_class(
            registry.DEFAULT_BACKEND).from_settings(settings, on_exit=on_exit)
        """The default backend (or the one a test gives)."""
        self.backends: dict[str, Backend] = {registry.DEFAULT_BACKEND: self.backend}
        """By name, each made when a job first needs it (`backend_for`)."""

    def all(self) -> list[Backend]:
        """Every backend made so far."""
        return list(self.backends.values())

    def attempt(self, job: Job) -> Attempt:
        """The job's current attempt, on its backend."""
        return self.backend_for(job).attempt(job.id, job.attempt, job.shim_pid,
                                             job.shim_create_time, job.shim_start_ticks,
                                             job.shim_boot_id)

    def worker(self, job: Job, attempt: Attempt) -> WorkerInfo | None:
        """The worker the job's current attempt started: the identity its row recorded,
        else its shim's `worker.json` (not yet recorded); None while none is known to
        have started. The row comes first: once recorded, the worker is watched, stopped
        and judged through it even when the attempt's files are gone (its directory
        deleted, moved or emptied, #46), never taken for a launch that never started."""
        return store.recorded_worker(job) or self.backend_for(job).read_worker(attempt)

    def backend_for(self, job: Job) -> Backend:
        """The backend the job runs on: its spec's, stored resolved at submit; a job
        stored before backends existed (no `backend`, no `slurm`) is a local one, whatever
        JOBSUP_BACKEND says now."""
        name = stored_spec(job.spec_json).backend_or(registry.DEFAULT_BACKEND)
        backend = self.backends.get(name)
        if backend is None:  # its module imported only where a job runs there
            backend = self.backends[name] = backend_class(name).from_settings(
                self.settings, on_exit=self.on_exit)
        return backend


class Waker:
    """When the loop's next tick comes: at its interval, or sooner when woken (a
    process exited, a job was submitted or stopped, a restart's backoff ends)."""

    def __init__(self, clock: Callable[[], float], interval_s: float):
        self.clock = clock
        self.interval_s = interval_s
        self.event = threading.Event()
        """Set: tick now (the loop waits on it, and clears it as a tick starts)."""

    def wake(self) -> None:
        """Run a tick now (a process exited, a job was submitted or stopped)."""
        self.event.set()

    def wake_at(self, t: float) -> None:
        """Tick at `t` (restart backoff shorter than the tick interval)."""
        delay = t - self.clock()
        if 0 < delay < self.interval_s:
            timer = threading.Timer(delay, self.wake)
            timer.daemon = True
            timer.start()
