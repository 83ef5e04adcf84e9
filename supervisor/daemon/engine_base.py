"""The engine's parts and the helpers every stage of its tick uses (`EngineBase`): the
settings, sessions and clock, the backends (each job's by name, made when first needed)
and a job's attempt on its backend, the observer, the notifier and the alert recorder,
the bookkeeping kept from tick to tick; waking the loop now or at a time, a job's stop
grace, and a lifecycle decision written through the store. The per-job checks build on
it (`checks.py`), the loop and the tick on those (`loop.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from sqlalchemy.orm import Session, sessionmaker

from supervisor.alerting.notify import Destination, Notifier
from supervisor.alerting.recorder import AlertRecorder
from supervisor.clock import SteadyClock
from supervisor.config import Settings
from supervisor.daemon import lifecycle
from supervisor.observe.observer import SCAN_BUDGET_S, Observer
from supervisor.observe.view import JobEnd, JobView
from supervisor.runtime.launcher import (
    Attempt,
    Backend,
)
from supervisor.runtime.local import LocalBackend
from supervisor.spec import stored_spec
from supervisor.storage import store
from supervisor.storage.tables import Job, SampleRecord
from supervisor.storage.transactions import TickSteps, watch_writes
from supervisor.storage.writability import Writability

log = logging.getLogger(__name__)


class EngineBase:
    """What the engine is made of, and the helpers its stages share."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], *,
                 backend: Backend | None = None, clock: Callable[[], float] | None = None):
        self.settings = settings
        self.sessions = sessions
        self.clock: Callable[[], float] = clock or SteadyClock()
        """Every timeout and backoff is measured on this clock (see `clock.py`)."""
        self.backend: Backend = backend or LocalBackend(
            settings.jobs_dir, on_exit=self.wake,
            publish_interval_s=settings.sample_interval if settings.observe == "shim" else None)
        """The `local` backend (or the one a test gives)."""
        self.backends: dict[str, Backend] = {"local": self.backend}
        """By name, each made when a job first needs it (`backend_for`)."""
        self._shim_observes: dict[tuple[str, int], bool] = {}
        """Per (job, attempt): observed through its shim's readings (`observed.jsonl`)."""
        self._wake = threading.Event()
        self._should_exit = threading.Event()
        self._thread: threading.Thread | None = None
        self._stop_sent: dict[tuple[str, int], float] = {}
        """(job, attempt) -> when this daemon sent the stop's SIGTERM (on `clock`): the
        backstop counts the grace from it, not from the request, which a daemon killed
        before it signalled may have recorded long before its successor sends it."""
        self._shims_seen_alive: dict[str, Attempt] = {}
        """This tick's running jobs whose shim was alive (and not stopped) when their
        state was checked: their reading is rooted at the shim without a second look."""
        self._killed: set[tuple[str, int]] = set()
        self._exiting = False
        """Set by `stop_jobs`: no pending job starts."""
        self._stopped_for_exit: set[str] = set()
        """Jobs `stop_jobs` asked to stop (not those a user had stopped already)."""
        self._depends_on: dict[str, tuple[str, ...]] = {}
        """The `depends_on` of each pending job, kept while it is pending: read from its
        spec once, not each tick (`JobChecks._check_pending_jobs`)."""
        self._tick_began = time.monotonic()
        """When the current (or last) tick began (`time.monotonic()`)."""
        self._pending_unchanged: tuple[object, ...] | None = None
        """What the pending jobs' last pass that acted on none saw (`store.pending_summary`
        and the running jobs' states): while a tick sees the same and no restart is due
        (the summary's `first_start_at`), its pass would act on none either, and is
        skipped (#30)."""
        # a tick waits for the jobs' file readings at most 1 s, less with short ticks
        self.observer = Observer(settings.jobs_dir,
                                 scan_budget_s=min(SCAN_BUDGET_S, settings.sample_interval / 2),
                                 watch_outputs=settings.output_watch == "inotify",
                                 clock=self.clock)
        self._next_compact_at = 0.0
        self._compacted_until: dict[float, float] | None = None
        """Per sample tier, the cutoff of the last downsampling pass (None: none yet in
        this daemon; the first pass starts from `store.compaction_resume_point`)."""
        self.unrecorded_ends: dict[str, JobEnd] = {}
        """Running jobs whose end the database refused, by id: shown (`views`) and
        alerted on (`AlertRecorder.send_unrecorded`) from here until it is recorded."""
        self.writability = Writability()
        """Whether the database takes writes (the tick's steps report to it, /healthz
        and the API read it)."""
        self.steps = TickSteps(self.writability)
        watch_writes(self.sessions)  # the tick's steps see what its sessions wrote
        self._unsaved_samples: list[SampleRecord] = []
        self._progress_stored: dict[str, tuple[float, str | None]] = {}
        self._finals_unsaved: set[str] = set()
        """Ended jobs whose final progress a failed write held back."""
        """When each running job's progress was last written to its row, and the
        observation error it held."""
        destinations = [Destination(name, url) for name, url in (
            ("slack", settings.slack_webhook_url), ("webhook", settings.webhook_url)) if url]
        secret = settings.webhook_secret
        self.notifier = Notifier(destinations, sessions, clock=self.clock,
                                 backoff_max_s=settings.notify_backoff_max_s,
                                 webhook_secret=secret.get_secret_value() if secret else None,
                                 wall=time.time)
        self.alerting = AlertRecorder(settings, self.observer, self.notifier)
        self.may_tick: Callable[[], bool] = lambda: True
        """Asked before each tick of the loop: False skips it (`app.py`: the daemon's
        lock on its PostgreSQL database is not confirmed, or was lost to another daemon:
        no job is launched, judged or stopped without it)."""
        self.on_tick: Callable[[float], None] = lambda _seconds: None
        """Called with each tick's duration in seconds (the metrics histogram)."""
        self.last_tick_at: float | None = None
        """`time.monotonic()` when the loop last finished a tick (one that raised too) or
        started; None before `start()`. A tick blocked in I/O leaves it behind: /healthz."""

    def views(self) -> Mapping[str, JobView]:
        """What the engine knows of each job now, for the API and the metrics: the
        observer's views, with the ends the database has not taken yet."""
        views = self.observer.views
        ends = self.unrecorded_ends
        if not ends:
            return views
        shown = dict(views)
        for job_id, end in list(ends.items()):
            view = shown.get(job_id)
            if view is not None:
                shown[job_id] = replace(view, unrecorded_end=end)
        return shown

    def wake(self) -> None:
        """Run a tick now (a process exited, a job was submitted or stopped)."""
        self._wake.set()

    def _attempt(self, job: Job) -> Attempt:
        return self.backend_for(job).attempt(job.id, job.attempt, job.shim_pid,
                                             job.shim_create_time, job.shim_start_ticks)

    def backend_for(self, job: Job) -> Backend:
        """The backend the job runs on: its spec's, stored resolved at submit; a job
        stored before backends existed (no `backend`, no `slurm`) is a local one, whatever
        JOBSUP_BACKEND says now."""
        name = stored_spec(job.spec_json).backend_or("local")
        backend = self.backends.get(name)
        if backend is None:
            from supervisor.runtime.slurm import SlurmBackend  # only where SLURM is used

            backend = self.backends[name] = SlurmBackend(
                self.settings.jobs_dir, publish_interval_s=self.settings.sample_interval)
        return backend

    def _grace(self, job: Job) -> float:
        spec = stored_spec(job.spec_json)
        return spec.stop_grace_s or self.settings.stop_grace_s

    def _apply(self, session: Session, job: Job, decision: lifecycle.Decision, *, at: float,
               now: float) -> None:
        """Write a lifecycle decision: the exit reason, a restart's bookkeeping, and the
        transition through the store (at `at`, the time the job's state changed)."""
        restart_at = (now + decision.restart_in_s if decision.restart_in_s is not None
                      else None)
        store.transition(session, job, decision.state, now=at, reason=decision.reason,
                         exit_reason=decision.exit_reason, restart_at=restart_at,
                         clear_stop=decision.requeue)
        if restart_at is not None:
            self.wake_at(restart_at)

    def wake_at(self, t: float) -> None:
        """Tick at `t` (restart backoff shorter than the tick interval)."""
        delay = t - self.clock()
        if 0 < delay < self.settings.sample_interval:
            timer = threading.Timer(delay, self.wake)
            timer.daemon = True
            timer.start()
