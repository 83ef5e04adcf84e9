"""The JobSpec and the API's response models: the one place field names live (API.md)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from supervisor.errors import InvalidSpec


class JobState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    LOST = "lost"

    @property
    def ended(self) -> bool:
        return self in ENDED_STATES


ENDED_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED, JobState.LOST})


class ExitReason(StrEnum):
    EXIT = "exit"
    SIGNAL = "signal"
    OOM = "oom"
    STOPPED = "stopped"
    LOST = "lost"


class AlertState(StrEnum):
    FIRING = "firing"
    RESOLVED = "resolved"


class RestartPolicy(StrEnum):
    NEVER = "never"
    ON_FAILURE = "on-failure"


PositiveSeconds = Annotated[float, Field(gt=0)]

CODE_LOADING_ENV = frozenset({
    # the dynamic loader, which every dynamically linked program trusts: libraries
    # injected into or substituted in the process, and loader tunables
    "LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH", "GCONV_PATH", "GLIBC_TUNABLES",
    # a file every non-interactive bash sources before its script
    "BASH_ENV",
    # interpreters told to run code before the program named in argv
    "PYTHONSTARTUP", "PYTHONHOME", "PERL5OPT", "RUBYOPT", "NODE_OPTIONS",
    "JAVA_TOOL_OPTIONS", "JDK_JAVA_OPTIONS", "_JAVA_OPTIONS",
})
"""Environment variables a JobSpec may not set unless the daemon allows them
(`JOBSUP_ALLOWED_ENV`): each makes a program load or run code that its argv does not
name. Every other `LD_*` variable and exported bash functions (`BASH_FUNC_*`) are refused
too. Library search paths of one language (`PYTHONPATH`, `PERL5LIB`, `NODE_PATH`) are
allowed: ML jobs need them daily. docs/security.md says why each is here."""

CODE_LOADING_ENV_PREFIXES = ("LD_", "BASH_FUNC_")


def refused_env(env: Iterable[str], allowed: Iterable[str] = ()) -> list[str]:
    """The names in `env` that change how programs load or run code and that `allowed`
    does not name, sorted."""
    permitted = set(allowed)
    return sorted(name for name in env if name not in permitted and (
        name in CODE_LOADING_ENV or name.startswith(CODE_LOADING_ENV_PREFIXES)))


def check_env(env: Mapping[str, str], allowed: Iterable[str], *, field: str = "env") -> None:
    """InvalidSpec naming the variables of `env` that `refused_env` refuses, if any."""
    refused = refused_env(env, allowed)
    if refused:
        names = ", ".join(refused)
        raise InvalidSpec(
            f"{field}: {names} may not be set by a job: "
            f"{'it changes' if len(refused) == 1 else 'they change'} how programs load code",
            hint=f"set it in the daemon's own environment, or allow it with "
                 f"JOBSUP_ALLOWED_ENV={','.join(refused)} (docs/security.md)",
            field=field)


class JobSpec(BaseModel):
    """What to run and how to watch it (the body of `POST /api/v1/jobs`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    command: list[str] = Field(min_length=1, description="argv; never run through a shell")
    cwd: str | None = Field(default=None, description="default: the daemon's cwd")
    env: dict[str, str] = Field(default_factory=dict)
    output_dir: str | None = None
    pattern: str = "**/*"
    expected_items: int | None = Field(default=None, gt=0)
    bytes_per_item: float | None = Field(
        default=None, gt=0, description="declared bytes per item, for the disk preflight"
    )
    stall_timeout_s: PositiveSeconds = 600.0
    startup_timeout_s: PositiveSeconds | None = None
    stop_grace_s: PositiveSeconds | None = Field(
        default=None, description="SIGTERM -> SIGKILL delay on stop; default from the daemon"
    )
    restart_policy: RestartPolicy = RestartPolicy.NEVER
    max_restarts: int = Field(default=0, ge=0)
    depends_on: list[str] = Field(default_factory=list)
    stop_when_ended: list[str] = Field(
        default_factory=list,
        description="stop this job once all of these jobs have ended (e.g. a model server "
                    "that only the generation step needs)")
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("command")
    @classmethod
    def _command_has_program(cls, command: list[str]) -> list[str]:
        if not command[0].strip():
            raise ValueError("the program (command[0]) must not be empty")
        if any("\x00" in arg for arg in command):
            raise ValueError("arguments must not contain NUL bytes")
        return command

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for key, value in env.items():
            if not key or "=" in key or "\x00" in key or "\x00" in value:
                raise ValueError(f"invalid environment variable name or value: {key!r}")
        return env


class Progress(BaseModel):
    items_done: int | None = None
    items_total: int | None = None
    files: int = 0
    bytes_written: int = 0
    source: str | None = None
    last_progress_at: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict)


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
