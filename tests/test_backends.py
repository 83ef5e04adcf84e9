"""Backends by name (`supervisor/backends/registry.py`): a new backend is one module and
one line in the registry, and the settings (`JOBSUP_BACKEND`), the spec, the API, the
engine and the CLI take its name from there. The backend made up here, `elsewhere`, is
the local one under another name that marks each attempt it starts; a `sitecustomize`
module on the PYTHONPATH of the daemon and of the CLI adds its line to the registry."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from supervisor.config import Settings
from supervisor.runtime.files import attempt_dir
from supervisor.spec import JobSpec
from tests.helpers import PY, REPO, Daemon, python_job

ELSEWHERE_MODULE = '''\
"""A backend of the test's own: the local one, marking each attempt it starts."""

from supervisor.backends.local import LocalBackend


class ElsewhereBackend(LocalBackend):
    def start(self, job_id, number, spec, *, cwd, stop_grace_s):
        attempt = super().start(job_id, number, spec, cwd=cwd, stop_grace_s=stop_grace_s)
        (attempt.dir / "started-elsewhere").write_text(spec.name)
        return attempt
'''

REGISTRY_LINE = '''\
from supervisor.backends import registry

registry.BACKENDS["elsewhere"] = "elsewhere_backend:ElsewhereBackend"
'''


@pytest.fixture
def registered(tmp_path: Path) -> dict[str, str]:
    """The environment of a process whose registry has `elsewhere`."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "elsewhere_backend.py").write_text(ELSEWHERE_MODULE)
    (site / "sitecustomize.py").write_text(REGISTRY_LINE)
    return {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "supervisor", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def test_a_registered_backend_is_taken_by_the_settings_spec_api_engine_and_cli(
        make_daemon: Callable[..., Daemon], registered: dict[str, str]) -> None:
    # the settings: a daemon whose default backend is the registered one starts
    daemon = make_daemon({**registered, "JOBSUP_BACKEND": "elsewhere"})
    by_default = daemon.submit(python_job("pass"), name="by-default")
    assert by_default["spec"]["backend"] == "elsewhere"  # the default, stored resolved
    # the CLI and the spec: named with --backend, checked by the CLI, then by the API
    submitted = cli("submit", "--name", "named", "--backend", "elsewhere", "--url",
                    daemon.url, "--", PY, "-c", "pass", env=registered)
    assert submitted.returncode == 0, submitted.stderr
    named = daemon.job(submitted.stdout.strip())
    assert named["spec"]["backend"] == "elsewhere"
    # the engine: each ran through the registered class, made from the registry's line
    jobs_dir = daemon.data_dir / "jobs"
    for job in (by_default, named):
        assert daemon.wait_state(job["id"], "succeeded", "failed", "lost")["state"] == \
            "succeeded"
        assert (attempt_dir(jobs_dir, job["id"], 1) / "started-elsewhere").read_text() == \
            job["name"]


def test_a_backend_the_registry_lacks_is_refused_everywhere() -> None:
    """Here, where `elsewhere` is not registered, the same name is refused by each reader
    of the registry, naming the backends there are."""
    with pytest.raises(ValidationError, match="'elsewhere' is not a backend: use one of "
                                              "local, slurm"):
        JobSpec.model_validate({"name": "x", "command": [PY], "backend": "elsewhere"})
    with pytest.raises(ValidationError, match="'elsewhere' is not a backend"):
        Settings(backend="elsewhere")
    refused = cli("submit", "--name", "x", "--backend", "elsewhere", "--", PY)
    assert refused.returncode == 2
    assert "--backend: 'elsewhere' is not one of local, slurm" in refused.stderr
