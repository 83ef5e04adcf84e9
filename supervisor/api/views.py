"""Rows and the observer's records -> the API's response models (`models.py`: the
contract's shapes, ISO times). The one place where records become response models: the
routes, the status page, and the job snapshot of the alerts' messages (which the daemon
hands to `alerting/`, docs/api.md: a message's `job` is the job as `GET /jobs/{id}` shows
it) all take theirs from here. The answer of `/healthz` (`HealthOut`) is built in its
route: it tells of the engine's tick times, which no record holds."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from supervisor.api.models import (
    AlertOut,
    EventOut,
    Forecast,
    GpuDeviceUse,
    JobOut,
    Progress,
    Resources,
    SampleOut,
)
from supervisor.formatting import iso
from supervisor.observe.forecast import JobForecast
from supervisor.observe.view import (
    JobView,
    ProgressRecord,
    ResourceRecord,
    stored_progress,
)
from supervisor.spec import ExitReason, JobState, stored_spec
from supervisor.storage.tables import Alert, Job, JobEvent, Sample

log = logging.getLogger(__name__)


def alert_out(alert: Alert) -> AlertOut:
    return AlertOut(id=alert.id, job_id=alert.job_id, rule=alert.rule, severity=alert.severity,
                    state=alert.state, started_at=iso(alert.started_at) or "",
                    resolved_at=iso(alert.resolved_at), message=alert.message)


def shown_states(views: Mapping[str, JobView]) -> dict[str, JobState]:
    """The state shown for each job whose end the database has not taken yet, by id."""
    return {job_id: JobState(view.unrecorded_end.state) for job_id, view in views.items()
            if view.unrecorded_end is not None}


def job_out(job: Job, view: JobView | None, *, alerts: Sequence[Alert] = (),
            warnings: list[str] | None = None) -> JobOut:
    """A job row, its latest view (or its stored progress) and its firing alerts. A
    running job whose view holds an end the database could not take yet is shown
    ended, its reason saying so."""
    spec = stored_spec(job.spec_json)
    if view is None:
        progress = stored_progress(job.progress_json)
        view = JobView(progress=progress or ProgressRecord(items_total=spec.expected_items))
    end = view.unrecorded_end
    reason: str | None
    if end is not None and JobState(job.state) is JobState.RUNNING:  # not recorded yet
        state, exit_code, signal, exit_reason, ended_at = (
            end.state, end.exit_code, end.signal, end.exit_reason, end.ended_at)
        reason = (f"{end.reason + '; ' if end.reason else ''}not recorded yet: the "
                  "database cannot be written")
    else:
        state, exit_code, signal, exit_reason, ended_at = (
            job.state, job.exit_code, job.signal, job.exit_reason, job.ended_at)
        reason = job.reason
    return JobOut(
        id=job.id, name=job.name, spec=spec,
        state=JobState(state), pid=job.pid, exit_code=exit_code, signal=signal,
        exit_reason=ExitReason(exit_reason) if exit_reason else None,
        reason=reason, restarts=job.restarts, attempt=job.attempt,
        created_at=iso(job.created_at) or "", started_at=iso(job.started_at),
        ended_at=iso(ended_at), progress=progress_model(view.progress),
        forecast=forecast_model(view.forecast), resources=resources_model(view.resources),
        alerts=[alert_out(a) for a in alerts],
        warnings=warnings or [],
    )


def job_document(job: Job, view: JobView | None) -> dict[str, Any]:
    """A job as `GET /jobs/{id}` shows it, in JSON (without its alerts): what the alerts'
    messages say of it (`alerting.recorder.AlertRecorder.job_document`)."""
    return job_out(job, view).model_dump(mode="json")


def progress_model(p: ProgressRecord) -> Progress:
    return Progress(
        items_done=p.items_done, items_total=p.items_total, files=p.files,
        bytes_written=p.bytes_written, source=p.source,
        last_progress_at=iso(p.last_progress_at), metrics=dict(p.metrics),
        observed_at=iso(p.observed_at), observation_error=p.observation_error)


def forecast_model(f: JobForecast) -> Forecast:
    return Forecast(
        rate_items_per_s=f.rate_items_per_s, eta_s=f.eta_s, eta_at=iso(f.eta_at),
        bytes_per_item=f.bytes_per_item, projected_total_bytes=f.projected_total_bytes,
        disk_free_bytes=f.disk_free_bytes, disk_full_in_s=f.disk_full_in_s,
        will_fit=f.will_fit)


def resources_model(r: ResourceRecord) -> Resources:
    devices = None if r.gpu_devices is None else [
        GpuDeviceUse(index=d.index, name=d.name, uuid=d.uuid, memory_bytes=d.memory_bytes,
                     device_used_bytes=d.device_used_bytes,
                     device_total_bytes=d.device_total_bytes) for d in r.gpu_devices]
    return Resources(status=r.status, num_procs=r.num_procs, num_threads=r.num_threads,
                     cpu_percent=r.cpu_percent, rss_bytes=r.rss_bytes, read_bytes=r.read_bytes,
                     gpu_memory_bytes=r.gpu_memory_bytes, gpu_devices=devices, node=r.node,
                     scheduler_job_id=r.scheduler_job_id)


def sample_out(row: Sample) -> SampleOut:
    return SampleOut(
        t=iso(row.t) or "", items_done=row.items_done, files=row.files,
        bytes_written=row.bytes_written, cpu_percent=row.cpu_percent, rss_bytes=row.rss_bytes,
        gpu_memory_bytes=row.gpu_memory_bytes, disk_free_bytes=row.disk_free_bytes,
        items_total=row.items_total, read_bytes=row.read_bytes, write_bytes=row.write_bytes,
        num_procs=row.num_procs, cpu_time_s=row.cpu_time_s)


def event_out(event: JobEvent) -> EventOut:
    return EventOut(t=iso(event.t) or "",
                    from_state=JobState(event.from_state) if event.from_state else None,
                    to_state=JobState(event.to_state), reason=event.reason)
