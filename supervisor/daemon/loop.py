"""The loop that ties one tick together: exits -> stops -> starts (then, as they land:
sample -> store -> forecast -> alert -> notify). No logic of its own beyond ordering
and the job lifecycle rules that decide which state comes next."""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence

from sqlalchemy.orm import Session, sessionmaker

from supervisor.alerting import rules
from supervisor.alerting.notify import Destination, Notifier
from supervisor.alerting.recorder import AlertRecorder
from supervisor.clock import SteadyClock
from supervisor.config import Settings
from supervisor.daemon import lifecycle
from supervisor.observe.observer import SCAN_BUDGET_S, ObservedJob, Observer
from supervisor.observe.view import progress_json, stored_progress
from supervisor.runtime import files
from supervisor.runtime.fileio import tail_lines
from supervisor.runtime.launcher import (
    Attempt,
    Backend,
    ExitStatus,
    LaunchDeferred,
    LaunchFate,
    ShimState,
    attempt_dir,
    log_path,
)
from supervisor.runtime.local import LocalBackend
from supervisor.runtime.procfs import start_ticks_of
from supervisor.spec import ExitReason, JobSpec, JobState, stored_spec
from supervisor.storage import store
from supervisor.storage.tables import Job, SampleRecord
from supervisor.storage.transactions import TickSteps

log = logging.getLogger(__name__)

LAUNCH_CONFIRM_S = 10.0
"""A launch recorded in the DB whose shim left no trace after this many seconds is
settled through the attempt's claim file (`Backend.settle_launch`): launched again if
the daemon can claim it, else waited for (its shim is starting) or lost."""

STOP_BACKSTOP_S = 5.0
"""Seconds past a job's stop grace after which the daemon SIGKILLs the job itself."""

EXIT_STOP_MARGIN_S = 5.0
"""`stop_jobs` waits this long past the longest grace plus the backstop before it gives
up on a job and lets the daemon exit."""

LAUNCH_RETRY_S = 10.0
"""Seconds before a launch that failed for lack of space in the data dir, or that the
backend deferred (`LaunchDeferred`), is tried again."""

COMPACT_EVERY_S = 300.0
"""Seconds between two downsampling passes over old samples."""

UNSAVED_SAMPLES_MAX = 200_000
"""Samples kept in memory while the database's disk is full (~2 days of 1 job at 2 s)."""

PROGRESS_STORE_S = 30.0
"""A running job's progress is written to its row this often (the live view is in
memory; the row serves a daemon restart and the job after its end, when it is written
at once, and again when its final output reading is in)."""

LOG_TAIL_LINES = 20
"""Log lines searched for known crash causes."""


class Engine:
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
        self._stop_sent: set[tuple[str, int]] = set()
        self._shims_seen_alive: dict[str, Attempt] = {}
        """This tick's running jobs whose shim was alive (and not stopped) when their
        state was checked: their reading is rooted at the shim without a second look."""
        self._killed: set[tuple[str, int]] = set()
        self._exiting = False
        """Set by `stop_jobs`: no pending job starts."""
        self._stopped_for_exit: set[str] = set()
        """Jobs `stop_jobs` asked to stop (not those a user had stopped already)."""
        # a tick waits for the jobs' file readings at most 1 s, less with short ticks
        self.observer = Observer(settings.jobs_dir,
                                 scan_budget_s=min(SCAN_BUDGET_S, settings.sample_interval / 2),
                                 watch_outputs=settings.output_watch == "inotify")
        self._next_compact_at = 0.0
        self._compacted_until: dict[float, float] | None = None
        """Per sample tier, the cutoff of the last downsampling pass (None: none yet in
        this daemon; the first pass starts from `store.compaction_resume_point`)."""
        self.steps = TickSteps()
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

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Re-adopt what runs, then tick in a thread until `stop()`."""
        self.recover()
        self.notifier.start()
        self._thread = threading.Thread(target=self._run, name="jobsup-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop. Jobs keep running: their shims do not depend on the daemon."""
        self._should_exit.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.notifier.stop()
        self.observer.close()
        for backend in self.backends.values():
            backend.close()

    def stop_jobs(self, poll_s: float = 0.1) -> None:
        """Before the daemon exits (`serve --stop-jobs-on-exit`): stop every running job
        as `POST /jobs/{id}/stop` does (the shim's SIGTERM -> grace -> SIGKILL, the loop's
        backstop) and wait until each one's end is recorded, at most the longest grace +
        `STOP_BACKSTOP_S` + `EXIT_STOP_MARGIN_S` (counted from when a job is first seen:
        one the loop launched meanwhile is stopped too). Pending jobs stay pending,
        unstarted. The loop thread does the work; this asks and waits. Where the stop
        cannot be recorded (the database locked or full), the shims get SIGTERM directly,
        so the jobs still have their grace before the namespace goes."""
        self._exiting = True
        deadline: float | None = None
        told: set[str] = set()
        while True:
            try:
                left = self._request_exit_stops(told)
            except Exception:  # noqa: BLE001 - whatever it is, the jobs must get SIGTERM
                log.exception("cannot record the stops before exit; signalling the jobs")
                left = self._signal_exit_stops(told)
            if not left:
                if told:
                    log.info("every job stopped; exiting")
                return
            if deadline is None or left.keys() - told:
                grace_s = max(self._grace(job) for job in left.values())
                deadline = max(deadline or 0.0, time.monotonic() + grace_s + STOP_BACKSTOP_S
                               + EXIT_STOP_MARGIN_S)
                if not told:
                    log.info("stopping %d running job(s) before exit (--stop-jobs-on-exit;"
                             " grace up to %.0f s)", len(left), grace_s)
                told.update(left)
                self.wake()
            if time.monotonic() > deadline or self._thread is None \
                    or not self._thread.is_alive():
                log.error("exiting with job(s) %s still running", ", ".join(sorted(left)))
                return
            time.sleep(poll_s)

    def _request_exit_stops(self, told: set[str]) -> dict[str, Job]:
        """Record a stop for every running job not yet asked; the running jobs."""
        with self.sessions() as session:
            running = _running_detached(session)
            now = self.clock()
            for job in running.values():
                if job.id not in told:
                    if job.stop_requested_at is None:
                        self._stopped_for_exit.add(job.id)
                    store.request_stop(session, job.id, now=now)
            session.commit()
            return running

    def _signal_exit_stops(self, told: set[str]) -> dict[str, Job]:
        """The database cannot take the stops: SIGTERM each running attempt's shim (or
        worker) directly, once; the running jobs as last read (none if unreadable)."""
        try:
            with self.sessions() as session:
                running = _running_detached(session)
        except Exception:  # noqa: BLE001
            log.exception("cannot read the running jobs before exit")
            return {}
        for job in running.values():
            if job.id in told:
                continue
            attempt, backend = self._attempt(job), self.backend_for(job)
            self._stopped_for_exit.add(job.id)
            backend.request_stop(attempt, backend.read_worker(attempt))
        return running

    def wake(self) -> None:
        """Run a tick now (a process exited, a job was submitted or stopped)."""
        self._wake.set()

    def recover(self) -> None:
        """After a daemon (re)start: watch every running attempt and settle what ended
        while the daemon was down (the tick reads the exit files the shims wrote)."""
        with self.sessions() as session:
            for job in store.list_jobs(session):
                progress = stored_progress(job.progress_json)
                if progress is not None:
                    self.observer.seed(job.id, progress)
            for job in store.jobs_in_states(session, JobState.RUNNING):
                attempt, backend = self._attempt(job), self.backend_for(job)
                backend.watch(attempt, backend.read_worker(attempt))
                rows = store.samples(session, job.id, since=job.started_at or 0, limit=100_000)
                self.observer.load_history(self._observed(job, attempt, self.clock()), rows)
        self.tick()

    def _run(self) -> None:
        interval = self.settings.sample_interval
        next_tick = time.monotonic() + interval
        self.last_tick_at = time.monotonic()
        while not self._should_exit.is_set():
            self._wake.wait(max(0.0, next_tick - time.monotonic()))
            if self._should_exit.is_set():
                return
            self._wake.clear()
            if self._may_tick():
                started = time.monotonic()
                try:
                    self.tick()
                except Exception:  # one bad tick must not end supervision
                    log.exception("tick failed")
                self.last_tick_at = time.monotonic()
                self.on_tick(time.monotonic() - started)
            now = time.monotonic()
            if now >= next_tick:  # scheduled tick done: next one, without drift
                next_tick += interval
                if next_tick <= now:
                    next_tick = now + interval

    def _may_tick(self) -> bool:
        try:
            return self.may_tick()
        except Exception:  # unsure whether it may act: it does not, and asks again
            log.exception("cannot tell whether a tick may run; skipped")
            return False

    # -- one tick ---------------------------------------------------------------------
    def tick(self) -> None:
        """exits -> sample -> store -> forecast (in the observer) -> alert -> notify ->
        starts. Each write is its own transaction: with the database's disk full, what
        cannot be written waits (samples in memory, alerts sent unrecorded) and the
        rest of the tick goes on."""
        now = self.clock()
        for backend in list(self.backends.values()):
            backend.reap()
        self._shims_seen_alive = {}
        with self.sessions() as session:
            running = store.jobs_in_states(session, JobState.RUNNING)
            for job in running:
                with self.steps.isolated(session, f"job {job.id}"), \
                        self.steps.writing(session, "job state"):
                    self._check_running(session, job, now)
            with self.steps.isolated(session, "observation"):
                # jobs that ended this tick get one last reading: their final output counts
                observed = [self._observed(job, self._shims_seen_alive.get(job.id)
                                           or self._attempt(job), now) for job in running]
                self._store_samples(session, running, self.observer.observe(observed, now))
            with self.steps.isolated(session, "alerts"):
                self._alert(session, running, now)
            for job in running:
                if JobState(job.state) is not JobState.RUNNING:
                    self.observer.forget(job.id)
                    self._shim_observes.pop((job.id, job.attempt), None)
            self.notifier.wake()
            for job in store.jobs_in_states(session, JobState.PENDING):
                with self.steps.isolated(session, f"job {job.id}"), \
                        self.steps.writing(session, "job start"):
                    self._check_pending(session, job, now)
            if now >= self._next_compact_at:
                self._next_compact_at = now + COMPACT_EVERY_S
                with self.steps.isolated(session, "sample downsampling"), \
                        self.steps.writing(session, "sample downsampling") as written:
                    since = (self._compacted_until if self._compacted_until is not None
                             else store.compaction_resume_point(session))
                    deleted = store.compact_samples(session, now=now, since=since)
                    if deleted:
                        log.info("downsampled old samples: %d rows removed", deleted)
                if written.ok:
                    self._compacted_until = store.compaction_cutoffs(now)

    def _alert(self, session: Session, running: Sequence[Job], now: float) -> None:
        recorded: list[tuple[str, str]] = []
        with self.steps.writing(session, "alerts") as written:
            self.alerting.record(session, running, now, recorded)
        if written.ok:
            self.alerting.forget_sent(recorded)
        else:
            self.alerting.send_unrecorded(session, running, now)

    def _store_samples(self, session: Session, running: Sequence[Job],
                       samples: Sequence[SampleRecord]) -> None:
        """Store this tick's samples, after any that a full disk held back, and the
        progress of jobs on their rows: a running job's every PROGRESS_STORE_S or when its
        observation error comes or goes; an ended job's at once, and again when its final
        reading is in. What a failed write held back is written next time."""
        pending = [*self._unsaved_samples, *samples]
        now = self.clock()
        stored: dict[str, tuple[float, str | None]] = {}
        finals = self._finals_unsaved | set(self.observer.settled)
        with self.steps.writing(session, "samples") as written:
            store.add_samples(session, pending)
            for job in running:
                view = self.observer.views.get(job.id)
                if JobState(job.state) is not JobState.RUNNING:
                    finals.add(job.id)
                    continue
                if view is not None:
                    stored_at, stored_error = self._progress_stored.get(job.id, (0.0, None))
                    error = view.progress.observation_error
                    if error != stored_error or now - stored_at >= PROGRESS_STORE_S:
                        job.progress_json = progress_json(view.progress)
                        stored[job.id] = (now, error)
            for job_id in finals:
                view = self.observer.views.get(job_id)
                ended_job = session.get(Job, job_id)
                if view is not None and ended_job is not None \
                        and JobState(ended_job.state).ended:
                    ended_job.progress_json = progress_json(view.progress)
        if written.ok:
            self._unsaved_samples = []
            self._progress_stored.update(stored)
            for job_id in finals:
                self._progress_stored.pop(job_id, None)
            self._finals_unsaved = set()
        else:
            self._unsaved_samples = pending[-UNSAVED_SAMPLES_MAX:]
            self._finals_unsaved = finals

    def _observed(self, job: Job, attempt: Attempt, now: float) -> ObservedJob:
        """The sampler's view of a job: its tree is rooted at the shim (which is the
        subreaper of everything the job spawns), or at the worker if the shim is gone. A
        job whose processes are on other machines (a SLURM job) has no tree here: its
        pids are not looked up in this machine's /proc; it may wait in its scheduler's
        queue, and its run starts when it leaves it (the alert rules' clocks)."""
        backend = self.backend_for(job)
        if not backend.observes_locally:  # its shim publishes its readings
            queued = backend.queued(attempt)
            return ObservedJob(job.id, stored_spec(job.spec_json), job.attempt,
                               -1, None, None, job.started_at, None, remote=True,
                               scheduler_job_id=backend.scheduler_job_id(attempt),
                               queued=queued, running_since=None if queued
                               else backend.running_since(attempt, now))
        if attempt.shim_pid is not None and (self._shims_seen_alive.get(job.id) is attempt
                                             or backend.shim_alive(attempt)):
            root, root_time, root_ticks = (attempt.shim_pid, attempt.shim_create_time,
                                           attempt.shim_start_ticks)
        else:
            root, root_time, root_ticks = job.pid or -1, job.pid_create_time, job.pid_start_ticks
        return ObservedJob(job.id, stored_spec(job.spec_json), job.attempt,
                           root, root_time, job.pid, job.started_at, root_ticks,
                           remote=self._observed_by_shim(job))

    def _observed_by_shim(self, job: Job) -> bool:
        """The job's shim publishes its readings: always on a backend whose jobs run
        elsewhere; under JOBSUP_OBSERVE=shim, if its launch asked for them (a job launched
        by a daemon without the setting is read here)."""
        if not self.backend_for(job).observes_locally:
            return True
        if self.settings.observe != "shim":
            return False
        key = (job.id, job.attempt)
        if key not in self._shim_observes:
            launch = files.read_launch(attempt_dir(self.settings.jobs_dir, job.id, job.attempt))
            self._shim_observes[key] = launch is not None and "observe" in launch
        return self._shim_observes[key]

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

    def _check_running(self, session: Session, job: Job, now: float) -> None:
        attempt, backend = self._attempt(job), self.backend_for(job)
        if job.shim_pid is None and attempt.shim_pid is not None:
            store.record_shim(job, attempt)
        # the worker's file is read while its pid is unknown, else only where it is used
        # (a running job's shim alive and not stopped: most jobs, most ticks; #15)
        pid_known = job.pid is not None
        worker = None if pid_known else backend.read_worker(attempt)
        if worker is not None:
            store.record_worker(job, worker)

        # a running shim has not recorded an exit yet (or has just done so: then the
        # exit watcher wakes the next tick as it ends), so its status file is not read
        shim = backend.shim_state(attempt)
        status = None if shim is ShimState.RUNNING else backend.read_exit(attempt)
        if status is not None:
            backend.forget(attempt)
            self._finish(session, job, status, now)
            return

        if job.stop_requested_at is None and self._served_its_purpose(session, job):
            store.stop_when_served(job, now=now)
        if job.stop_requested_at is not None:
            self._stop_running(job, attempt, now)

        if shim is not ShimState.GONE:
            if (job.shim_start_ticks is None and attempt.shim_pid is not None
                    and backend.observes_locally):
                # a shim started before start ticks were recorded, matched by its create
                # time this once: from now on by its start ticks (immune to clock steps)
                job.shim_start_ticks = start_ticks_of(attempt.shim_pid)
            if shim is ShimState.RUNNING:
                self._shims_seen_alive[job.id] = attempt  # its reading needs no new look
                note = backend.status_note(attempt)  # a scheduler's queue, and why
                if note is not None and note != job.reason:
                    job.reason = note
                return
            if pid_known:
                worker = backend.read_worker(attempt)
            if worker is None or not backend.worker_alive(worker):
                # a stopped shim cannot reap the worker nor record its exit: continue it
                log.warning("job %s: its shim (pid %s) was stopped (SIGSTOP) after the "
                            "worker ended; continuing it (SIGCONT)", job.id, attempt.shim_pid)
                backend.resume_shim(attempt)
            return
        if pid_known:
            worker = backend.read_worker(attempt)
        if worker is not None and backend.worker_alive(worker):
            # the shim died but the job runs on: watch the worker itself, so its end
            # is noticed at once (the watcher ignores a pid it already watches)
            backend.watch(attempt, worker)
            return
        status = backend.read_exit(attempt)  # the shim may have just finished
        if status is not None:
            self._finish(session, job, status, now)
        elif worker is None:
            # no worker was ever started: a launch cut short (the daemon died before it
            # recorded the shim, or the shim exited before claiming, e.g. on a full disk
            # where it could not reserve its status file). The claim file settles it; a
            # shim known to be dead needs no waiting
            if attempt.shim_pid is not None or now - (job.started_at or now) > LAUNCH_CONFIRM_S:
                fate = backend.settle_launch(attempt)
                if fate is not LaunchFate.WAIT:
                    self._apply(session, job, lifecycle.launch_cut_short(
                        shim_recorded=attempt.shim_pid is not None,
                        abandoned=fate is LaunchFate.ABANDONED), at=now, now=now)
        else:
            self._apply(session, job, lifecycle.vanished(
                stop_requested=job.stop_requested_at is not None,
                shim_recorded=attempt.shim_pid is not None), at=now, now=now)

    @staticmethod
    def _served_its_purpose(session: Session, job: Job) -> bool:
        """All the jobs of its `stop_when_ended` have ended."""
        waited_for = stored_spec(job.spec_json).stop_when_ended
        if not waited_for:
            return False
        states = [session.get(Job, job_id, populate_existing=True) for job_id in waited_for]
        return all(other is None or JobState(other.state).ended for other in states)

    def _stop_running(self, job: Job, attempt: Attempt, now: float) -> None:
        key, backend = (job.id, job.attempt), self.backend_for(job)
        worker = backend.read_worker(attempt)
        if key not in self._stop_sent:
            self._stop_sent.add(key)
            log.info("job %s: stopping (SIGTERM, SIGKILL after %.0f s)", job.id,
                     self._grace(job))
            backend.request_stop(attempt, worker)
        elif (key not in self._killed and job.stop_requested_at is not None
              and now - job.stop_requested_at > self._grace(job) + STOP_BACKSTOP_S):
            self._killed.add(key)
            log.warning("job %s: still running %.0f s after stop; SIGKILL", job.id,
                        now - job.stop_requested_at)
            backend.kill(attempt, worker)

    def _grace(self, job: Job) -> float:
        spec = stored_spec(job.spec_json)
        return spec.stop_grace_s or self.settings.stop_grace_s

    def _finish(self, session: Session, job: Job, status: ExitStatus, now: float) -> None:
        """Record the exit and apply what the lifecycle decides follows it: ended, or
        pending again for a restart."""
        store.record_exit(job, exit_code=status.exit_code, signal=status.signal)
        # the shim's wall-clock time; never later than the daemon's own clock (a system
        # clock stepped forward must not push the end, and the alerts' windows, ahead)
        ended_at = min(status.ended_at, now)
        stop_requested = job.stop_requested_at is not None or status.stop_requested
        failed = not stop_requested and (status.exit_code != 0 or bool(status.spawn_error))
        notes: str | None = None
        oom: str | None = None
        if failed:  # what the log tail and the exit tell (NCCL, CUDA OOM, the rank)
            lines, _ = tail_lines(log_path(self.settings.jobs_dir, job.id, job.attempt),
                                  LOG_TAIL_LINES)
            notes, oom = rules.classify_exit(exit_code=status.exit_code, signal=status.signal,
                                              oom_kills=status.oom_kills or 0, log_tail=lines)
        stopped_by = ("SIGKILL after the grace" if status.killed_after_grace else
                      "SIGKILL by the daemon's backstop"
                      if (job.id, job.attempt) in self._killed else "SIGTERM")
        stop_cause = ("because the jobs it served have ended"
                      if stop_requested and self._served_its_purpose(session, job)
                      else "because the daemon is exiting (--stop-jobs-on-exit)"
                      if job.id in self._stopped_for_exit else "on request")
        spec = stored_spec(job.spec_json)
        decision = lifecycle.after_exit(
            lifecycle.Exit(status.exit_code, status.signal, spawn_error=status.spawn_error,
                           stop_requested=stop_requested, stopped_by=stopped_by,
                           stop_cause=stop_cause, oom=oom is not None, notes=notes or None,
                           scheduler_end=self.backend_for(job).scheduler_end(
                               self._attempt(job))),
            lifecycle.Restarts(spec.restart_policy, done=job.restarts, limit=spec.max_restarts,
                               backoff_s=self.settings.restart_backoff_s,
                               backoff_max_s=self.settings.restart_backoff_max_s))
        self._apply(session, job, decision, at=ended_at, now=now)

    def _apply(self, session: Session, job: Job, decision: lifecycle.Decision, *, at: float,
               now: float) -> None:
        """Write a lifecycle decision: the exit reason, a restart's bookkeeping, and the
        transition through the store (at `at`, the time the job's state changed)."""
        restart_at = (now + decision.restart_in_s if decision.restart_in_s is not None
                      else None)
        store.transition(session, job, decision.state, now=at, reason=decision.reason,
                         exit_reason=decision.exit_reason, restart_at=restart_at)
        if restart_at is not None:
            self.wake_at(restart_at)

    def wake_at(self, t: float) -> None:
        """Tick at `t` (restart backoff shorter than the tick interval)."""
        delay = t - self.clock()
        if 0 < delay < self.settings.sample_interval:
            timer = threading.Timer(delay, self.wake)
            timer.daemon = True
            timer.start()

    def _check_pending(self, session: Session, job: Job, now: float) -> None:
        if self._exiting:  # the daemon is stopping its jobs: start none
            return
        spec = stored_spec(job.spec_json)
        dependencies = []
        for dep_id in spec.depends_on:
            dep = session.get(Job, dep_id, populate_existing=True)
            dependencies.append(lifecycle.Dependency(
                dep_id, dep.name if dep is not None else "?",
                JobState(dep.state) if dep is not None else JobState.LOST))
        decision = lifecycle.before_start(stop_requested=job.stop_requested_at is not None,
                                          dependencies=dependencies)
        if decision is not None:
            self._apply(session, job, decision, at=now, now=now)
            return
        if not lifecycle.dependencies_met(dependencies):
            return
        if job.next_start_at is not None and now < job.next_start_at:
            return
        self._launch(session, job, spec, now)

    def _launch(self, session: Session, job: Job, spec: JobSpec, now: float) -> None:
        """Record the attempt first, then start it: a daemon crash between the two
        leaves a `running` row the next daemon can settle, never a job started twice."""
        store.start_attempt(session, job, now=now)
        session.commit()
        try:
            attempt = self.backend_for(job).start(job.id, job.attempt, spec,
                                         cwd=spec.cwd or ".",
                                         stop_grace_s=spec.stop_grace_s
                                         or self.settings.stop_grace_s)
        except OSError as exc:
            if isinstance(exc, LaunchDeferred):  # e.g. SLURM's controller not answering
                store.transition(session, job, JobState.PENDING, now=now,
                                 reason=f"{exc}; next try in {LAUNCH_RETRY_S:.0f} s",
                                 retry_at=now + LAUNCH_RETRY_S)
                return
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the data dir's disk is full
                store.transition(session, job, JobState.PENDING, now=now,
                                 reason=f"waiting for space in the data dir to launch "
                                        f"({exc.strerror}); next try in {LAUNCH_RETRY_S:.0f} s",
                                 retry_at=now + LAUNCH_RETRY_S)
                return
            store.transition(session, job, JobState.FAILED, now=now,
                             reason=f"could not start the job's shim: {exc}",
                             exit_reason=ExitReason.EXIT)
            return
        store.record_shim(job, attempt)


def _running_detached(session: Session) -> dict[str, Job]:
    """The running jobs by id, detached: read after their session closes (their grace)."""
    running = {job.id: job for job in store.jobs_in_states(session, JobState.RUNNING)}
    for job in running.values():
        session.expunge(job)
    return running
