"""Settings, read once from `JOBSUP_*` environment variables and CLI flags.

Defaults work with no configuration: a daemon on 127.0.0.1:8765 keeping its state in
`~/.local/share/jobsup`.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from supervisor.backends import registry

MAX_BODY_BYTES = 1 << 20
"""Default cap of a request body (1 MiB): a JobSpec is a few KB."""

BODY_TIMEOUT_S = 10.0
"""Default seconds a request's body has to arrive whole after its head (a JobSpec of a
few KB arrives in milliseconds; 1 MiB, the body cap, in 10 s at 100 KiB/s)."""

CommaSeparated = Annotated[frozenset[str], NoDecode]
"""A set read from `a,b,c` in the environment (not JSON)."""


def default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "jobsup"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="JOBSUP_", extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir)
    """Where the database, the lock and every job's logs and exit files live."""

    host: str = "127.0.0.1"
    port: int = 8765

    database_url: str | None = None
    """The store: `sqlite:///PATH`, or `postgresql://USER:PASSWORD@HOST:PORT/DATABASE`
    (psycopg 3, the `postgresql` extra; the role and database must exist); default
    `sqlite:///<data_dir>/jobsup.db`."""

    rebuild_db: bool = False
    """At start, a damaged SQLite database is moved aside (`jobsup.db.damaged-<time>`)
    and the jobs are rebuilt from `<data_dir>/jobs`; without it, a damaged database
    stops the daemon. A sound database is left alone either way."""

    abandon_jobs_elsewhere: bool = False
    """At start, running jobs launched from another data dir whose files are not in this
    one are recorded lost (left running, unwatched) instead of stopping the daemon
    (`recovery.check_jobs_elsewhere`)."""

    token: str | None = None
    """Bearer token required on every route but /healthz when set."""

    allowed_hosts: CommaSeparated = frozenset()
    """Host names (or addresses) a request's `Host` header may carry besides the loopback
    ones, e.g. `jobs.example.org,10.0.0.7`: the defence against DNS rebinding. A specific
    non-loopback `host` the daemon binds is allowed too (see docs/security.md)."""

    allowed_env: CommaSeparated = frozenset()
    """Environment variable names a JobSpec may set although they change how a program
    loads code (`LD_LIBRARY_PATH`, ...); see `spec.CODE_LOADING_ENV`."""

    max_body_bytes: int = Field(default=MAX_BODY_BYTES, ge=1)
    """Largest request body accepted; a larger one answers 413."""

    body_timeout_s: float = Field(default=BODY_TIMEOUT_S, gt=0)
    """Seconds a request's body has to arrive whole, counted from the end of its head;
    later, the request answers 408 and its connection is closed (`daemon/connections.py`:
    ~1,100 bodies sent a byte at a time held every connection the daemon keeps, #46)."""

    sample_interval: float = Field(default=2.0, gt=0)
    """Seconds between two ticks of the engine (sampling, forecasts, alerts)."""

    observe: Literal["daemon", "shim"] = "daemon"
    """Who reads a local job's processes, GPU memory and output files: the daemon itself
    (`daemon`), or the job's shim, which publishes them to the attempt directory
    (`observed.jsonl`) as it does on a node the daemon cannot read (`shim`: an output
    directory on a filesystem slow to scan from here, or a test of the remote path).
    Jobs of a backend whose shims run elsewhere (SLURM) are always observed by their
    shims."""

    output_watch: Literal["inotify", "list"] = "inotify"
    """How the daemon learns what changed in a job's output directory: `inotify` (the
    kernel names the changed files; a tick's cost follows the changes, not the size of
    the directories) on local filesystems, listing elsewhere (NFS, Lustre, FUSE: writes
    of other machines raise no event); `list`: stat every directory each tick and list
    those that changed, everywhere (docs/architecture.md)."""

    restart_backoff_s: float = Field(default=1.0, ge=0)
    """First delay before an `on-failure` restart; doubles with every restart."""

    restart_backoff_max_s: float = Field(default=300.0, ge=0)
    """Cap of the restart delay."""

    stop_grace_s: float = Field(default=10.0, gt=0)
    """Default seconds between SIGTERM and SIGKILL on stop (a job spec may override)."""

    backend: Annotated[str, AfterValidator(registry.check_name)] = registry.DEFAULT_BACKEND
    """Where a job runs when its spec names no backend (and has no `slurm` section), a
    name in `backends.registry`: `local` (a shim on this machine) or `slurm` (sbatch;
    docs/scale-out.md)."""

    stop_jobs_on_exit: bool = False
    """On SIGTERM/SIGINT the daemon stops every running job as `POST /jobs/{id}/stop`
    does (SIGTERM, the job's grace, SIGKILL) and waits for them before it exits. Off by
    default: a daemon restart re-adopts running jobs. On in a container, where the
    daemon's exit ends the namespace and SIGKILLs whatever still runs there."""

    url: str = "http://127.0.0.1:8765"
    """Where client commands find the daemon."""

    slack_webhook_url: str | None = None
    """Slack incoming webhook that receives alert messages."""

    webhook_url: str | None = None
    """Generic webhook: receives every message as JSON (text, job, alert, log tail)."""

    webhook_secret: SecretStr | None = None
    """Signs every request to the generic webhook (`X-Jobsup-Signature`: HMAC-SHA256 of
    `v1:{timestamp}:{body}`, see docs/security.md); unset, requests are not signed."""

    hostname: str | None = None
    """The machine's name in every message (Slack's header, the webhook's `host`);
    default `socket.gethostname()`."""

    public_url: str | None = None
    """The daemon's URL as a reader of a message reaches it (the job links in Slack and
    webhook messages); default the URL it serves, `http://HOST:PORT` (this machine's
    name for a wildcard bind)."""

    grafana_url: str | None = None
    """The jobsup Grafana dashboard's URL (e.g. `https://grafana.example.org/d/jobsup/jobsup`):
    messages then link to it with `var-job_name` set to the job's name."""

    notify_backoff_max_s: float = Field(default=120.0, gt=0)
    """Longest wait between two delivery attempts of a message (5xx, network errors)."""

    notify_on_success: bool = False
    """Also send a message when a job succeeds (off by default: on, they drowned the
    crashes in an on-call channel)."""

    disk_low_bytes: int = Field(default=5_000_000_000, ge=0)
    """`disk_low` fires below this many free bytes on a running job's output disk."""

    gpu_memory_high_fraction: float = Field(default=0.95, gt=0, le=1)
    """`gpu_memory_high` fires when a GPU the job uses is fuller than this."""

    ended_alert_ttl_s: float = Field(default=86_400.0, gt=0)
    """How long `crashed` / `incomplete` stay firing after the job ended."""

    metrics_public: bool = False
    """Serve /metrics without the token (for a Prometheus that cannot send one)."""

    metrics_ended_retention_s: float = Field(default=3600.0, ge=0)
    """Ended jobs keep their /metrics series this long, then the series disappear."""

    metrics_ended_max: int = Field(default=500, ge=0)
    """At most this many ended jobs keep their /metrics series, the most recently ended
    (within `metrics_ended_retention_s`): a burst of thousands of failures never makes
    a scrape of megabytes (#30). `jobsup_jobs{state}` counts them all."""

    metrics_pending_max: int = Field(default=500, ge=0)
    """At most this many pending jobs keep their /metrics series, the first in line (by
    submission): 10,000 jobs queued behind one dependency made each scrape 5.6 MB (#30).
    `jobsup_jobs{state="pending"}` counts them all."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    """The daemon's log level (`jobsup serve`). httpx's and httpcore's loggers stay at
    WARNING whatever it is: their request lines show the webhook URLs, which are secrets."""

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value

    @field_validator("allowed_hosts", "allowed_env", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return frozenset(item.strip() for item in value.split(",") if item.strip())
        return value

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir / 'jobsup.db'}"

    @property
    def resolved_hostname(self) -> str:
        return self.hostname or socket.gethostname()

    @property
    def resolved_public_url(self) -> str:
        if self.public_url:
            return self.public_url
        host = self.host if self.host not in ("0.0.0.0", "::", "") else self.resolved_hostname
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def jobs_dir(self) -> Path:
        """Per-job run directories: logs, exit files, progress files."""
        return self.data_dir / "jobs"
