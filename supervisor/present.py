"""Rows and live views -> the API's response models (the contract's shapes, ISO times)."""

from __future__ import annotations

from collections.abc import Sequence

from supervisor.models import Alert, Job, Sample
from supervisor.observe import JobView
from supervisor.spec import AlertOut, ExitReason, JobOut, JobSpec, JobState, Progress, SampleOut
from supervisor.timefmt import iso


def alert_out(alert: Alert) -> AlertOut:
    return AlertOut(id=alert.id, job_id=alert.job_id, rule=alert.rule, severity=alert.severity,
                    state=alert.state, started_at=iso(alert.started_at) or "",
                    resolved_at=iso(alert.resolved_at), message=alert.message)


def job_out(job: Job, view: JobView | None, *, alerts: Sequence[Alert] = (),
            warnings: list[str] | None = None) -> JobOut:
    """A job row, its latest view (or its stored progress) and its firing alerts."""
    if view is None:
        progress = (Progress.model_validate_json(job.progress_json) if job.progress_json
                    else Progress(items_total=JobSpec.model_validate_json(
                        job.spec_json).expected_items))
        view = JobView(progress=progress)
    return JobOut(
        id=job.id, name=job.name, spec=JobSpec.model_validate_json(job.spec_json),
        state=JobState(job.state), pid=job.pid, exit_code=job.exit_code, signal=job.signal,
        exit_reason=ExitReason(job.exit_reason) if job.exit_reason else None,
        reason=job.reason, restarts=job.restarts, attempt=job.attempt,
        created_at=iso(job.created_at) or "", started_at=iso(job.started_at),
        ended_at=iso(job.ended_at), progress=view.progress, forecast=view.forecast,
        resources=view.resources, alerts=[alert_out(a) for a in alerts],
        warnings=warnings or [],
    )


def sample_out(row: Sample) -> SampleOut:
    return SampleOut(
        t=iso(row.t) or "", items_done=row.items_done, files=row.files,
        bytes_written=row.bytes_written, cpu_percent=row.cpu_percent, rss_bytes=row.rss_bytes,
        gpu_memory_bytes=row.gpu_memory_bytes, disk_free_bytes=row.disk_free_bytes,
        items_total=row.items_total, read_bytes=row.read_bytes, write_bytes=row.write_bytes,
        num_procs=row.num_procs, cpu_time_s=row.cpu_time_s)
