"""Turn the sampler's readings into what users see: progress from the best source,
stored samples, forecasts with the disk runway of each filesystem, and the per-job view
the API renders. Keeps per-job state across ticks (scanners, histories, CPU marks:
`jobstate.py`); a job's view and sample are built from its readings in `building.py`.

Each job's reading stands alone. An exception while reading one job (its process tree,
its output, its progress file, the arithmetic after) costs that job its fresh figures
for the tick, nothing more: it keeps its previous view, whose `progress.observation_error`
says why and whose `progress.observed_at` says how old the figures are; no sample is
stored for it; the other jobs are observed as usual.

The file side of a reading (the output scan, the progress file or log, the free space of
the filesystem) of a job whose output directory is watched whole on a local disk, with a
few file names reported since, costs a few system calls: it is taken in the tick thread
after the process trees (`Observer._reads_inline`; a local disk stalled in the kernel
stalls the tick). Any other (a first walk, a directory moved in, an overflowed event
queue, a network filesystem, a job whose last reading took over 50 ms) runs in a few
worker threads, each job's alone: the scanner of a job is not thread-safe, so a job
never has two readings running. A tick waits for them at most
`scan_budget_s` in all. A reading not done by then (the first scan of a million files
takes seconds; an NFS server may hang) leaves its job with its last known figures and
`observation_error` "output scan still running (12.3 s so far)", and no new reading of
that job starts until it ends; a later tick picks up its result without waiting for it
again. The process side is read for every job each tick regardless.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from functools import partial
from pathlib import Path

from supervisor.observe import forecast, rates
from supervisor.observe.building import JobViewBuilder
from supervisor.observe.jobstate import EndingReading, InflightReading, KeptJobState, describe_error
from supervisor.observe.readings import (
    DisksOfTick,
    FileReading,
    FileSide,
    LogsDisk,
    ObservedJob,
    ScannerFactory,
    items_from,
    output_scanner,
)
from supervisor.observe.remote import NO_TREE, ShimFileSide
from supervisor.observe.threads import FilePool
from supervisor.observe.view import (
    JobView,
    ProgressRecord,
)
from supervisor.runtime.dirwatch import DirWatcher
from supervisor.runtime.files import attempt_dir
from supervisor.runtime.sampler import Sampler, TreeReading, TreeTarget
from supervisor.storage.tables import Sample, SampleRecord

log = logging.getLogger(__name__)


SCAN_BUDGET_S = 1.0
"""Default of the longest a tick waits for the jobs' file readings, in seconds: half the
default sample interval (pass `scan_budget_s`, e.g. `sample_interval / 2`)."""

FILE_WORKERS = 64
"""Most threads reading the jobs' output trees and progress files. A thread is started
only when every thread is busy, and each job has at most one reading in flight, so a
reading stuck on a dead file server holds one thread and the other jobs get new ones
(I/O bound: a handful serve hundreds of healthy jobs; see `READINGS_PER_BATCH`)."""


INLINE_MAX_S = 0.05
"""A job whose last file reading took longer than this (wall clock) is read in the
threads (`Observer._reads_inline`), until one takes less."""

INLINE_TICK_MAX_S = 0.2
"""Once the readings taken in the tick thread took this long in a tick, that tick's
remaining ones go to the threads (`Observer._read_inline`)."""


READINGS_PER_BATCH = 16
"""Most jobs whose file readings one worker thread takes one after the other per tick
(`FilePool.submit_all`): more jobs on one filesystem spread over more threads."""


def _final_progress(shown: ProgressRecord, job: ObservedJob,
                    reading: FileReading) -> ProgressRecord:
    """An ended job's progress from its final reading (`shown`: what the view had)."""
    items_done, items_total, metrics, source = items_from(job.spec, reading)
    moved = items_done is not None and items_done != shown.items_done
    return ProgressRecord(
        items_done=items_done, items_total=items_total, files=reading.files,
        bytes_written=reading.bytes_written, source=source,
        last_progress_at=reading.t if moved else shown.last_progress_at,
        metrics=metrics, observed_at=reading.t)


class Observer:
    """Each running job's readings once a tick, isolated, and the views and samples
    built from them (`JobViewBuilder`): what the daemon knows of its jobs between ticks
    (`views`)."""

    def __init__(self, jobs_dir: Path, sampler: Sampler | None = None, *,
                 scan_budget_s: float = SCAN_BUDGET_S, workers: int = FILE_WORKERS,
                 make_scanner: ScannerFactory | None = None, watch_outputs: bool = True,
                 clock: Callable[[], float] = time.time):
        """`scan_budget_s`: the longest a tick waits for the jobs' file readings.
        `make_scanner`: builds a job's output scanner; default `OutputScanner`, with
        inotify watches on output directories of local filesystems if `watch_outputs`
        (`dirwatch`; else they are statted each tick and listed when they change)."""
        self.jobs_dir = jobs_dir
        self.logs_disk = LogsDisk(jobs_dir)
        """The free space under the jobs' logs, read once a tick for all (`disk_low`)."""
        self.disks = DisksOfTick()
        """The free space of the jobs' output dirs and cwds, each read once a tick."""
        self.sampler = sampler or Sampler()
        self.scan_budget_s = scan_budget_s
        self.clock = clock
        """The daemon's clock (the `now` of `observe`): remote jobs' lines are put on it."""
        self.dir_watcher = (DirWatcher.open() if make_scanner is None and watch_outputs
                            else None)
        self.make_scanner: ScannerFactory = make_scanner or partial(
            output_scanner, watcher=self.dir_watcher)
        self._workers = FilePool(workers)
        self._jobs_dir_is_local: bool | None = None
        self._state: dict[str, KeptJobState] = {}
        self._ending: dict[str, EndingReading] = {}
        self._tick = 0
        self._sampler_error: str | None = None
        self.building = JobViewBuilder()
        self.views: dict[str, JobView] = {}
        """Latest view per job id; replaced whole each tick, so readers need no lock."""
        self.settled: list[str] = []
        """Ended jobs whose final reading the last `observe` put in their views."""

    def observe(self, jobs: Sequence[ObservedJob], now: float) -> list[SampleRecord]:
        """Sample every running job once; returns the rows to store (none for a job
        whose reading is not fresh)."""
        self._tick += 1
        started = time.monotonic()
        self._settle_endings({job.job_id for job in jobs})
        states = [self._state_for(job, now, started) for job in jobs]
        inline = self._start_readings(states, now, started)  # the threads' start now
        readings, tree_errors = self._sample_trees(jobs, now)  # read close to `now`
        self._read_inline(inline, now, started)
        waiting = [state.inflight.future for state in states  # those started this tick;
                   if state.inflight is not None and state.inflight.tick == self._tick]
        if waiting:  # older ones are picked up if done, never waited for again
            concurrent.futures.wait(
                waiting, timeout=max(0.0, started + self.scan_budget_s - time.monotonic()))
        samples, views = [], dict(self.views)
        demands: dict[int, list[tuple[str, forecast.JobDiskDemand, int, float]]] = {}
        forecasts: dict[str, forecast.JobForecast] = {}
        for job, state in zip(jobs, states, strict=True):
            state.pick_up(self._tick)
            tree = self._shim_tree(state) if job.remote else readings.get(job.job_id)
            backlog: list[SampleRecord] = []
            try:
                if tree is None:
                    raise RuntimeError(tree_errors.get(job.job_id, "no process reading"))
                view, sample, job_forecast = self.building.observe_one(
                    job, state, tree, now, backlog, self.views.get(job.job_id))
            except Exception as error:  # a bug or a surprise in this job's reading only
                message = f"observation failed: {describe_error(error)}"
                if tree is None:
                    message = f"process reading failed: {error}"
                self.building.log_error(job.job_id, state, message, error)
                views[job.job_id] = self.building.stale_view(job, message,
                                                             self.views.get(job.job_id))
                continue
            samples += backlog
            if sample is not None:
                samples.append(sample)
                state.last_sample_t = sample.t
            views[job.job_id] = view
            forecasts[job.job_id] = job_forecast
            reading = state.reading
            if view.disk_device is not None and reading is not None \
                    and reading.free_bytes is not None:
                demand = forecast.disk_demand(job.job_id, job_forecast,
                                        bytes_written=view.progress.bytes_written)
                demands.setdefault(view.disk_device, []).append(
                    (job.job_id, demand, reading.free_bytes, reading.t))
        for group in demands.values():
            free_bytes = max(group, key=lambda entry: entry[3])[2]  # the newest reading's
            try:
                runway = forecast.disk_runway([d for _, d, _, _ in group], free_bytes=free_bytes)
                shared = [(job.job_id, forecast.with_share(forecasts[job.job_id], runway, job))
                          for job in runway.jobs]
            except Exception:  # these jobs keep their own forecasts, as if alone
                log.exception("disk runway of jobs %s failed", [g[0] for g in group])
                continue
            for job_id, job_forecast in shared:  # their views, built this tick, not shown yet
                views[job_id].forecast = job_forecast
        self.views = views
        return samples

    def forget(self, job_id: str) -> None:
        """The job ended: drop its per-tick state; its view keeps the final progress but
        no forecast (an ended job writes nothing more) and no live resources.

        If its file reading is still running, or its last one left output files still
        settling unstatted, one more reading after it (stating them all) becomes the
        job's final reading: a later tick puts its figures in the view when it is done."""
        state = self._state.pop(job_id, None)
        self.sampler.forget([job_id])
        view = self.views.get(job_id)
        progress = view.progress if view is not None else None
        if state is not None and isinstance(state.outcome, FileReading) \
                and state.job is not None and progress is not None:  # read, never shown
            progress = _final_progress(progress, state.job, state.outcome)
        last = state.outcome if state is not None else None
        if state is not None and not isinstance(last, FileReading):
            last = state.reading
        if state is not None and state.job is not None and (
                state.inflight is not None or (isinstance(last, FileReading) and last.waiting)):
            try:
                final: Future[FileReading] | None = self._workers.submit(
                    self._final_reading(state))
            except RuntimeError:  # closed: the last figures stay
                final = None
                state.files.close()
            if final is not None:
                self._ending[job_id] = EndingReading(final, state.job)
                if progress is not None:
                    progress = replace(progress,
                                       observation_error="final output scan still running")
        elif state is not None:
            state.files.close()  # no reading of its own left: its watches go now
        if view is not None and progress is not None:
            views = dict(self.views)
            views[job_id] = JobView(progress=progress, disk_device=view.disk_device)
            self.views = views

    def close(self) -> None:
        """The daemon stops: readings not started are cancelled, running ones are left
        to finish in their (daemon) threads; nothing waits for them."""
        self._workers.close()
        self._ending.clear()
        self.sampler.close()
        if self.dir_watcher is not None:
            self.dir_watcher.close()

    def last_progress_at(self, job_id: str) -> float | None:
        state = self._state.get(job_id)
        return state.last_progress_at if state else None

    def seed(self, job_id: str, progress: ProgressRecord) -> None:
        """A view for a job seen before a daemon restart (its stored progress)."""
        self.views.setdefault(job_id, JobView(progress=progress))

    def _state_for(self, job: ObservedJob, now: float, started: float) -> KeptJobState:
        """The job's state, its file reading picked up if done (`_start_readings`
        starts the next)."""
        state = self._state.get(job.job_id)
        if state is None:
            state = self._state[job.job_id] = KeptJobState(
                self._file_side(job), activity_at=job.started_at)
        state.job = job
        state.tick_at = (now, started)
        state.pick_up(self._tick)
        return state

    def _start_readings(self, states: Sequence[KeptJobState], now: float, started: float
                        ) -> list[KeptJobState]:
        """A new file reading for every job with none in flight. Those whose cost is
        bounded (`_reads_inline`: most jobs, most ticks) are returned, to be read in the
        tick thread (`_read_inline`) once the process trees are read; the others are
        handed to the threads now (`_submit`)."""
        if self.dir_watcher is not None:
            self.dir_watcher.drain()  # what the watches reported is known before choosing
        inline: list[KeptJobState] = []
        others: list[KeptJobState] = []
        for state in states:
            if state.inflight is not None or state.job is None:
                continue
            (inline if self._reads_inline(state, state.job) else others).append(state)
        self._submit(others, now, started)
        return inline

    def _read_inline(self, states: Sequence[KeptJobState], now: float, started: float) -> None:
        """Take these jobs' readings in the tick thread, one after the other; once they
        have taken INLINE_TICK_MAX_S this tick, the rest go to the threads."""
        begun = time.monotonic()
        for index, state in enumerate(states):
            if time.monotonic() - begun > INLINE_TICK_MAX_S:
                self._submit(states[index:], now, started)
                return
            assert state.job is not None
            try:
                state.outcome = state.files.read(state.job, now)
            except Exception as error:  # costs this job its fresh figures, nothing more
                state.outcome = error

    def _submit(self, states: Sequence[KeptJobState], now: float, started: float) -> None:
        """Hand these jobs' readings to the threads in batches of at most
        READINGS_PER_BATCH jobs whose last reading was on the same filesystem (a dead
        file server holds only readings that would hang on it anyway); a job not read
        yet, or whose last reading outlived its tick (a huge tree), is a batch of its
        own, so it holds no other job back."""
        batches: dict[object, list[tuple[KeptJobState, ObservedJob]]] = {}
        for state in states:
            assert state.job is not None
            device = state.reading.device if state.reading is not None else None
            key = (device if device is not None and not state.slow
                   else ("job", state.job.job_id))
            batches.setdefault(key, []).append((state, state.job))
        for members in batches.values():
            for first in range(0, len(members), READINGS_PER_BATCH):
                batch = members[first:first + READINGS_PER_BATCH]
                try:
                    futures = self._workers.submit_all(
                        [partial(state.files.read, job, now) for state, job in batch])
                except RuntimeError as error:
                    for state, _ in batch:
                        state.start_error = str(error)
                    continue
                for (state, _), future in zip(batch, futures, strict=True):
                    state.start_error = None
                    state.inflight = InflightReading(future, started, self._tick)

    def _reads_inline(self, state: KeptJobState, job: ObservedJob) -> bool:
        """The job's file reading costs a few system calls on local disks: taken in the
        tick thread, not handed to a thread (whose hand-over and contention for the
        interpreter's lock cost more CPU than such a reading: #15). So it is when its
        output directory is watched whole and the watches reported a few file names
        since (no new directory, no lost event: `FileSide.watched`), its last reading was
        on a local filesystem, as is the data dir (its progress file and log), and that
        reading took at most INLINE_MAX_S. Never a job's first reading (a walk of its
        whole tree) nor a remote job's. A local disk that stalls in the kernel stalls
        the tick with it (a network filesystem never reaches here)."""
        watcher, last = self.dir_watcher, state.reading
        return (watcher is not None and not job.remote
                and last is not None and last.device is not None
                and last.took_s is not None and last.took_s <= INLINE_MAX_S
                and self._jobs_dir_local() and watcher.is_local(last.device)
                and state.files.watched(job))

    def _jobs_dir_local(self) -> bool:
        """The data dir's jobs folder is on a local filesystem (looked up once)."""
        if self._jobs_dir_is_local is None:
            try:
                device = os.stat(self.jobs_dir).st_dev
            except OSError:
                return False
            self._jobs_dir_is_local = (self.dir_watcher is not None
                                       and self.dir_watcher.is_local(device))
        return self._jobs_dir_is_local

    def _file_side(self, job: ObservedJob) -> FileSide:
        if job.remote:
            return ShimFileSide(self.jobs_dir, self.make_scanner,
                                attempt_dir(self.jobs_dir, job.job_id, job.attempt),
                                self.clock)
        return FileSide(self.jobs_dir, self.make_scanner, self.logs_disk, self.disks)

    @staticmethod
    def _shim_tree(state: KeptJobState) -> TreeReading:
        """A remote job's process figures: its shim's newest reading, from the file
        reading picked up this tick if it brought one, else the last one."""
        outcome = state.outcome
        if isinstance(outcome, FileReading) and outcome.shim:
            state.shim_tree, state.node = outcome.shim[-1].tree, outcome.shim[-1].node
        return state.shim_tree or NO_TREE

    def _sample_trees(self, jobs: Sequence[ObservedJob], now: float
                      ) -> tuple[dict[str, TreeReading], dict[str, str]]:
        """Every job's process tree in one pass; if that pass fails, job by job, so a
        failure costs only the jobs it concerns (their CPU % reads 0 this once)."""
        targets = [TreeTarget(j.job_id, j.root_pid, j.root_create_time, j.worker_pid,
                              j.root_start_ticks, j.root_boot_id) for j in jobs if not j.remote]
        try:
            readings = self.sampler.sample(targets, now)
            self._sampler_error = None
            return readings, {}
        except Exception as error:
            message = describe_error(error)
            if message != self._sampler_error:
                log.exception("sampling the process trees failed; sampling job by job")
            self._sampler_error = message
        readings, errors = {}, {}
        for target in targets:
            try:
                readings.update(self.sampler.sample([target], now))
            except Exception as error:
                errors[target.job_id] = describe_error(error)
        return readings, errors

    def _final_reading(self, state: KeptJobState) -> Callable[[], FileReading]:
        """A final reading, run after the job's in-flight one if any (so never two at
        once on its scanner), taken for the time it starts on the observer's clock."""
        assert state.job is not None
        running = state.inflight.future if state.inflight is not None else None
        job, files = state.job, state.files
        tick_now, tick_started = state.tick_at

        def read() -> FileReading:
            if running is not None:
                concurrent.futures.wait([running])
            try:
                return files.read(job, tick_now + (time.monotonic() - tick_started),
                                  final=True)
            finally:
                files.close()  # the job's last reading: its watches go

        return read

    def _settle_endings(self, running: set[str]) -> None:
        """Put the figures of ended jobs' final readings, once done, in their views."""
        views = None
        self.settled = []
        for job_id, ending in list(self._ending.items()):
            if job_id in running:  # running again: its new attempt's readings count
                del self._ending[job_id]
                continue
            if not ending.future.done():
                continue
            del self._ending[job_id]
            view = self.views.get(job_id)
            if view is None:
                continue
            if ending.future.cancelled():
                error: BaseException | None = RuntimeError("the reading was cancelled")
            else:
                error = ending.future.exception()
            if error is not None:
                progress = replace(view.progress, observation_error=(
                    f"final output scan failed: {describe_error(error)}"))
            else:
                progress = _final_progress(view.progress, ending.job, ending.future.result())
            views = views if views is not None else dict(self.views)
            views[job_id] = replace(view, progress=progress)
            self.settled.append(job_id)
        if views is not None:
            self.views = views

    def load_history(self, job: ObservedJob, rows: Sequence[Sample]) -> None:
        """Continue a running job's forecast after a daemon restart from stored samples."""
        state = self._state.setdefault(job.job_id, KeptJobState(
            self._file_side(job), activity_at=job.started_at))
        if rows:
            state.last_sample_t = rows[-1].t
        for row in rows:
            self.building.remember(state, rates.Observation(row.t, row.items_done,
                                                               row.bytes_written))
            state.note_items(row.items_done, row.t)
        if rows:  # the daemon was down: count its restart as activity, not as a stall
            state.activity_at = max(state.activity_at or 0.0, rows[-1].t)
