"""The per-job state checks of the tick (`JobChecks`, a part of the `Engine`): a running
job's processes diagnosed (`diagnose`: its exit record, its shim and worker) and the
lifecycle's verdict on them carried out (`lifecycle.judge`: finished, running, a shim to
continue or a worker to watch, a launch cut short, vanished); the stop it was asked for
(SIGTERM, then the backstop's SIGKILL) and, once it ended, the lifecycle's decision on
what follows (`finish`); a pending job's dependencies and its launch. The tick that runs
them, and the engine's loop, are `loop.py`'s.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Sequence

from sqlalchemy.orm import Session

from supervisor.alerting.rules import LOG_TAIL_LINES
from supervisor.backends.base import Attempt, Backend, LaunchDeferred, LaunchFate, ShimState
from supervisor.config import Settings
from supervisor.daemon import lifecycle
from supervisor.daemon.lifecycle import WorkerSeen
from supervisor.daemon.shared import Backends, Waker
from supervisor.runtime.fileio import tail_lines
from supervisor.runtime.files import ExitStatus, launched_from, log_path
from supervisor.runtime.procfs import StatReader, start_ticks_of, this_boot_id
from supervisor.spec import ExitReason, JobSpec, JobState, stored_spec
from supervisor.storage import store
from supervisor.storage.tables import Job
from supervisor.storage.transactions import TickSteps

log = logging.getLogger(__name__)


STOP_BACKSTOP_S = 5.0
"""Seconds past a job's stop grace, counted from the SIGTERM this daemon sent, after which
the daemon SIGKILLs the job itself (the shim's own timer should have done it by then)."""

LAUNCH_RETRY_S = 10.0
"""Seconds before a launch that failed for lack of space in the data dir, or that the
backend deferred (`LaunchDeferred`), is tried again."""

PENDING_BATCH = 100
"""Pending jobs whose stops and failures are written in one commit (a dependency's
failure fails its thousands of dependents in one tick: a commit each took ~4 ms)."""

PENDING_BUDGET_S = 0.2
"""The most seconds a tick spends acting on pending jobs (then it ends, and the next
one begins at once): a cascade of thousands of failures, or of launches (a shim's
start takes a few ms), never holds up the running jobs' exits and alerts for long, nor
makes /healthz see a stalled loop."""

TICK_TARGET_S = 0.45
"""The pending jobs' step ends by this many seconds after its tick began, where that
leaves it at least PENDING_MIN_S: with 1,000 running jobs observed first, a cascade's
ticks took up to 0.84 s with the whole PENDING_BUDGET_S spent after them (#30: a tick
under 0.5 s). A tick that cannot end by then (its running jobs took most of it) spends
the whole PENDING_BUDGET_S: a cascade of thousands of jobs then takes as few ticks,
each of which observes every running job again, as it can."""

PENDING_MIN_S = 0.1
"""The least time on pending jobs that is worth keeping a tick under TICK_TARGET_S."""

def stop_grace_s(job: Job, settings: Settings) -> float:
    """Seconds between a stop's SIGTERM and its SIGKILL: the job's, else the daemon's."""
    spec = stored_spec(job.spec_json)
    return spec.stop_grace_s or settings.stop_grace_s


def restarts_of(job: Job, settings: Settings) -> lifecycle.Restarts:
    """The job's restart policy, restarts so far and the daemon's backoff."""
    spec = stored_spec(job.spec_json)
    return lifecycle.Restarts(spec.restart_policy, done=job.restarts, limit=spec.max_restarts,
                              backoff_s=settings.restart_backoff_s,
                              backoff_max_s=settings.restart_backoff_max_s)


class JobChecks:
    """Each running and pending job's state, checked once a tick. What it keeps from
    tick to tick: the stops it sent and escalated, the jobs it stopped for the daemon's
    exit, the pending jobs' dependencies, and this tick's running jobs whose shim it saw
    alive."""

    def __init__(self, settings: Settings, backends: Backends, waker: Waker,
                 steps: TickSteps, stat_of: StatReader, clock: Callable[[], float]):
        self.settings = settings
        self.clock = clock
        """The engine's (`clock.SteadyClock`): the tick passes its `now`; read here only
        with the system clock, for the offset between the two (`lifecycle.end_time`)."""
        self.backends = backends
        self.waker = waker
        self.steps = steps
        self.stat_of = stat_of
        """Where a local shim's /proc stat is read (the observer's sampler, which keeps
        the jobs' files open)."""
        self._stop_sent: dict[tuple[str, int], float] = {}
        """(job, attempt) -> when this daemon sent the stop's SIGTERM (on the engine's
        clock): the backstop counts the grace from it, not from the request, which a
        daemon killed before it signalled may have recorded long before its successor
        sends it."""
        self._killed: set[tuple[str, int]] = set()
        self._shims_seen_alive: dict[str, Attempt] = {}
        """This tick's running jobs whose shim was alive (and not stopped) when their
        state was checked: their reading is rooted at the shim without a second look."""
        self._exiting = False
        """Set by `stop_starting`: no pending job starts."""
        self._longest_wait_s = max(settings.restart_backoff_max_s, LAUNCH_RETRY_S)
        """The longest a pending job is made to wait for its next attempt
        (`lifecycle.wait_over`)."""
        self._launched_from = launched_from(settings.data_dir, settings.jobs_dir)
        """Recorded with each attempt it launches (`Job.data_dir_id`, `Job.jobs_dir`)."""
        self._stopped_for_exit: set[str] = set()
        """Jobs the daemon's exit asked to stop (not those a user had stopped already)."""
        self._depends_on: dict[str, tuple[str, ...]] = {}
        """The `depends_on` of each pending job, kept while it is pending: read from its
        spec once, not each tick (`check_pending_jobs`)."""
        self._tick_began = time.monotonic()
        """When the current (or last) tick began (`time.monotonic()`)."""
        self._pending_unchanged: tuple[object, ...] | None = None
        """What the pending jobs' last pass that acted on none saw (`store.pending_summary`
        and the running jobs' states): while a tick sees the same and no restart is due
        (the summary's `first_start_at`), its pass would act on none either, and is
        skipped (#30)."""

    # -- what the engine asks ---------------------------------------------------------
    def begin_tick(self) -> None:
        self._tick_began = time.monotonic()
        self._shims_seen_alive = {}

    def seen_alive(self, job_id: str) -> Attempt | None:
        """The job's attempt if this tick saw its shim alive and running."""
        return self._shims_seen_alive.get(job_id)

    def stop_starting(self) -> None:
        """The daemon is stopping its jobs to exit: start no pending job."""
        self._exiting = True

    def stopped_for_exit(self, job_id: str) -> None:
        """The daemon's exit, not a person, asked this job to stop."""
        self._stopped_for_exit.add(job_id)

    # -- running jobs -----------------------------------------------------------------
    def check_running(self, session: Session, job: Job, now: float) -> None:
        attempt, backend = self.backends.attempt(job), self.backends.backend_for(job)
        if job.shim_pid is None and attempt.shim_pid is not None:
            store.record_shim(job, attempt)
        seen = self.diagnose(job, attempt, backend, now)
        verdict = lifecycle.judge(seen)
        if verdict.step is lifecycle.Step.FINISH:
            assert seen.exit is not None
            backend.forget(attempt)
            self.finish(session, job, seen.exit, now)
            return

        if job.stop_requested_at is None and self._served_its_purpose(session, job):
            store.stop_when_served(job, now=now)
        if job.stop_requested_at is not None:
            self._stop_running(job, attempt, now)
        self._act(session, job, attempt, backend, seen, verdict, now)

    def diagnose(self, job: Job, attempt: Attempt, backend: Backend,
                 now: float) -> lifecycle.Processes:
        """What a running job's processes are now, read as little as deciding needs: a
        running shim has not recorded an exit yet (or has just done so: then the exit
        watcher wakes the next tick as it ends), so its status file is not read, nor its
        worker's file once the worker's pid is known (most jobs, most ticks; #15). Once
        recorded, the worker is the row's (as `Backends.worker` gives it), so a job whose
        files vanished is judged by its processes, never as a launch that never started."""
        worker = None if job.pid is not None else backend.read_worker(attempt)
        if worker is not None:
            store.record_worker(job, worker)
        shim = backend.shim_state(attempt, self.stat_of)
        if (shim is not ShimState.GONE and None in (job.shim_start_ticks, job.shim_boot_id)
                and attempt.shim_pid is not None and backend.observes_locally):
            # a shim started before start ticks or boot ids were recorded, matched by its
            # create time this once: from now on by its start ticks and this boot's id
            # (immune to clock steps)
            if job.shim_start_ticks is None:
                job.shim_start_ticks = start_ticks_of(attempt.shim_pid)
            job.shim_boot_id = this_boot_id()
        status = None if shim is ShimState.RUNNING else backend.read_exit(attempt)
        seen = WorkerSeen.UNREAD
        launch_on_disk = True
        if status is None and shim is not ShimState.RUNNING:
            worker = worker or store.recorded_worker(job)  # also with worker.json gone
            if worker is None:
                seen = WorkerSeen.NEVER_STARTED
            elif (backend.worker_running(worker) if shim is ShimState.SUSPENDED
                  else backend.worker_alive(worker)):
                seen = WorkerSeen.ALIVE
            else:
                seen = WorkerSeen.GONE
            if shim is ShimState.GONE and seen is not WorkerSeen.ALIVE:
                status = backend.read_exit(attempt)  # the shim may have just finished
                launch_on_disk = status is not None or backend.launch_on_disk(attempt)
        return lifecycle.Processes(
            shim=shim, worker=seen, exit=status, shim_recorded=attempt.shim_pid is not None,
            stop_requested=job.stop_requested_at is not None,
            launch_age_s=now - (job.started_at or now), launch_on_disk=launch_on_disk,
            worker_record=worker)

    def _act(self, session: Session, job: Job, attempt: Attempt, backend: Backend,
             seen: lifecycle.Processes, verdict: lifecycle.Verdict, now: float) -> None:
        """Do what the lifecycle's verdict on a running job's processes says."""
        step = verdict.step
        if step is lifecycle.Step.RUNS:
            self._shims_seen_alive[job.id] = attempt  # its reading needs no new look
            note = backend.status_note(attempt)  # a scheduler's queue, and why
            if note is not None and note != job.reason:
                job.reason = note
        elif step is lifecycle.Step.RESUME_SHIM:
            log.warning("job %s: its shim (pid %s) was stopped (SIGSTOP) after the "
                        "worker ended; continuing it (SIGCONT)", job.id, attempt.shim_pid)
            backend.resume_shim(attempt)
        elif step is lifecycle.Step.WATCH_WORKER:
            # the shim died but the job runs on: watch the worker itself, so its end
            # is noticed at once (the watcher ignores a pid it already watches)
            backend.watch(attempt, seen.worker_record)
        elif step is lifecycle.Step.SETTLE_LAUNCH:
            fate = backend.settle_launch(attempt)
            if fate is not LaunchFate.WAIT:
                self._apply(session, job, lifecycle.launch_cut_short(
                    shim_recorded=attempt.shim_pid is not None,
                    abandoned=fate is LaunchFate.ABANDONED), at=now, now=now)
        elif verdict.decision is not None:
            self._apply(session, job, verdict.decision, at=now, now=now)

    @staticmethod
    def _served_its_purpose(session: Session, job: Job) -> bool:
        """All the jobs of its `stop_when_ended` have ended."""
        waited_for = stored_spec(job.spec_json).stop_when_ended
        if not waited_for:
            return False
        states = [session.get(Job, job_id, populate_existing=True) for job_id in waited_for]
        return all(other is None or JobState(other.state).ended for other in states)

    def _stop_running(self, job: Job, attempt: Attempt, now: float) -> None:
        key, backend = (job.id, job.attempt), self.backends.backend_for(job)
        grace_s = stop_grace_s(job, self.settings)
        worker = self.backends.worker(job, attempt)  # the row's: also with its files gone
        sent_at = self._stop_sent.get(key)
        if sent_at is None:
            self._stop_sent[key] = now
            log.info("job %s: stopping (SIGTERM, SIGKILL after %.0f s)", job.id, grace_s)
            backend.request_stop(attempt, worker)
        elif key not in self._killed and now - sent_at > grace_s + STOP_BACKSTOP_S:
            self._killed.add(key)
            log.warning("job %s: still running %.0f s after stop; SIGKILL", job.id,
                        now - sent_at)
            backend.kill(attempt, worker)

    def finish(self, session: Session, job: Job, status: ExitStatus, now: float) -> None:
        """Record the exit and apply what the lifecycle decides follows it: ended, or
        pending again for a restart."""
        store.record_exit(job, exit_code=status.exit_code, signal=status.signal)
        ended_at = lifecycle.end_time(status.ended_at, now=now,
                                      offset_s=time.time() - self.clock(),
                                      started_at=job.started_at)
        stop_requested = job.stop_requested_at is not None or status.stop_requested
        lines: list[str] = []
        if lifecycle.is_failure(status, stop_requested=stop_requested):
            # what the log tail and the exit tell (NCCL, CUDA OOM, the rank)
            lines, _ = tail_lines(log_path(self.settings.jobs_dir, job.id, job.attempt),
                                  LOG_TAIL_LINES)
        served = stop_requested and self._served_its_purpose(session, job)
        by_daemon_exit = stop_requested and not served and job.id in self._stopped_for_exit
        stop_cause = ("because the jobs it served have ended" if served
                      else "because the daemon is exiting (--stop-jobs-on-exit)"
                      if by_daemon_exit else "on request")
        decision = lifecycle.after_exit(
            lifecycle.exit_of(status, stop_requested=stop_requested, log_tail=lines,
                              killed_by_backstop=(job.id, job.attempt) in self._killed,
                              stop_cause=stop_cause,
                              by_daemon_exit=by_daemon_exit,
                              scheduler_end=self.backends.backend_for(job).scheduler_end(
                                  self.backends.attempt(job))),
            restarts_of(job, self.settings))
        self._apply(session, job, decision, at=ended_at, now=now)

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
            self.waker.wake_at(restart_at)

    # -- pending jobs -----------------------------------------------------------------
    def check_pending_jobs(self, session: Session, running: Sequence[Job], now: float) -> None:
        """Each pending job the tick can act on: stopped, failed by a dependency's end, or
        launched, oldest first (a dependency is older than its dependents, so a failure
        runs down a chain in one tick). Thousands may wait on one running dependency (a
        sweep behind its data step): they are read as a few columns
        (`store.pending_jobs`), their dependencies' states known from the tick's own
        reads, and a job's row is loaded only when the lifecycle says something happens
        to it (#30: a row and a query per pending job took 1.5-2.3 s a tick at 10,000
        jobs). Their writes are committed `PENDING_BATCH` jobs at a time, for at most
        `PENDING_BUDGET_S`: the rest wait for the next tick, which comes at once."""
        if self._exiting:  # the daemon is stopping its jobs: start none
            return
        # nothing it reads changed since a pass that acted on none: it would act on none
        # (#30: 10,000 pending jobs cost ~80 ms a tick to read and check again)
        summary = store.pending_summary(session)
        seen = (summary, [(job.id, job.state) for job in running])
        if seen == self._pending_unchanged and (summary.first_start_at is None
                                                or now < summary.first_start_at):
            return
        self._pending_unchanged = None
        waiting = store.pending_jobs(session)
        depends_on = {row.id: self._depends_on.get(row.id) for row in waiting}
        unknown = [job_id for job_id, deps in depends_on.items() if deps is None]
        for job_id, spec_json in store.spec_jsons(session, unknown).items():
            depends_on[job_id] = tuple(stored_spec(spec_json).depends_on)
        self._depends_on = {job_id: deps or () for job_id, deps in depends_on.items()}
        known: dict[str, tuple[str, JobState]] = {job.id: (job.name, JobState(job.state))
                                                  for job in running}
        known.update((row.id, (row.name, JobState.PENDING)) for row in waiting)
        others = {dep for deps in self._depends_on.values() for dep in deps} - known.keys()
        known.update(store.names_and_states(session, others))
        began = time.monotonic()
        left_s = self._tick_began + TICK_TARGET_S - began
        deadline = began + (min(left_s, PENDING_BUDGET_S) if left_s >= PENDING_MIN_S
                            else PENDING_BUDGET_S)
        acted = False
        batch: list[tuple[store.PendingJob, list[lifecycle.Dependency]]] = []
        # the lifecycle's answer per list of dependencies, while no state they read
        # changes: a sweep's thousands of jobs share one (~20 us each, #30)
        answers: dict[tuple[str, ...], tuple[list[lifecycle.Dependency],
                                             lifecycle.Decision | None, bool]] = {}
        for index, row in enumerate(waiting):
            stop_requested = row.stop_requested_at is not None
            answer = None if stop_requested else answers.get(self._depends_on[row.id])
            if answer is None:
                dependencies = [
                    lifecycle.Dependency(dep, *known.get(dep, ("?", JobState.LOST)))
                    for dep in self._depends_on[row.id]]
                answer = (dependencies, lifecycle.before_start(
                    stop_requested=stop_requested, dependencies=dependencies),
                    lifecycle.dependencies_met(dependencies))
                if not stop_requested:
                    answers[self._depends_on[row.id]] = answer
            dependencies, decision, met = answer
            if decision is None and not (
                    met and lifecycle.wait_over(row.next_start_at, now, self._longest_wait_s)):
                continue  # it waits: nothing to read or write
            # what it becomes, for its dependents further down (the row, read again
            # when the batch is written, may say otherwise: they follow next tick)
            known[row.id] = (row.name, decision.state if decision else JobState.RUNNING)
            acted = True
            answers.clear()
            batch.append((row, dependencies))
            if len(batch) >= PENDING_BATCH or index == len(waiting) - 1:
                self._write_pending(session, batch, now)
                batch = []
                if time.monotonic() > deadline and index < len(waiting) - 1:
                    log.info("%d pending job(s) left for the next tick (this one spent "
                             "%.2f s on pending jobs)", len(waiting) - index - 1,
                             time.monotonic() - began)
                    self.waker.wake()
                    return
        if batch:
            self._write_pending(session, batch, now)
        elif not acted:
            self._pending_unchanged = seen

    def _write_pending(self, session: Session,
                       batch: Sequence[tuple[store.PendingJob, list[lifecycle.Dependency]]],
                       now: float) -> None:
        """Act on these pending jobs: one commit for their stops and failures (a launch
        commits its own attempt before it starts). A bug with one of them rolls the
        batch back, and each is then tried alone, as its own step: the others still
        start."""
        try:
            with self.steps.writing(session, "pending jobs"):
                self._act_on_pending(session, batch, now)
            return
        except Exception:  # noqa: BLE001 - which job, and what, the tries alone tell
            session.rollback()
        for one in batch:
            with self.steps.isolated(session, f"job {one[0].id}"), \
                    self.steps.writing(session, "job start"):
                self._act_on_pending(session, [one], now)

    def _act_on_pending(self, session: Session,
                        batch: Sequence[tuple[store.PendingJob, list[lifecycle.Dependency]]],
                        now: float) -> None:
        """Their rows read as they are now (a stop asked through the API since the
        tick's read is seen before a launch), each checked."""
        jobs = store.jobs_with_ids(session, [row.id for row, _ in batch], fresh=True)
        for row, dependencies in batch:
            job = jobs.get(row.id)
            if job is not None and job.state == JobState.PENDING:
                self._check_pending(session, job, dependencies, now)

    def _check_pending(self, session: Session, job: Job,
                       dependencies: Sequence[lifecycle.Dependency], now: float) -> None:
        decision = lifecycle.before_start(stop_requested=job.stop_requested_at is not None,
                                          dependencies=dependencies)
        if decision is not None:
            self._apply(session, job, decision, at=now, now=now)
            return
        if not lifecycle.dependencies_met(dependencies):
            return
        if not lifecycle.wait_over(job.next_start_at, now, self._longest_wait_s):
            return
        self._launch(session, job, stored_spec(job.spec_json), now)

    def _launch(self, session: Session, job: Job, spec: JobSpec, now: float) -> None:
        """Record the attempt first, then start it: a daemon crash between the two
        leaves a `running` row the next daemon can settle, never a job started twice."""
        store.start_attempt(session, job, now=now, launched_from=self._launched_from)
        session.commit()
        try:
            attempt = self.backends.backend_for(job).start(job.id, job.attempt, spec,
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
