"""`jobsup submit`: a job spec from the command line, checked before the request; the
daemon's errors come back with a hint naming the option behind the field."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any

import typer

from supervisor.backends import registry
from supervisor.client.completion import choices, job_ids
from supervisor.client.jobs_cli import POLICIES, Json, Timeout, check_timeout, finish
from supervisor.client.options import (
    DEFAULT_URL,
    Url,
    check_choice,
    check_output_dir,
    client,
    pairs,
)
from supervisor.client.output import fail, print_json, usage_error, warn
from supervisor.errors import JobsupError

SLURM_KEYS = ("partition", "nodes", "tasks_per_node", "gpus_per_node", "gres",
              "cpus_per_task", "mem", "time", "account", "qos", "extra")
"""The `slurm` section's fields (`extra` may be given several times)."""

SUBMIT_OPTIONS = {
    "name": ("--name", "1 to 128 characters"),
    "command": ("the command after --", "a program and its arguments"),
    "cwd": ("--cwd", "an existing directory"),
    "output_dir": ("--output", "a directory path"),
    "pattern": ("--pattern", "a glob relative to --output, e.g. '**/*.pt'"),
    "expected_items": ("--expect", "a whole number > 0"),
    "stall_timeout_s": ("--stall-timeout", "seconds: a finite number > 0, at most 10 years"),
    "startup_timeout_s": ("--startup-timeout", "seconds: a finite number > 0, at most 10 years"),
    "stop_grace_s": ("--stop-grace", "seconds: a finite number > 0, at most 10 years"),
    "restart_policy": ("--restart", " | ".join(POLICIES)),
    "max_restarts": ("--max-restarts", "a whole number >= 0"),
    "depends_on": ("--depends-on", "ids of jobs this daemon knows (`jobsup ls`)"),
    "env": ("--env", "KEY=VALUE"),
    "labels": ("--label", "KEY=VALUE"),
    "backend": ("--backend", " | ".join(registry.names())),
    "slurm": ("--slurm", "KEY=VALUE, KEY one of " + ", ".join(SLURM_KEYS)),
}
"""The submit option behind each JobSpec field, and what it takes: the hint of an error
that names the field."""


def submit_hint(message: str) -> str | None:
    """A hint naming the options behind the fields an error message starts its parts with
    (`stall_timeout_s: Input should be greater than 0; ...`)."""
    fields = re.findall(r"(?:^|; )(\w+)[.:]", message)
    hints = [f"{option}: {takes}" for option, takes in
             (SUBMIT_OPTIONS[f] for f in dict.fromkeys(fields) if f in SUBMIT_OPTIONS)]
    return "; ".join(hints) or None


def slurm_section(items: list[str]) -> dict[str, Any]:
    """`--slurm KEY=VALUE` options as the spec's `slurm` section (`extra` collects)."""
    section: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in SLURM_KEYS:
            usage_error(f"--slurm: {item!r} is not KEY=VALUE with a known KEY",
                        hint=SUBMIT_OPTIONS["slurm"][1])
        if key == "extra":
            section.setdefault("extra", []).append(value)
        else:
            section[key] = value
    return section


def submit(
    command: Annotated[list[str], typer.Argument(help="The program and its arguments (after --).",
                                                 show_default=False)],
    name: Annotated[str, typer.Option(help="A name for the job.")],
    output: Annotated[str | None, typer.Option(
        help="Directory the job writes items into (need not exist; not a file).")] = None,
    pattern: Annotated[str | None,
                        typer.Option(help="Glob of one item file, e.g. '**/*.pt'.")] = None,
    expect: Annotated[int | None,
                       typer.Option(help="Expected number of items.")] = None,
    stall_timeout: Annotated[float | None,
                              typer.Option(help="Seconds with no progress: stalled.")] = None,
    startup_timeout: Annotated[float | None,
                                typer.Option(help="Max seconds before the first item.")] = None,
    stop_grace: Annotated[float | None,
                           typer.Option(help="Seconds from SIGTERM to SIGKILL on stop.")] = None,
    restart: Annotated[str | None, typer.Option(
        help=" | ".join(POLICIES), autocompletion=choices(POLICIES))] = None,
    max_restarts: Annotated[int | None,
                             typer.Option(help="Restarts with on-failure.")] = None,
    depends_on: Annotated[list[str] | None, typer.Option(
        help="Job id that must succeed first; repeatable.", autocompletion=job_ids)] = None,
    env: Annotated[list[str] | None,
                   typer.Option("--env", "-e", help="KEY=VALUE; repeatable.")] = None,
    label: Annotated[list[str] | None,
                     typer.Option("--label", "-l", help="KEY=VALUE; repeatable.")] = None,
    cwd: Annotated[Path | None, typer.Option(help="Working directory (default: here).")] = None,
    backend: Annotated[str | None, typer.Option(
        help=f"Where it runs: {' | '.join(registry.names())} (default: the daemon's "
             "JOBSUP_BACKEND).",
        autocompletion=choices(registry.names()))] = None,
    slurm: Annotated[list[str] | None, typer.Option(
        help="KEY=VALUE of what a slurm job asks for (partition, nodes, tasks_per_node, "
             "gpus_per_node, gres, cpus_per_task, mem, time, account, qos, extra); "
             "repeatable; implies --backend slurm.")] = None,
    wait: Annotated[bool, typer.Option(
        "--wait", help="Wait for the job to end; exit with its outcome (see `jobsup wait`).")
    ] = False,
    timeout: Timeout = None,
    as_json: Json = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q",
                                        help="The id only: no warnings.")] = False,
    url: Url = DEFAULT_URL,
) -> None:
    """Submit a job: jobsup submit --name NAME [OPTIONS] -- CMD [ARG...]. Prints its id
    (--json: the job); with --wait, exits with the job's outcome."""
    for field, value in (("stall_timeout_s", stall_timeout),
                         ("startup_timeout_s", startup_timeout), ("stop_grace_s", stop_grace)):
        if value is not None and not math.isfinite(value):  # JSON cannot even carry it
            option, takes = SUBMIT_OPTIONS[field]
            usage_error(f"{option}: {value} is not a finite number of seconds ({field})",
                        hint=f"{option}: {takes}")
    check_choice("--restart", restart, POLICIES)
    check_choice("--backend", backend, registry.names())
    check_output_dir("--output", output)
    check_timeout(timeout)
    spec: dict[str, Any] = {"name": name, "command": command,
                            "cwd": str((cwd or Path.cwd()).resolve())}
    optional = {"output_dir": output, "pattern": pattern, "expected_items": expect,
                "stall_timeout_s": stall_timeout, "startup_timeout_s": startup_timeout,
                "stop_grace_s": stop_grace, "restart_policy": restart,
                "max_restarts": max_restarts, "depends_on": depends_on}
    spec.update({k: v for k, v in optional.items() if v is not None})
    if output is not None:
        spec["output_dir"] = str(Path(output).resolve())
    if env:
        spec["env"] = pairs(env, "--env")
    if label:
        spec["labels"] = pairs(label, "--label")
    if backend is not None:
        spec["backend"] = backend
    if slurm:
        spec["slurm"] = slurm_section(slurm)
    try:
        c = client(url)
        job = c.post("/api/v1/jobs", json=spec)
        if not quiet:
            for warning in job.get("warnings", []):
                warn(warning)
        if as_json and not wait:
            print_json(job)
        elif not as_json:
            print(job["id"], flush=True)
        if wait:
            finish(c, [job["id"]], timeout=timeout, as_json=as_json, quiet=quiet, one=True)
    except JobsupError as exc:
        if exc.hint is None:
            exc.hint = submit_hint(exc.message)
        fail(exc)
