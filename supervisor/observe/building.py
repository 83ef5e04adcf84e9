"""Building a job's view and sample from one tick's readings (`JobViewBuilder`, which
the `Observer` holds and hands each job's previous view): its progress from a fresh file
reading or, when there is none, its last known figures and why; its forecast and
resources; the samples of a remote job's older readings; what its forecast history
keeps. The readings themselves, and the tick that takes them, are `observer.py`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace

from supervisor.observe import forecast, rates
from supervisor.observe.jobstate import KeptJobState, describe_error
from supervisor.observe.readings import FileReading, ObservedJob, ShimReading, items_from
from supervisor.observe.remote import backlog_samples
from supervisor.observe.view import GpuShare, JobView, ProgressRecord, ResourceRecord
from supervisor.runtime.sampler import TreeGpuMemory, TreeReading
from supervisor.storage.tables import SampleRecord

log = logging.getLogger(__name__)


HISTORY_KEEP_S = 60.0
"""A reading with no new item or byte is kept in the history at most this often (it
still marks time passing); readings with news are always kept."""

class JobViewBuilder:
    """The view and sample of one job per tick, from its readings, what the observer
    keeps of it (`KeptJobState`) and its previous view; it keeps nothing itself."""

    def observe_one(self, job: ObservedJob, state: KeptJobState, tree: TreeReading, now: float,
                    backlog: list[SampleRecord], previous: JobView | None
                    ) -> tuple[JobView, SampleRecord | None, forecast.JobForecast]:
        """`backlog`: receives the samples of a remote job's readings older than the
        newest (those its shim wrote since the last tick, or while the daemon was down).
        `previous`: the job's view of the tick before, if any."""
        spec = job.spec
        outcome, state.outcome = state.outcome, None
        if isinstance(outcome, FileReading):
            state.reading = fresh = outcome
            items_done, items_total, metrics, source = items_from(spec, fresh)
            if len(outcome.shim) > 1:  # a remote job's readings older than its newest
                backlog += self._backlog(job, state, outcome.shim[:-1], items_total,
                                         counted=source == "files")
            state.note_items(items_done, fresh.t)
            if fresh.stale is None:
                self.remember(state, rates.Observation(fresh.t, items_done,
                                                           fresh.bytes_written))
            progress = ProgressRecord(
                items_done=items_done, items_total=items_total, files=fresh.files,
                bytes_written=fresh.bytes_written, source=source,
                last_progress_at=state.last_progress_at, metrics=metrics,
                observed_at=fresh.t, observation_error=fresh.stale)
            if fresh.stale != state.logged_error:
                if fresh.stale is not None:  # (a shim that has not published yet: debug)
                    log.log(logging.WARNING if state.node else logging.DEBUG, "job %s: %s",
                            job.job_id, fresh.stale)
                elif state.logged_error is not None and job.remote:
                    log.info("job %s: its shim's readings are fresh again", job.job_id)
            state.logged_error = fresh.stale
        else:  # nothing new: the last known figures, and why
            error = self._why_not_fresh(job, state, outcome)
            self.log_error(job.job_id, state, error, outcome)
            shown = previous.progress if previous is not None else ProgressRecord(
                items_total=spec.expected_items)
            progress = replace(shown, observation_error=error)
        reading = state.reading
        free_bytes = reading.free_bytes if reading is not None else None
        device = (reading.device if reading is not None
                  else previous.disk_device if previous is not None else None)

        state.note_activity(tree, progress.bytes_written, now)
        job_forecast = state.forecaster.forecast(
            items_total=progress.items_total, now=now, disk_free_bytes=free_bytes,
            declared_bytes_per_item=spec.bytes_per_item, stall_timeout_s=spec.stall_timeout_s)
        resources = ResourceRecord(
            status=tree.status, num_procs=tree.num_procs, num_threads=tree.num_threads,
            cpu_percent=round(tree.cpu_percent, 1), rss_bytes=tree.rss_bytes,
            read_bytes=tree.read_bytes, gpu_memory_bytes=tree.gpu_memory_bytes,
            gpu_devices=gpu_shares(tree.gpu_devices), node=state.node,
            scheduler_job_id=job.scheduler_job_id)
        view = JobView(progress=progress, forecast=job_forecast, resources=resources,
                       cpu_time_s=tree.cpu_time_s, read_bytes=tree.read_bytes,
                       disk_device=device, first_item_at=state.first_item_at,
                       activity_at=state.activity_at,
                       gpu_memory_fraction=tree.gpu_memory_fraction,
                       queued=job.queued, running_since=job.running_since,
                       log_disk_free_bytes=reading.log_free_bytes if reading else None)
        if progress.observation_error is not None:
            return view, None, job_forecast
        sample = SampleRecord(
            job_id=job.job_id, t=now, items_done=progress.items_done,
            items_total=progress.items_total, files=progress.files,
            bytes_written=progress.bytes_written, cpu_percent=tree.cpu_percent,
            cpu_time_s=tree.cpu_time_s, rss_bytes=tree.rss_bytes, read_bytes=tree.read_bytes,
            write_bytes=tree.write_bytes, num_procs=tree.num_procs,
            num_threads=tree.num_threads, gpu_memory_bytes=tree.gpu_memory_bytes,
            disk_free_bytes=free_bytes)
        return view, sample, job_forecast

    def _backlog(self, job: ObservedJob, state: KeptJobState, readings: Sequence[ShimReading],
                 items_total: int | None, *, counted: bool) -> list[SampleRecord]:
        """Samples of a remote job's readings older than its newest, each at its own
        time, newer than its last sample; they count for its activity and, where the job's
        items are its files (`counted`), for its progress and forecast. Its progress file
        or log was not read then: their `items_done` is None otherwise."""
        after = state.last_sample_t
        newer = [r for r in readings if after is None or r.t > after]
        samples = backlog_samples(job.job_id, newer, items_total=items_total, counted=counted)
        for sample, r in zip(samples, newer, strict=True):
            if sample.items_done is not None:
                state.note_items(sample.items_done, r.t)
                self.remember(state, rates.Observation(r.t, sample.items_done,
                                                           sample.bytes_written))
            state.note_activity(r.tree, sample.bytes_written, r.t)
            state.last_sample_t = r.t
        return samples

    @staticmethod
    def _why_not_fresh(job: ObservedJob, state: KeptJobState,
                       outcome: BaseException | None) -> str:
        what = "output scan" if job.spec.output_dir else "progress reading"
        if outcome is not None:
            return f"{what} failed: {describe_error(outcome)}"
        if state.inflight is not None:
            running_s = time.monotonic() - state.inflight.started
            return f"{what} still running ({running_s:.1f} s so far)"
        return f"{what} not started: {state.start_error or 'unknown'}"

    def stale_view(self, job: ObservedJob, error: str, previous: JobView | None) -> JobView:
        """The job's previous view, saying why it is not fresh (its place in a queue is
        the scheduler's word, fresh)."""
        previous = previous or JobView(
            progress=ProgressRecord(items_total=job.spec.expected_items))
        return replace(previous.failing(error), queued=job.queued,
                       running_since=job.running_since)

    @staticmethod
    def log_error(job_id: str, state: KeptJobState, message: str,
                   error: BaseException | None) -> None:
        """Log an observation error once while it lasts (not every tick); a reading
        still running is no error to log."""
        if error is None or message == state.logged_error:
            return
        state.logged_error = message
        log.warning("job %s: %s", job_id, message,
                    exc_info=(type(error), error, error.__traceback__))

    @staticmethod
    def remember(state: KeptJobState, observation: rates.Observation) -> None:
        last = state.last_kept
        if last is not None:
            unchanged = (last.items_done == observation.items_done
                         and last.bytes_written == observation.bytes_written)
            if unchanged and observation.t - last.t < HISTORY_KEEP_S:
                return
        state.last_kept = observation
        state.forecaster.add(observation)


def gpu_shares(devices: Sequence[TreeGpuMemory] | None) -> tuple[GpuShare, ...] | None:
    if devices is None:
        return None
    return tuple(GpuShare(index=d.device.index, name=d.device.name, uuid=d.device.uuid,
                          memory_bytes=d.memory_bytes, device_used_bytes=d.device.used_bytes,
                          device_total_bytes=d.device.total_bytes) for d in devices)
