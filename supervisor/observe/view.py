"""What the daemon knows of a job between ticks, as plain typed records with float times
(seconds since the epoch): the observer writes them, the engine, the alert rules and the
metrics read them, and only the API turns them into response models
(`supervisor/api/views.py`). A job's progress is also stored with its row
(`StoredProgress`, `progress_json`), so that an ended job, or a job seen before a daemon
restart, still shows its last figures.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pydantic import BaseModel, Field, ValidationError

from supervisor.formatting import from_iso, iso
from supervisor.observe import forecast
from supervisor.spec import JobSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobEnd:
    """A job's end as the engine decided it (state, why, exit status, when), while the
    database cannot take it: shown by the API and alerted on from memory at once, and
    recorded when writes go through again (the tick decides it anew each tick from the
    shim's status file until then). Field names and values as the job's row holds them."""

    state: str
    reason: str | None
    exit_code: int | None
    signal: int | None
    exit_reason: str | None
    ended_at: float | None


# built per job per tick, not changed once shown: not frozen (4x the cost to build: #15)
@dataclass(slots=True)
class ProgressRecord:
    """A job's progress from its best source. Field names follow the API's `progress`."""

    items_done: int | None = None
    items_total: int | None = None
    files: int = 0
    bytes_written: int = 0
    source: str | None = None
    """"progress_file", "log", "files", or None when nothing reports."""
    last_progress_at: float | None = None
    """When the item count last changed."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    observed_at: float | None = None
    """When these figures were read; None before the first reading."""
    observation_error: str | None = None
    """Why these figures are not fresh (they are the last known ones); None if fresh."""


@dataclass(frozen=True)
class GpuShare:
    """A job's share of one GPU. `index` is NVML's, which may differ from CUDA's order."""

    index: int
    name: str | None
    uuid: str | None
    memory_bytes: int
    """The job's processes' memory on this device."""
    device_used_bytes: int
    """Memory in use on the device by all processes."""
    device_total_bytes: int


# built per job per tick, not changed once shown: not frozen (4x the cost to build: #15)
@dataclass(slots=True)
class ResourceRecord:
    """A job's process tree at its last reading."""

    status: str | None = None
    num_procs: int = 0
    num_threads: int = 0
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    read_bytes: int = 0
    gpu_memory_bytes: int | None = None
    gpu_devices: tuple[GpuShare, ...] | None = None
    """Per GPU the job uses; () when it uses none, None when NVML is unavailable."""
    node: str | None = None
    """The host whose shim took these readings (a remote job); None when the daemon
    reads the job's processes itself."""
    scheduler_job_id: str | None = None
    """The cluster scheduler's id of the attempt (a SLURM job id)."""


NO_FORECAST = forecast.JobForecast(
    rate_items_per_s=None, eta_s=None, eta_at=None, bytes_per_item=None,
    projected_total_bytes=None, disk_free_bytes=None, disk_full_in_s=None, will_fit=None)


# built per job per tick, not changed once shown: not frozen (4x the cost to build: #15)
@dataclass(slots=True)
class JobView:
    """A job's latest progress, forecast and resources."""

    progress: ProgressRecord
    forecast: forecast.JobForecast = field(default_factory=lambda: NO_FORECAST)
    resources: ResourceRecord = field(default_factory=ResourceRecord)
    cpu_time_s: float = 0.0
    read_bytes: int = 0
    disk_device: int | None = None
    first_item_at: float | None = None
    """When this attempt produced its first new item (None while warming up)."""
    activity_at: float | None = None
    """Last time CPU time, read bytes, bytes written or GPU memory moved."""
    gpu_memory_fraction: float | None = None
    queued: bool = False
    """Waiting in a cluster scheduler's queue (a SLURM job PENDING): not running yet."""
    running_since: float | None = None
    """When it left that queue and began running on its node; None while queued, and
    for a job that never waited in one (its start is its launch)."""
    log_disk_free_bytes: int | None = None
    """Free bytes on its log's filesystem, where that is not its output's (`disk_low`
    watches both); None when it is the same one, or unknown."""
    unrecorded_end: JobEnd | None = None
    """Its end, known to the engine but not yet recorded (the database refuses writes):
    shown in its place meanwhile (`Engine.views`)."""

    def failing(self, error: str) -> JobView:
        """This view, its figures kept, saying why they are not fresh."""
        return replace(self, progress=replace(self.progress, observation_error=error))


# -- the stored form: ISO times ---------------------------------------------------------------

class StoredProgress(BaseModel):
    """A job's progress as its row stores it (`jobs.progress_json`): a `ProgressRecord`
    with ISO times. The JSON is the one rows have held since they stored the API's
    `progress` object (the same fields in the same order): rows of any daemon read alike."""

    items_done: int | None = None
    items_total: int | None = None
    files: int = 0
    bytes_written: int = 0
    source: str | None = None
    last_progress_at: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    observed_at: str | None = None
    observation_error: str | None = None


def progress_json(progress: ProgressRecord) -> str:
    """A job's progress as stored with its row."""
    return StoredProgress(
        items_done=progress.items_done, items_total=progress.items_total,
        files=progress.files, bytes_written=progress.bytes_written, source=progress.source,
        last_progress_at=iso(progress.last_progress_at), metrics=dict(progress.metrics),
        observed_at=iso(progress.observed_at), observation_error=progress.observation_error,
    ).model_dump_json()


def stored_progress(text: str | None) -> ProgressRecord | None:
    """A job's stored progress, or None (shown as none yet) if it is absent or no longer
    validates (logged once per distinct text)."""
    if not text:
        return None
    try:
        stored = StoredProgress.model_validate_json(text)
        return ProgressRecord(
            items_done=stored.items_done, items_total=stored.items_total, files=stored.files,
            bytes_written=stored.bytes_written, source=stored.source,
            last_progress_at=from_iso(stored.last_progress_at), metrics=stored.metrics,
            observed_at=from_iso(stored.observed_at),
            observation_error=stored.observation_error)
    except (ValidationError, ValueError) as exc:
        if hash(text) not in _warned_progress:
            if len(_warned_progress) >= WARNED_PROGRESS_MAX:
                _warned_progress.clear()  # bounded: warned about again, past this many
            _warned_progress.add(hash(text))
            log.warning("unreadable stored progress (%s); showing none", exc)
        return None


WARNED_PROGRESS_MAX = 1024
"""Unreadable stored progress texts remembered as warned about (the API reads every job
it lists, each time): past this many, all are forgotten, and warned about again."""
_warned_progress: set[int] = set()


# -- the disk side -----------------------------------------------------------------------------

def disk_free(path: str | None) -> tuple[int | None, int | None]:
    """(free bytes for unprivileged writers, device id) of the filesystem holding `path`
    or its nearest existing parent; (None, None) when nothing can be read."""
    if not path:
        return None, None
    current = os.fspath(path)  # strings, not Path: read for every job every tick
    while True:
        try:
            st = os.statvfs(current)
            return st.f_bavail * st.f_frsize, os.stat(current).st_dev
        except OSError:
            parent = os.path.dirname(current.rstrip("/")) or (
                "/" if current.startswith("/") else ".")
            if parent == current:
                return None, None
            current = parent


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
    warning = forecast.preflight(
        expected_items=spec.expected_items, bytes_per_item=bytes_per_item,
        free_bytes=free_bytes, other_remaining_bytes=others)
    return [warning] if warning else []

