"""Turn the sampler's readings into what users see: progress from the best source,
stored samples, forecasts with the disk runway of each filesystem, and the per-job view
the API renders. Keeps per-job state across ticks (scanners, histories, CPU marks)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from supervisor import forecast as fc
from supervisor import progress as reports
from supervisor.launcher import log_path, progress_path
from supervisor.models import Sample
from supervisor.sampler import Sampler, TreeGpuMemory, TreeReading, TreeTarget
from supervisor.scanner import OutputScanner
from supervisor.spec import Forecast, GpuDeviceUse, JobSpec, Progress, Resources
from supervisor.timefmt import iso

log = logging.getLogger(__name__)


HISTORY_KEEP_S = 60.0
"""A reading with no new item or byte is kept in the history at most this often (it
still marks time passing); readings with news are always kept."""

HISTORY_MAX_POINTS = 20_000
"""Above this many points the older half of a history is thinned by two."""


@dataclass(frozen=True)
class ObservedJob:
    """What the observer needs of a running job."""

    job_id: str
    spec: JobSpec
    attempt: int
    root_pid: int
    root_create_time: float | None
    worker_pid: int | None
    started_at: float | None = None


@dataclass(frozen=True)
class JobView:
    """A job's latest progress, forecast and resources, as the API shows them."""

    progress: Progress
    forecast: Forecast = field(default_factory=Forecast)
    resources: Resources = field(default_factory=Resources)
    cpu_time_s: float = 0.0
    read_bytes: int = 0
    disk_device: int | None = None
    first_item_at: float | None = None
    """When this attempt produced its first new item (None while warming up)."""
    activity_at: float | None = None
    """Last time CPU time, read bytes, bytes written or GPU memory moved."""
    gpu_memory_fraction: float | None = None


ACTIVITY_CPU_S = 0.05
"""CPU seconds a tree must use between two readings to count as active (a sleeping
Python process still wakes up now and then)."""


@dataclass
class _JobState:
    scanner: OutputScanner | None
    history: list[fc.Observation] = field(default_factory=list)
    last_items: int | None = None
    last_progress_at: float | None = None
    baseline_items: int | None = None
    first_item_at: float | None = None
    activity_at: float | None = None
    activity_mark: tuple[float, int, int, int | None] | None = None
    """(cpu_time_s, read_bytes, bytes_written, gpu_memory_bytes) at the last reading."""

    def note_items(self, items_done: int | None, now: float) -> None:
        if items_done is None:
            return
        if self.baseline_items is None:
            self.baseline_items = items_done  # what a resumed job starts from
        elif self.first_item_at is None and items_done > self.baseline_items:
            self.first_item_at = now
        if items_done != self.last_items:
            if self.last_items is not None:
                self.last_progress_at = now
            self.last_items = items_done

    def note_activity(self, tree: TreeReading, bytes_written: int, now: float) -> None:
        mark = (tree.cpu_time_s, tree.read_bytes, bytes_written, tree.gpu_memory_bytes)
        previous = self.activity_mark
        self.activity_mark = mark
        if previous is None:
            return
        if (mark[0] - previous[0] >= ACTIVITY_CPU_S or mark[1] != previous[1]
                or mark[2] != previous[2] or mark[3] != previous[3]):
            self.activity_at = now


def disk_free(path: str | None) -> tuple[int | None, int | None]:
    """(free bytes for unprivileged writers, device id) of the filesystem holding `path`
    or its nearest existing parent; (None, None) when nothing can be read."""
    if not path:
        return None, None
    current = Path(path)
    while True:
        try:
            st = os.statvfs(current)
            return st.f_bavail * st.f_frsize, os.stat(current).st_dev
        except OSError:
            if current.parent == current:
                return None, None
            current = current.parent


class Observer:
    def __init__(self, jobs_dir: Path, sampler: Sampler | None = None):
        self.jobs_dir = jobs_dir
        self.sampler = sampler or Sampler()
        self._state: dict[str, _JobState] = {}
        self.views: dict[str, JobView] = {}
        """Latest view per job id; replaced whole each tick, so readers need no lock."""

    def observe(self, jobs: Sequence[ObservedJob], now: float) -> list[Sample]:
        """Sample every running job once; returns the rows to store."""
        readings = self.sampler.sample(
            [TreeTarget(j.job_id, j.root_pid, j.root_create_time, j.worker_pid) for j in jobs],
            now)
        samples, views = [], dict(self.views)
        demands: dict[int, list[tuple[str, fc.JobDiskDemand, int]]] = {}
        forecasts: dict[str, fc.Forecast] = {}
        for job in jobs:
            view, sample, job_forecast = self._observe_one(job, readings[job.job_id], now)
            samples.append(sample)
            views[job.job_id] = view
            forecasts[job.job_id] = job_forecast
            if view.disk_device is not None and sample.disk_free_bytes is not None:
                demand = fc.disk_demand(job.job_id, job_forecast,
                                        bytes_written=sample.bytes_written)
                demands.setdefault(view.disk_device, []).append(
                    (job.job_id, demand, sample.disk_free_bytes))
        for group in demands.values():
            runway = fc.disk_runway([d for _, d, _ in group], free_bytes=group[0][2])
            for job_id, _, _ in group:
                shared = fc.with_runway(forecasts[job_id], runway, job_id)
                views[job_id] = _with_forecast(views[job_id], shared)
        self.views = views
        return samples

    def forget(self, job_id: str) -> None:
        """The job ended: drop its per-tick state; its view keeps the final progress but
        no forecast (an ended job writes nothing more) and no live resources."""
        self._state.pop(job_id, None)
        self.sampler.forget([job_id])
        view = self.views.get(job_id)
        if view is not None:
            views = dict(self.views)
            views[job_id] = JobView(progress=view.progress, disk_device=view.disk_device)
            self.views = views

    def last_progress_at(self, job_id: str) -> float | None:
        state = self._state.get(job_id)
        return state.last_progress_at if state else None

    def seed(self, job_id: str, progress: Progress) -> None:
        """A view for a job seen before a daemon restart (its stored progress)."""
        self.views.setdefault(job_id, JobView(progress=progress))

    def _observe_one(self, job: ObservedJob, tree: TreeReading,
                     now: float) -> tuple[JobView, Sample, fc.Forecast]:
        spec = job.spec
        state = self._state.get(job.job_id)
        if state is None:
            scanner = OutputScanner(spec.output_dir, spec.pattern) if spec.output_dir else None
            state = self._state[job.job_id] = _JobState(scanner, activity_at=job.started_at)
        files = bytes_written = 0
        if state.scanner is not None:
            scan = state.scanner.scan(now)
            files, bytes_written = scan.files, scan.bytes
        free_bytes, device = disk_free(spec.output_dir or spec.cwd)

        reported = reports.from_progress_file(progress_path(self.jobs_dir, job.job_id))
        source: str | None = "progress_file"
        if reported is None:
            reported = reports.from_log(log_path(self.jobs_dir, job.job_id, job.attempt))
            source = "log"
        if reported is not None:
            items_done: int | None = reported.items_done
            items_total = reported.items_total or spec.expected_items
            metrics = reported.metrics
        elif state.scanner is not None:
            items_done, items_total, metrics, source = files, spec.expected_items, {}, "files"
        else:
            items_done, items_total, metrics, source = None, spec.expected_items, {}, None

        state.note_items(items_done, now)
        state.note_activity(tree, bytes_written, now)
        self._remember(state, fc.Observation(now, items_done, bytes_written))
        job_forecast = fc.forecast_job(
            state.history, items_total=items_total, now=now, disk_free_bytes=free_bytes,
            declared_bytes_per_item=spec.bytes_per_item)

        progress = Progress(
            items_done=items_done, items_total=items_total, files=files,
            bytes_written=bytes_written, source=source,
            last_progress_at=iso(state.last_progress_at), metrics=metrics)
        resources = Resources(
            status=tree.status, num_procs=tree.num_procs, num_threads=tree.num_threads,
            cpu_percent=round(tree.cpu_percent, 1), rss_bytes=tree.rss_bytes,
            read_bytes=tree.read_bytes, gpu_memory_bytes=tree.gpu_memory_bytes,
            gpu_devices=gpu_device_uses(tree.gpu_devices))
        view = _with_forecast(
            JobView(progress=progress, resources=resources, cpu_time_s=tree.cpu_time_s,
                    read_bytes=tree.read_bytes, disk_device=device,
                    first_item_at=state.first_item_at, activity_at=state.activity_at,
                    gpu_memory_fraction=tree.gpu_memory_fraction),
            job_forecast)
        sample = Sample(
            job_id=job.job_id, t=now, items_done=items_done, items_total=items_total,
            files=files, bytes_written=bytes_written, cpu_percent=tree.cpu_percent,
            cpu_time_s=tree.cpu_time_s, rss_bytes=tree.rss_bytes, read_bytes=tree.read_bytes,
            write_bytes=tree.write_bytes, num_procs=tree.num_procs,
            num_threads=tree.num_threads, gpu_memory_bytes=tree.gpu_memory_bytes,
            disk_free_bytes=free_bytes)
        return view, sample, job_forecast

    @staticmethod
    def _remember(state: _JobState, observation: fc.Observation) -> None:
        history = state.history
        if history:
            last = history[-1]
            unchanged = (last.items_done == observation.items_done
                         and last.bytes_written == observation.bytes_written)
            if unchanged and observation.t - last.t < HISTORY_KEEP_S:
                return
        history.append(observation)
        if len(history) > HISTORY_MAX_POINTS:
            half = len(history) // 2
            history[:half] = history[:half:2]

    def load_history(self, job: ObservedJob, rows: Sequence[Sample]) -> None:
        """Continue a running job's forecast after a daemon restart from stored samples."""
        spec = job.spec
        state = self._state.setdefault(job.job_id, _JobState(
            OutputScanner(spec.output_dir, spec.pattern) if spec.output_dir else None,
            activity_at=job.started_at))
        for row in rows:
            self._remember(state, fc.Observation(row.t, row.items_done, row.bytes_written))
            state.note_items(row.items_done, row.t)
        if rows:  # the daemon was down: count its restart as activity, not as a stall
            state.activity_at = max(state.activity_at or 0.0, rows[-1].t)


def _with_forecast(view: JobView, f: fc.Forecast) -> JobView:
    shown = Forecast(
        rate_items_per_s=f.rate_items_per_s, eta_s=f.eta_s, eta_at=iso(f.eta_at),
        bytes_per_item=f.bytes_per_item, projected_total_bytes=f.projected_total_bytes,
        disk_free_bytes=f.disk_free_bytes, disk_full_in_s=f.disk_full_in_s,
        will_fit=f.will_fit)
    return replace(view, forecast=shown)


def gpu_device_uses(
        devices: Sequence[TreeGpuMemory] | None) -> list[GpuDeviceUse] | None:
    if devices is None:
        return None
    return [GpuDeviceUse(index=d.device.index, name=d.device.name, uuid=d.device.uuid,
                         memory_bytes=d.memory_bytes, device_used_bytes=d.device.used_bytes,
                         device_total_bytes=d.device.total_bytes) for d in devices]


def progress_json(view: JobView) -> str:
    return view.progress.model_dump_json()


def preflight_warnings(spec: JobSpec, views: Mapping[str, JobView],
                       learned_bytes_per_item: float | None) -> list[str]:
    """Warnings for a submit: the job's projected output (expected items x declared or
    learned bytes per item) plus what running jobs on the same filesystem still have to
    write, against the free bytes there."""
    bytes_per_item = spec.bytes_per_item or learned_bytes_per_item
    free_bytes, device = disk_free(spec.output_dir or spec.cwd)
    others = 0
    for view in views.values():
        f = view.forecast
        if view.disk_device == device and f.projected_total_bytes is not None:
            others += max(f.projected_total_bytes - view.progress.bytes_written, 0)
    warning = fc.preflight(expected_items=spec.expected_items, bytes_per_item=bytes_per_item,
                           free_bytes=free_bytes, other_remaining_bytes=others)
    return [warning] if warning else []


