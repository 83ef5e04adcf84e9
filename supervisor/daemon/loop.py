"""The loop that ties one tick together: exits -> stops -> starts (then, as they land:
sample -> store -> forecast -> alert -> notify). No logic of its own beyond ordering
and the job lifecycle rules that decide which state comes next. The per-job checks the
tick runs are `checks.py`'s (`JobChecks`), the backends and wake-ups `shared.py`'s,
and `wiring.build_engine` makes the parts and hands them to the `Engine`; here: the
loop's thread, the stops before the daemon exits, re-adoption at start, and the tick with
its samples and alerts."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from sqlalchemy.orm import Session, sessionmaker

from supervisor.alerting.notify import Notifier
from supervisor.alerting.recorder import AlertRecorder
from supervisor.backends.base import Attempt, Backend
from supervisor.config import Settings
from supervisor.daemon.checks import STOP_BACKSTOP_S, JobChecks, stop_grace_s
from supervisor.daemon.shared import Backends, Waker
from supervisor.observe.observer import Observer
from supervisor.observe.readings import ObservedJob
from supervisor.observe.view import JobEnd, JobView, progress_json, stored_progress
from supervisor.runtime import files
from supervisor.runtime.files import attempt_dir
from supervisor.spec import JobState, stored_spec
from supervisor.storage import store
from supervisor.storage.tables import Job, SampleRecord
from supervisor.storage.transactions import TickSteps
from supervisor.storage.writability import Writability

log = logging.getLogger(__name__)

EXIT_STOP_MARGIN_S = 5.0
"""`stop_jobs` waits this long past the longest grace plus the backstop before it gives
up on a job and lets the daemon exit."""

COMPACT_EVERY_S = 300.0
"""Seconds between two downsampling passes over old samples."""

UNSAVED_SAMPLES_MAX = 200_000
"""Samples kept in memory while the database's disk is full (~2 days of 1 job at 2 s)."""

PROGRESS_STORE_S = 30.0
"""A running job's progress is written to its row this often (the live view is in
memory; the row serves a daemon restart and the job after its end, when it is written
at once, and again when its final output reading is in)."""


class Engine:
    """The daemon's supervision: a loop that ticks in its thread over parts that each own
    their state, made and joined by `wiring.build_engine`: the backends, the per-job
    checks, the observer, the alert recorder and the notifier. What it keeps itself:
    the loop's thread, the samples and progress a refused write held back, the ends the
    database refused, and the downsampling's pace."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], *,
                 clock: Callable[[], float], backends: Backends, waker: Waker,
                 checks: JobChecks, observer: Observer, notifier: Notifier,
                 alerting: AlertRecorder, steps: TickSteps, writability: Writability):
        self.settings = settings
        self.sessions = sessions
        self.clock = clock
        """Every timeout and backoff is measured on this clock (see `clock.py`)."""
        self.backends = backends
        self.backend: Backend = backends.backend
        """The `local` backend (or the one a test gives)."""
        self.waker = waker
        self.checks = checks
        self.observer = observer
        self.notifier = notifier
        self.alerting = alerting
        self.steps = steps
        self.writability = writability
        """Whether the database takes writes (the tick's steps report to it, /healthz
        and the API read it)."""
        self._shim_observes: dict[tuple[str, int], bool] = {}
        """Per (job, attempt): observed through its shim's readings (`observed.jsonl`)."""
        self._should_exit = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_compact_at = 0.0
        self._compacted_until: dict[float, float] | None = None
        """Per sample tier, the cutoff of the last downsampling pass (None: none yet in
        this daemon; the first pass starts from `store.compaction_resume_point`)."""
        self.unrecorded_ends: dict[str, JobEnd] = {}
        """Running jobs whose end the database refused, by id: shown (`views`) and
        alerted on (`AlertRecorder.send_unrecorded`) from here until it is recorded."""
        self._unsaved_samples: list[SampleRecord] = []
        self._progress_stored: dict[str, tuple[float, str | None]] = {}
        """When each running job's progress was last written to its row, and the
        observation error it held."""
        self._finals_unsaved: set[str] = set()
        """Ended jobs whose final progress a failed write held back."""
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
        self.waker.wake()

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
        self.waker.wake()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.notifier.stop()
        if self._thread is not None and self._thread.is_alive():  # a tick still runs
            log.warning("the engine's tick did not end within 10 s of the stop; its "
                        "observer is left open (the daemon's exit closes it)")
        else:
            self.observer.close()
        for backend in self.backends.all():
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
        self.checks.stop_starting()
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
                grace_s = max(stop_grace_s(job, self.settings) for job in left.values())
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
                        self.checks.stopped_for_exit(job.id)
                    store.request_stop(session, job.id, now=now, by_person=False)
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
            attempt, backend = self.backends.attempt(job), self.backends.backend_for(job)
            self.checks.stopped_for_exit(job.id)
            backend.request_stop(attempt, self.backends.worker(job, attempt))
        return running

    def recover(self) -> None:
        """After a daemon (re)start: watch every running attempt and settle what ended
        while the daemon was down (the tick reads the exit files the shims wrote)."""
        with self.sessions() as session:
            for job in store.list_jobs(session):
                progress = stored_progress(job.progress_json)
                if progress is not None:
                    self.observer.seed(job.id, progress)
            for job in store.jobs_in_states(session, JobState.RUNNING):
                attempt, backend = self.backends.attempt(job), self.backends.backend_for(job)
                backend.watch(attempt, self.backends.worker(job, attempt))
                rows = store.samples(session, job.id, since=job.started_at or 0, limit=100_000)
                self.observer.load_history(self._observed(job, attempt, self.clock()), rows)
        self.tick()

    def _run(self) -> None:
        interval = self.settings.sample_interval
        next_tick = time.monotonic() + interval
        self.last_tick_at = time.monotonic()
        while not self._should_exit.is_set():
            self.waker.event.wait(max(0.0, next_tick - time.monotonic()))
            if self._should_exit.is_set():
                return
            self.waker.event.clear()
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
        try:
            self._tick(self.clock())
        except Exception as exc:
            if not self.steps.refused(exc, "the tick's reads"):
                raise
        finally:
            self.steps.tick_ended()

    def _tick(self, now: float) -> None:
        self.checks.begin_tick()  # the tick's start: the pending step's deadline counts from it
        for backend in self.backends.all():
            backend.reap()
        with self.sessions() as session:
            # one query for the running and lately ended jobs (#15); the pending ones
            # are read after the running ones' checks (`check_pending_jobs`)
            jobs = store.jobs_of_tick(session, ended_since=self.alerting.ended_since(now))
            running = [job for job in jobs if job.state == JobState.RUNNING]
            ended_lately = [job for job in jobs if JobState(job.state).ended]
            for job in running:
                end = None
                with self.steps.isolated(session, f"job {job.id}"), \
                        self.steps.writing(session, "job state") as written:
                    self.checks.check_running(session, job, now)
                    end = _end_of(job)
                self._keep_unrecorded_end(job.id, None if written.ok else end)
            with self.steps.isolated(session, "observation"):
                # jobs that ended this tick get one last reading: their final output counts
                observed = [self._observed(job, self.checks.seen_alive(job.id)
                                           or self.backends.attempt(job), now) for job in running]
                self._store_samples(session, running, self.observer.observe(observed, now))
            with self.steps.isolated(session, "alerts"):
                self._alert(session, running, ended_lately, now)
            for job in running:
                if JobState(job.state) is not JobState.RUNNING:
                    self.observer.forget(job.id)
                    self._shim_observes.pop((job.id, job.attempt), None)
            self.notifier.wake_if_enqueued()
            with self.steps.isolated(session, "pending jobs"):
                self.checks.check_pending_jobs(session, running, now)
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
            if self.steps.unproven:  # writes failed, and none was tried since
                with self.steps.isolated(session, "write check"), \
                        self.steps.writing(session, "write check"):
                    store.write_probe(session)

    def _keep_unrecorded_end(self, job_id: str, end: JobEnd | None) -> None:
        """Keep the end of a job the database refused (shown and alerted on from
        memory); forget it once the job's state is written, or when it ends no more."""
        if end is None:
            self.unrecorded_ends.pop(job_id, None)
            return
        if job_id not in self.unrecorded_ends:
            log.warning("job %s: ended %s, not recorded yet (the database cannot be "
                        "written): shown and alerted from memory meanwhile", job_id,
                        end.state)
        self.unrecorded_ends[job_id] = end

    def _alert(self, session: Session, running: Sequence[Job], ended_lately: Sequence[Job],
               now: float) -> None:
        recorded: list[tuple[str, str]] = []
        with self.steps.writing(session, "alerts") as written:
            self.alerting.record(session, running, now, recorded, ended_lately=ended_lately)
        ends = self.unrecorded_ends
        if written.ok:
            self.alerting.forget_sent(recorded)
            self.alerting.ended_evaluated(now)
            if ends:  # the alerts of ends that could not be recorded: from memory
                self.alerting.send_unrecorded(
                    session, [job for job in running if job.id in ends], now, ends)
        else:
            self.alerting.send_unrecorded(session, running, now, ends)

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
        backend = self.backends.backend_for(job)
        if not backend.observes_locally:  # its shim publishes its readings
            queued = backend.queued(attempt)
            return ObservedJob(job_id=job.id, spec=stored_spec(job.spec_json),
                               attempt=job.attempt, root_pid=-1, root_create_time=None,
                               worker_pid=None, started_at=job.started_at, remote=True,
                               scheduler_job_id=backend.scheduler_job_id(attempt),
                               queued=queued, running_since=None if queued
                               else backend.running_since(attempt, now))
        if attempt.shim_pid is not None and (self.checks.seen_alive(job.id) is attempt
                                             or backend.shim_alive(attempt)):
            root, root_time, root_ticks, root_boot = (
                attempt.shim_pid, attempt.shim_create_time, attempt.shim_start_ticks,
                attempt.shim_boot_id)
        else:
            root, root_time, root_ticks, root_boot = (
                job.pid or -1, job.pid_create_time, job.pid_start_ticks, job.pid_boot_id)
        return ObservedJob(job_id=job.id, spec=stored_spec(job.spec_json),
                           attempt=job.attempt, root_pid=root, root_create_time=root_time,
                           worker_pid=job.pid, started_at=job.started_at,
                           root_start_ticks=root_ticks, root_boot_id=root_boot,
                           remote=self._observed_by_shim(job, backend))

    def _observed_by_shim(self, job: Job, backend: Backend) -> bool:
        """The job's shim publishes its readings: always on a backend whose jobs run
        elsewhere; under JOBSUP_OBSERVE=shim, if its launch asked for them (a job launched
        by a daemon without the setting is read here). `backend`: the job's."""
        if not backend.observes_locally:
            return True
        if self.settings.observe != "shim":
            return False
        key = (job.id, job.attempt)
        if key not in self._shim_observes:
            launch = files.read_launch(attempt_dir(self.settings.jobs_dir, job.id, job.attempt))
            self._shim_observes[key] = launch is not None and "observe" in launch
        return self._shim_observes[key]


def _end_of(job: Job) -> JobEnd | None:
    """The end this tick decided for the job (its row's values before their commit);
    None while it runs or waits for a restart."""
    if not JobState(job.state).ended:
        return None
    return JobEnd(state=job.state, reason=job.reason, exit_code=job.exit_code,
                  signal=job.signal, exit_reason=job.exit_reason, ended_at=job.ended_at)


def _running_detached(session: Session) -> dict[str, Job]:
    """The running jobs by id, detached: read after their session closes (their grace)."""
    running = {job.id: job for job in store.jobs_in_states(session, JobState.RUNNING)}
    for job in running.values():
        session.expunge(job)
    return running
