"""Rows and live views -> the API's response models (the contract's shapes, ISO times)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pydantic import ValidationError

from supervisor.formatting import iso
from supervisor.observe.observer import JobView
from supervisor.spec import (
    AlertOut,
    ExitReason,
    JobOut,
    JobState,
    Progress,
    SampleOut,
    stored_spec,
)
from supervisor.storage.tables import Alert, Job, Sample

log = logging.getLogger(__name__)


def alert_out(alert: Alert) -> AlertOut:
    return AlertOut(id=alert.id, job_id=alert.job_id, rule=alert.rule, severity=alert.severity,
                    state=alert.state, started_at=iso(alert.started_at) or "",
                    resolved_at=iso(alert.resolved_at), message=alert.message)


def job_out(job: Job, view: JobView | None, *, alerts: Sequence[Alert] = (),
            warnings: list[str] | None = None) -> JobOut:
    """A job row, its latest view (or its stored progress) and its firing alerts."""
    spec = stored_spec(job.spec_json)
    if view is None:
        progress = stored_progress(job.progress_json) if job.progress_json else None
        view = JobView(progress=progress or Progress(items_total=spec.expected_items))
    return JobOut(
        id=job.id, name=job.name, spec=spec,
        state=JobState(job.state), pid=job.pid, exit_code=job.exit_code, signal=job.signal,
        exit_reason=ExitReason(job.exit_reason) if job.exit_reason else None,
        reason=job.reason, restarts=job.restarts, attempt=job.attempt,
        created_at=iso(job.created_at) or "", started_at=iso(job.started_at),
        ended_at=iso(job.ended_at), progress=view.progress, forecast=view.forecast,
        resources=view.resources, alerts=[alert_out(a) for a in alerts],
        warnings=warnings or [],
    )


def stored_progress(progress_json: str) -> Progress | None:
    """A job's stored progress, or None (shown as none yet) if it no longer validates."""
    try:
        return Progress.model_validate_json(progress_json)
    except ValidationError as exc:
        if hash(progress_json) not in _warned_progress:
            _warned_progress.add(hash(progress_json))
            log.warning("unreadable stored progress (%s); showing none", exc)
        return None


_warned_progress: set[int] = set()


def sample_out(row: Sample) -> SampleOut:
    return SampleOut(
        t=iso(row.t) or "", items_done=row.items_done, files=row.files,
        bytes_written=row.bytes_written, cpu_percent=row.cpu_percent, rss_bytes=row.rss_bytes,
        gpu_memory_bytes=row.gpu_memory_bytes, disk_free_bytes=row.disk_free_bytes,
        items_total=row.items_total, read_bytes=row.read_bytes, write_bytes=row.write_bytes,
        num_procs=row.num_procs, cpu_time_s=row.cpu_time_s)
