"""The API's response models: what `GET /jobs`, `/alerts`, `/samples`, `/events` and
`/healthz` answer, and every error's body (docs/api.md). Built from records in
`views.py`; the request contract and the enums are `spec.py`'s."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from supervisor.spec import ExitReason, JobSpec, JobState


class Progress(BaseModel):
    items_done: int | None = None
    items_total: int | None = None
    files: int = 0
    bytes_written: int = 0
    source: str | None = None
    last_progress_at: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    observed_at: str | None = Field(
        default=None, description="when these figures were read (the output scan and the "
                                  "progress file or log); null before the first reading")
    observation_error: str | None = Field(
        default=None, description="why this reading is not fresh: the job's last reading "
                                  "failed or is still running (the figures are the last "
                                  "known ones, from `observed_at`); null when it is fresh")


class Forecast(BaseModel):
    rate_items_per_s: float | None = None
    eta_s: float | None = None
    eta_at: str | None = None
    bytes_per_item: float | None = None
    projected_total_bytes: int | None = None
    disk_free_bytes: int | None = None
    disk_full_in_s: float | None = None
    will_fit: bool | None = None


class GpuDeviceUse(BaseModel):
    """A job's share of one GPU. `index` is NVML's, which may differ from CUDA's order
    (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER); `uuid` names the device either way."""

    index: int
    name: str | None
    uuid: str | None
    memory_bytes: int = Field(description="the job's processes' memory on this device")
    device_used_bytes: int = Field(description="memory in use on the device by all processes")
    device_total_bytes: int


class Resources(BaseModel):
    status: str | None = None
    num_procs: int = 0
    num_threads: int = 0
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    read_bytes: int = 0
    gpu_memory_bytes: int | None = None
    gpu_devices: list[GpuDeviceUse] | None = Field(
        default=None, description="per GPU the job uses, by NVML index; [] when it uses "
                                  "none, null when NVML is unavailable")
    node: str | None = Field(
        default=None, description="the host whose shim took these readings (a job on "
                                  "another node, or any under JOBSUP_OBSERVE=shim); null "
                                  "when the daemon reads the job's processes itself")
    scheduler_job_id: str | None = Field(
        default=None, description="the cluster scheduler's id of the running attempt (the "
                                  "SLURM job id of a `slurm` job); null for a local job")


class AlertOut(BaseModel):
    id: int
    job_id: str
    rule: str
    severity: str
    state: str
    started_at: str
    resolved_at: str | None
    message: str


class JobOut(BaseModel):
    """A job as the API returns it."""

    id: str
    name: str
    spec: JobSpec
    state: JobState
    pid: int | None
    exit_code: int | None
    signal: int | None
    exit_reason: ExitReason | None
    reason: str | None = Field(description="why the job is in its state, in words")
    restarts: int
    attempt: int = Field(description="launches so far (1 after the first start)")
    created_at: str
    started_at: str | None
    ended_at: str | None
    progress: Progress
    forecast: Forecast
    resources: Resources
    alerts: list[AlertOut]
    warnings: list[str] = Field(default_factory=list)


class SampleOut(BaseModel):
    """One stored reading (`GET /jobs/{id}/samples`)."""

    t: str
    items_done: int | None
    files: int
    bytes_written: int
    cpu_percent: float
    rss_bytes: int
    gpu_memory_bytes: int | None
    disk_free_bytes: int | None
    items_total: int | None
    read_bytes: int
    write_bytes: int
    num_procs: int
    cpu_time_s: float


class EventOut(BaseModel):
    t: str
    from_state: JobState | None
    to_state: JobState
    reason: str | None


class HealthOut(BaseModel):
    """`GET /healthz`: the daemon answers, and whether its engine loop still ticks."""

    status: Literal["ok", "degraded", "stalled"]
    last_tick_age_s: float | None = Field(
        description="seconds since the engine loop last finished a tick (null: no engine)")
    last_tick_duration_s: float | None = Field(
        default=None, description="how long that tick took")
    error: str | None = None
    hint: str | None = None


class ErrorOut(BaseModel):
    """Every error answer: what went wrong, what to do about it, the field at fault."""

    error: str
    hint: str | None = None
    field: str | None = None
    detail: list[dict[str, Any]] | None = None
    """The request validation errors (loc, msg, type), on a 422 from validation."""
