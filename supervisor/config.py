"""Settings, read once from `JOBSUP_*` environment variables and CLI flags.

Defaults work with no configuration: a daemon on 127.0.0.1:8765 keeping its state in
`~/.local/share/jobsup`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "jobsup"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="JOBSUP_", extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir)
    """Where the database, the lock and every job's logs and exit files live."""

    host: str = "127.0.0.1"
    port: int = 8765

    database_url: str | None = None
    """Any SQLAlchemy URL; default `sqlite:///<data_dir>/jobsup.db`."""

    token: str | None = None
    """Bearer token required on every route but /healthz when set."""

    sample_interval: float = Field(default=2.0, gt=0)
    """Seconds between two ticks of the engine (sampling, forecasts, alerts)."""

    restart_backoff_s: float = Field(default=1.0, ge=0)
    """First delay before an `on-failure` restart; doubles with every restart."""

    restart_backoff_max_s: float = Field(default=300.0, ge=0)
    """Cap of the restart delay."""

    stop_grace_s: float = Field(default=10.0, gt=0)
    """Default seconds between SIGTERM and SIGKILL on stop (a job spec may override)."""

    url: str = "http://127.0.0.1:8765"
    """Where client commands find the daemon."""

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.data_dir / 'jobsup.db'}"

    @property
    def jobs_dir(self) -> Path:
        """Per-job run directories: logs, exit files, progress files."""
        return self.data_dir / "jobs"
