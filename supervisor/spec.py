"""The request contract: the JobSpec (the body of `POST /jobs`), its bounds, and the
enums of a job's states and exit reasons (docs/api.md). The API's response models are
`api/models.py`'s."""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from supervisor.backends import registry
from supervisor.errors import InvalidSpec
from supervisor.runtime.patterns import check_pattern

log = logging.getLogger(__name__)


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

    def can_become(self, to: JobState) -> bool:
        """Whether the lifecycle allows this state to change to `to` (TRANSITIONS)."""
        return to in TRANSITIONS[self]


ENDED_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED, JobState.LOST})

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # started; or ended before it started: stopped, a dependency ended without success,
    # its shim could not be started
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.STOPPED, JobState.FAILED}),
    # its attempt's end (lifecycle.after_exit, vanished), or pending again: a restart,
    # a launch deferred or cut short, a stop by the daemon's own exit
    JobState.RUNNING: frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED,
                                 JobState.LOST, JobState.PENDING}),
    # an ended job changes only when it is restarted
    **{state: frozenset({JobState.PENDING}) for state in ENDED_STATES},
}
"""The job states' edges: `store.transition` refuses any other (as Ray's `put_status`
and supervisord's `_assertInState`)."""


class ExitReason(StrEnum):
    EXIT = "exit"
    SIGNAL = "signal"
    OOM = "oom"
    STOPPED = "stopped"
    LOST = "lost"
    # a cluster scheduler ended the job (the `slurm` backend; docs/scale-out.md)
    TIMEOUT = "timeout"
    """It ran past its time limit (SLURM TIMEOUT, DEADLINE)."""
    CANCELLED = "cancelled"
    """Cancelled outside jobsup (`scancel` by its owner or an administrator)."""
    PREEMPTED = "preempted"
    """The scheduler took its allocation for another job."""
    NODE_FAIL = "node_fail"
    """A node of its allocation failed (SLURM NODE_FAIL, BOOT_FAIL)."""


class AlertState(StrEnum):
    FIRING = "firing"
    RESOLVED = "resolved"


class RestartPolicy(StrEnum):
    NEVER = "never"
    ON_FAILURE = "on-failure"


MAX_INT64 = 2**63 - 1
"""The largest integer SQLite stores (signed 64-bit): the bound of every count a job
spec or a query parameter carries, so nothing it reaches overflows the store."""

MAX_SECONDS = 10 * 365 * 86_400.0
"""Ten years: the longest duration a spec may give (a timeout, a grace). Longer is a
typo, and `Infinity` or `NaN` (which Python's JSON accepts) never reach the store."""

MAX_BYTES_PER_ITEM = 1e18
"""An exabyte: the most a spec may declare per item (times `expected_items`, still a
finite number of bytes to forecast with)."""

PositiveSeconds = Annotated[float, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]

MAX_ACCEPTANCE_LENGTH = 1e6
"""Tokens per target pass of a speculative decoder: 1 + the draft tokens per pass, far
below this; a larger threshold is a typo."""


def check_no_nul(value: Any) -> Any:
    """`value` (a string, or a list or dict of strings) if no string in it holds a NUL
    byte, which no path, argv or environment of a process can carry; ValueError if one
    does."""
    strings = (value if isinstance(value, list)
               else [*value.keys(), *value.values()] if isinstance(value, dict)
               else [value])
    if any(isinstance(s, str) and "\x00" in s for s in strings):
        raise ValueError("must not contain NUL bytes")
    return value


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


BackendName = Annotated[str, AfterValidator(registry.check_name), Field(
    json_schema_extra=lambda schema: schema.update(enum=registry.names()))]
"""Where a job runs, a name in `backends.registry.BACKENDS`: `local`, a shim on the
daemon's machine; `slurm`, a shim inside a SLURM allocation (docs/scale-out.md)."""

SLURM_TIME = re.compile(
    r"(?:\d+|\d+:\d+|\d+:\d+:\d+|\d+-\d+|\d+-\d+:\d+|\d+-\d+:\d+:\d+"
    r"|INFINITE|UNLIMITED)")
"""The time formats `sbatch --time` accepts: minutes, minutes:seconds,
hours:minutes:seconds, days-hours, days-hours:minutes, days-hours:minutes:seconds."""

SLURM_MEMORY = re.compile(r"\d+[KMGT]?")
SLURM_WORD = re.compile(r"[A-Za-z0-9_.:,=+@/-]+")
"""A partition, account, QOS or GRES: no spaces, no shell or option syntax."""

SLURM_OPTIONS_OWNED = ("--output", "--error", "--chdir", "--job-name", "--parsable",
                       "--requeue", "--wrap", "--export", "-o", "-e", "-D", "-J")
"""sbatch options jobsup sets itself: the shim's log, the attempt dir, the job's name
(how a restarted daemon finds it), no requeue (restarts are new attempts), the
environment (the launch file carries it, without the daemon's secrets)."""


class SlurmResources(BaseModel):
    """What a `slurm` job asks the scheduler for (sbatch options)."""

    model_config = ConfigDict(extra="forbid")

    partition: str | None = None
    nodes: int = Field(default=1, ge=1, le=100_000)
    tasks_per_node: int = Field(
        default=1, ge=1, le=4096,
        description="ranks per node; with nodes x tasks_per_node > 1 the job's command "
                    "runs once per rank through srun, with RANK, WORLD_SIZE, LOCAL_RANK, "
                    "MASTER_ADDR, MASTER_PORT set")
    gpus_per_node: int | None = Field(default=None, ge=1, le=1024)
    gres: str | None = None
    cpus_per_task: int | None = Field(default=None, ge=1, le=100_000)
    mem: str | None = Field(default=None, description="per node, e.g. 64G (sbatch --mem)")
    time: str | None = Field(default=None, description="time limit, sbatch's formats: "
                             "minutes, [days-]hours:minutes:seconds, ...")
    account: str | None = None
    qos: str | None = None
    extra: list[str] = Field(default_factory=list, description="more sbatch options, "
                             "each one `--name=value` argument")

    @field_validator("partition", "gres", "account", "qos")
    @classmethod
    def _word(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_WORD.fullmatch(value):
            raise ValueError(f"{value!r} is not a SLURM name (letters, digits, _.:,=+@/-)")
        return value

    @field_validator("mem")
    @classmethod
    def _memory(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_MEMORY.fullmatch(value):
            raise ValueError(f"{value!r} is not a SLURM memory size (e.g. 500M, 64G)")
        return value

    @field_validator("time")
    @classmethod
    def _time(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_TIME.fullmatch(value):
            raise ValueError(f"{value!r} is not a SLURM time limit: use minutes, "
                             "minutes:seconds, hours:minutes:seconds or "
                             "days-hours[:minutes[:seconds]]")
        return value

    @field_validator("extra")
    @classmethod
    def _options(cls, extra: list[str]) -> list[str]:
        check_no_nul(extra)
        for option in extra:
            if not option.startswith("-"):
                raise ValueError(f"{option!r} is not an sbatch option (--name=value)")
            name = option.split("=", 1)[0]
            if name in SLURM_OPTIONS_OWNED:
                raise ValueError(f"{name} is set by jobsup and cannot be given in extra")
        return extra

    @property
    def ranks(self) -> int:
        return self.nodes * self.tasks_per_node


class JobSpec(BaseModel):
    """What to run and how to watch it (the body of `POST /api/v1/jobs`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=128)
    command: list[str] = Field(min_length=1, description="argv; never run through a shell")
    cwd: str | None = Field(default=None, description="default: the daemon's cwd")
    env: dict[str, str] = Field(default_factory=dict)
    output_dir: str | None = None
    pattern: str = "**/*"
    expected_items: int | None = Field(default=None, gt=0, le=MAX_INT64)
    bytes_per_item: float | None = Field(
        default=None, gt=0, le=MAX_BYTES_PER_ITEM, allow_inf_nan=False,
        description="declared bytes per item, for the disk preflight"
    )
    stall_timeout_s: PositiveSeconds = 600.0
    startup_timeout_s: PositiveSeconds | None = None
    stop_grace_s: PositiveSeconds | None = Field(
        default=None, description="SIGTERM -> SIGKILL delay on stop; default from the daemon"
    )
    restart_policy: RestartPolicy = RestartPolicy.NEVER
    max_restarts: int = Field(default=0, ge=0, le=MAX_INT64)
    depends_on: list[str] = Field(default_factory=list)
    stop_when_ended: list[str] = Field(
        default_factory=list,
        description="stop this job once all of these jobs have ended (e.g. a model server "
                    "that only the generation step needs)")
    min_acceptance_length: float | None = Field(
        default=None, gt=0, le=MAX_ACCEPTANCE_LENGTH, allow_inf_nan=False,
        description="the `low_acceptance` alert fires when the job's reported metric "
                    "`acceptance_length` is below this (None: off)")
    labels: dict[str, str] = Field(default_factory=dict)
    backend: BackendName | None = Field(
        default=None, description="where the job runs: a backend's name (`local`, "
                                  "`slurm`); null: the daemon's default (JOBSUP_BACKEND)")
    slurm: SlurmResources | None = Field(
        default=None, description="what a `slurm` job asks the scheduler for")

    @model_validator(mode="after")
    def _slurm_only_for_slurm(self) -> JobSpec:
        if self.slurm is not None and self.backend not in (None, "slurm"):
            raise ValueError(f"slurm: a `{self.backend}` job takes no slurm section (set "
                             "backend to `slurm`, or leave it out for the daemon's default)")
        return self

    def backend_or(self, default: BackendName) -> BackendName:
        """The backend this job runs on: its own, else `slurm` when it has a slurm
        section, else the daemon's `default`."""
        if self.backend is not None:
            return self.backend
        return "slurm" if self.slurm is not None else default

    @field_validator("command")
    @classmethod
    def _command_has_program(cls, command: list[str]) -> list[str]:
        if not command[0].strip():
            raise ValueError("the program (command[0]) must not be empty")
        if any("\x00" in arg for arg in command):
            raise ValueError("arguments must not contain NUL bytes")
        return command

    @field_validator("name", "cwd", "output_dir", "pattern", "depends_on", "stop_when_ended",
                     "labels")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        return check_no_nul(value)

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for key, value in env.items():
            if not key or "=" in key or "\x00" in key or "\x00" in value:
                raise ValueError(f"invalid environment variable name or value: {key!r}")
        return env

    @field_validator("pattern")
    @classmethod
    def _pattern_is_a_glob(cls, pattern: str) -> str:
        check_pattern(pattern)  # empty, NUL, too long, a reversed range: ValueError
        return pattern


_FALLBACKS: dict[str, Any] = {"name": "(invalid)", "command": ["(invalid)"]}
"""What a stored spec whose required field is unreadable gets instead: a job no one can
mistake for a real one, whose command never resolves."""

STORED_SPECS_CACHED = 4096
"""Parsed stored specs kept (`stored_spec`), keyed by their JSON: a job's `spec_json`
never changes, and the tick, the alert rules, /metrics and the API read the spec of
every job they show, each time, several times a tick for a running job (a parse costs
~56 us, a cached one ~0.3 us on the 2-core VM: at 1,000 running jobs the cache saves
about a third of a second a tick; #15, #31)."""


def stored_spec(spec_json: str) -> JobSpec:
    """The JobSpec of a stored job, read leniently: a field the current rules refuse (a
    null or non-finite number that an older daemon stored, a count past SQLite's range,
    a NUL byte, a field this version does not know) takes its default, with a warning
    logged when it is parsed, so one such row never breaks a list, a get, a stop,
    /metrics or the engine's tick. Use it for every `jobs.spec_json`; validate new
    specs strictly (`JobSpec.model_validate`).

    Parsed once per distinct `spec_json` while it is among the `STORED_SPECS_CACHED`
    used last (so its warning is logged once while it stays there): callers share the
    returned object and must not modify it (`model_copy` it first)."""
    return _parsed_spec(spec_json)


@functools.lru_cache(maxsize=STORED_SPECS_CACHED)
def _parsed_spec(spec_json: str) -> JobSpec:
    try:
        return JobSpec.model_validate_json(spec_json)
    except ValidationError as exc:
        errors = exc.errors()
    try:
        data = json.loads(spec_json)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        data, bad = {}, ["(unreadable JSON)"]
    else:
        bad = sorted({str(e["loc"][0]) for e in errors if e["loc"]})
        data = {k: v for k, v in data.items() if k not in bad}
    for field, fallback in _FALLBACKS.items():
        if field not in data:
            data[field] = fallback
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError:  # not expected: every field left was valid on its own
        spec = JobSpec.model_construct(**data)
    log.warning("job %r: stored spec has invalid %s; using the default(s) instead",
                data.get("name"), ", ".join(bad))
    return spec
