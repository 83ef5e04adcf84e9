"""What every backend does to launch an attempt: the job's environment (without the
daemon's secrets), the attempt's `launch.json` for its shim, the PYTHONPATH the shim
imports `supervisor` from, and the check, at submit, that a spec can run at all.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from supervisor.errors import InvalidSpec
from supervisor.runtime import files
from supervisor.runtime.fileio import atomic_write_json
from supervisor.spec import JobSpec

SCRUBBED_ENV = frozenset({"JOBSUP_TOKEN", "JOBSUP_SLACK_WEBHOOK_URL", "JOBSUP_WEBHOOK_URL",
                          "JOBSUP_DATABASE_URL", "JOBSUP_WEBHOOK_SECRET", "PGPASSWORD",
                          "PGPASSFILE"})
"""Daemon settings a job must not inherit (secrets), upper-case: see `scrubbed_env`."""


def scrubbed_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without `SCRUBBED_ENV`, matched whatever the case: settings are read
    case-insensitively, so `jobsup_token=X jobsup serve` turns the token on too."""
    return {k: v for k, v in environ.items() if k.upper() not in SCRUBBED_ENV}



def job_environment(base: Mapping[str, str], spec: JobSpec, job_id: str, number: int,
                    progress_file: Path) -> dict[str, str]:
    env = scrubbed_env(base)
    env.update(spec.env)
    env["JOBSUP_JOB_ID"] = job_id
    env["JOBSUP_ATTEMPT"] = str(number)
    env["JOBSUP_PROGRESS_FILE"] = str(progress_file)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def observe_request(spec: JobSpec, interval_s: float) -> files.Observe:
    """`launch.json`'s `observe` for a job whose shim publishes its readings."""
    return files.Observe(interval_s=interval_s, output_dir=spec.output_dir,
                         pattern=spec.pattern, gpu=True)


def write_launch(jobs_dir: Path, job_id: str, number: int, spec: JobSpec, *, cwd: str,
                 stop_grace_s: float, argv: list[str] | None = None,
                 inherit_env: Sequence[str] = (),
                 observe: files.Observe | None = None) -> Path:
    """Create the attempt's directory and its `launch.json` (what the shim runs: `argv`,
    default the spec's command; `inherit_env`, prefixes of variables the worker takes
    from the shim's own environment, such as the allocation's `SLURM_`; `observe`, the
    shim publishes its readings); the directory."""
    adir = files.attempt_dir(jobs_dir, job_id, number)
    adir.mkdir(parents=True, exist_ok=True)
    env = job_environment(os.environ, spec, job_id, number, files.progress_path(jobs_dir, job_id))
    launch = files.Launch(
        job_id=job_id, attempt=number, argv=argv or spec.command, cwd=cwd, env=env,
        log_path=str(adir / files.OUTPUT_LOG), stop_grace_s=stop_grace_s,
    )
    if inherit_env:
        launch["inherit_env"] = list(inherit_env)
    if observe is not None:
        launch["observe"] = observe
    atomic_write_json(adir / files.LAUNCH, launch)
    return adir


def package_root_on_path() -> str:
    """PYTHONPATH that lets the shim import `supervisor` even from a source checkout."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding supervisor/
    existing = os.environ.get("PYTHONPATH")
    return f"{root}{os.pathsep}{existing}" if existing else root


def check_runnable(spec: JobSpec, *, default_cwd: str) -> JobSpec:
    """The spec with an absolute cwd, or InvalidSpec naming what cannot run: a cwd that
    does not exist, a program not found on PATH or not executable."""
    cwd = Path(spec.cwd or default_cwd)
    if not cwd.is_absolute():
        cwd = Path(default_cwd) / cwd
    try:
        is_dir = cwd.is_dir()
    except OSError as exc:  # a name too long, a loop of links
        raise InvalidSpec(f"cwd: {exc.strerror}", field="cwd") from None
    if not is_dir:
        raise InvalidSpec(f"cwd: directory {str(cwd)!r} does not exist", field="cwd")
    program = spec.command[0]
    if "/" in program:
        path = Path(program) if Path(program).is_absolute() else cwd / program
        if not path.is_file():
            raise InvalidSpec(f"command: executable {program!r} not found (looked at {path})",
                              field="command")
        if not os.access(path, os.X_OK):
            raise InvalidSpec(f"command: {program!r} is not executable",
                              hint=f"chmod +x {path}", field="command")
    else:
        search_path = spec.env.get("PATH", os.environ.get("PATH", os.defpath))
        if shutil.which(program, path=search_path) is None:
            raise InvalidSpec(f"command: executable {program!r} not found on PATH",
                              hint="give an absolute path or set PATH in the job's env",
                              field="command")
    return spec.model_copy(update={"cwd": str(cwd.resolve())})
