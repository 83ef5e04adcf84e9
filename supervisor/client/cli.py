"""The `jobsup` command (also `python -m supervisor`). Every flag has a JOBSUP_ variable."""

from __future__ import annotations

import logging
import math
import re
import sys
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from supervisor.client.http import Client
from supervisor.client.tui import follow_jobs, gpu_memory_text, job_detail, jobs_table, state_text
from supervisor.config import Settings
from supervisor.errors import JobsupError
from supervisor.pipeline import DEFAULT_MIN_ACCEPTANCE_LENGTH

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="jobsup: launch, watch and forecast long-running ML jobs.")
console = Console()
err_console = Console(stderr=True)

Url = Annotated[str, typer.Option("--url", envvar="JOBSUP_URL",
                                  help="Where the daemon listens.")]
DEFAULT_URL = "http://127.0.0.1:8765"



class DemoModel(StrEnum):
    TINY = "tiny"
    SMOLLM2 = "smollm2"


def client(url: str) -> Client:
    return Client(url, token=Settings().token)


def fail(exc: JobsupError) -> NoReturn:
    """`error:` / `hint:` on stderr, each on one line however long (a path or a pattern
    such as `[z-a]` comes out as it is: no wrapping, no markup)."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", exc.message),
                      soft_wrap=True, highlight=False)
    if exc.hint:
        err_console.print(Text.assemble(("hint:", "bold"), " ", exc.hint), soft_wrap=True,
                          highlight=False)
    raise typer.Exit(1)


def short_time(iso: str | None) -> str:
    return iso.replace("T", " ")[:19] if iso else "-"


def pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise JobsupError(f"{what} {item!r} is not of the form KEY=VALUE")
        out[key] = value
    return out


@app.command()
def serve(
    host: Annotated[str, typer.Option(envvar="JOBSUP_HOST")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="JOBSUP_PORT")] = 8765,
    data_dir: Annotated[Path | None, typer.Option(envvar="JOBSUP_DATA_DIR",
                                                  help="default ~/.local/share/jobsup")] = None,
    rebuild_db: Annotated[bool, typer.Option(
        "--rebuild-db", envvar="JOBSUP_REBUILD_DB",
        help="If the database is damaged, move it aside (jobsup.db.damaged-<time>) and "
             "rebuild the jobs from DATA_DIR/jobs. A sound database is left alone.")] = False,
    stop_jobs_on_exit: Annotated[bool, typer.Option(
        "--stop-jobs-on-exit", envvar="JOBSUP_STOP_JOBS_ON_EXIT",
        help="On SIGTERM, stop every running job (SIGTERM, grace, SIGKILL) and wait for "
             "them before exiting (in a container). Default: jobs keep running.")] = False,
) -> None:
    """Run the daemon (foreground)."""
    from supervisor.daemon.app import serve as run_daemon

    overrides: dict[str, Any] = {"host": host, "port": port, "rebuild_db": rebuild_db,
                                 "stop_jobs_on_exit": stop_jobs_on_exit}
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    settings = Settings(**overrides)
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "httpcore"):  # their request lines print the webhook URLs: secrets
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        run_daemon(settings)
    except JobsupError as exc:
        fail(exc)


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
    "restart_policy": ("--restart", "never | on-failure"),
    "max_restarts": ("--max-restarts", "a whole number >= 0"),
    "depends_on": ("--depends-on", "ids of jobs this daemon knows (`jobsup ls`)"),
    "env": ("--env", "KEY=VALUE"),
    "labels": ("--label", "KEY=VALUE"),
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


@app.command(context_settings={"allow_interspersed_args": False})
def submit(
    command: Annotated[list[str], typer.Argument(help="The program and its arguments (after --).",
                                                 show_default=False)],
    name: Annotated[str, typer.Option(help="A name for the job.")],
    output: Annotated[str | None,
                       typer.Option(help="Directory the job writes items into.")] = None,
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
    restart: Annotated[str | None,
                        typer.Option(help="never | on-failure")] = None,
    max_restarts: Annotated[int | None,
                             typer.Option(help="Restarts with on-failure.")] = None,
    depends_on: Annotated[list[str] | None,
                           typer.Option(help="Job id that must succeed first; repeatable.")] = None,
    env: Annotated[list[str] | None,
                   typer.Option("--env", "-e", help="KEY=VALUE; repeatable.")] = None,
    label: Annotated[list[str] | None,
                     typer.Option("--label", "-l", help="KEY=VALUE; repeatable.")] = None,
    cwd: Annotated[Path | None, typer.Option(help="Working directory (default: here).")] = None,
    url: Url = DEFAULT_URL,
) -> None:
    """Submit a job: jobsup submit --name NAME \\[OPTIONS] -- CMD \\[ARG...]. Prints its id."""
    for field, value in (("stall_timeout_s", stall_timeout),
                         ("startup_timeout_s", startup_timeout), ("stop_grace_s", stop_grace)):
        if value is not None and not math.isfinite(value):  # JSON cannot even carry it
            option, takes = SUBMIT_OPTIONS[field]
            fail(JobsupError(f"{option}: {value} is not a finite number of seconds ({field})",
                             hint=f"{option}: {takes}"))
    try:
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
        job = client(url).post("/api/v1/jobs", json=spec)
    except JobsupError as exc:
        if exc.hint is None:
            exc.hint = submit_hint(exc.message)
        fail(exc)
    for warning in job.get("warnings", []):
        err_console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
    print(job["id"])


@app.command("ls")
def list_jobs(
    state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
    url: Url = DEFAULT_URL,
) -> None:
    """List jobs."""
    try:
        jobs = client(url).get("/api/v1/jobs", params={"state": state} if state else None)
    except JobsupError as exc:
        fail(exc)
    table = Table(box=None, header_style="bold")
    for column in ("ID", "NAME", "STATE", "PID", "EXIT", "RESTARTS", "STARTED", "REASON"):
        table.add_column(column, overflow="fold")
    for job in jobs:
        exit_text = (f"sig {job['signal']}" if job["signal"] is not None
                     else "-" if job["exit_code"] is None else str(job["exit_code"]))
        table.add_row(job["id"], job["name"], state_text(job['state']), str(job["pid"] or "-"),
                      exit_text, str(job["restarts"]), short_time(job["started_at"]),
                      job.get("reason") or "")
    if not jobs:
        console.print("no jobs yet: `jobsup submit --name NAME -- CMD ...`")
        return
    console.print(table)


@app.command()
def show(job_id: Annotated[str, typer.Argument(help="Job id.")], url: Url = DEFAULT_URL) -> None:
    """Show one job: state, exit, spec and its state transitions."""
    try:
        c = client(url)
        job = c.get(f"/api/v1/jobs/{job_id}")
        events = c.get(f"/api/v1/jobs/{job_id}/events")
        samples = c.get(f"/api/v1/jobs/{job_id}/samples", params={"limit": 2000})
    except JobsupError as exc:
        fail(exc)
    spec = job["spec"]
    table = Table(box=None, show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    rows = [
        ("id", job["id"]), ("name", job["name"]), ("state", state_text(job['state'])),
        ("reason", job.get("reason") or "-"), ("command", " ".join(spec["command"])),
        ("cwd", spec.get("cwd") or "-"), ("pid", str(job["pid"] or "-")),
        ("exit", f"code {job['exit_code']}" if job["exit_code"] is not None
         else f"signal {job['signal']}" if job["signal"] is not None else "-"),
        ("attempt", f"{job['attempt']} (restarts {job['restarts']}/{spec['max_restarts']}, "
                    f"policy {spec['restart_policy']})"),
        ("created", short_time(job["created_at"])), ("started", short_time(job["started_at"])),
        ("ended", short_time(job["ended_at"])),
        ("output", spec.get("output_dir") or "-"),
        ("depends on", ", ".join(spec["depends_on"]) or "-"),
        ("GPU memory", gpu_memory_text(job["resources"])),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    console.print(job_detail(job, samples))
    console.print("[bold]events[/]")
    for event in events:
        console.print(f"  {short_time(event['t'])}  {event['from_state'] or '-':>9} -> "
                      f"{event['to_state']:<9} {event['reason'] or ''}", highlight=False)


@app.command()
def logs(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    tail: Annotated[int, typer.Option("--tail", "-n", help="Lines to show.")] = 100,
    follow: Annotated[bool, typer.Option("--follow", "-f",
                                         help="Keep printing new output.")] = False,
    url: Url = DEFAULT_URL,
) -> None:
    """Print a job's stdout+stderr (the latest attempt)."""
    try:
        c = client(url)
        response = c.request("GET", f"/api/v1/jobs/{job_id}/logs", params={"tail": tail})
        sys.stdout.write(response.text)
        sys.stdout.flush()
        if follow:
            follow_log(c, job_id, int(response.headers.get("x-jobsup-log-offset", "0")),
                       int(response.headers.get("x-jobsup-attempt", "0")))
    except JobsupError as exc:
        fail(exc)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def follow_log(c: Client, job_id: str, offset: int, attempt: int, poll_s: float = 0.5) -> None:
    """Print new output until the job has ended and everything was read."""
    while True:
        response = c.request("GET", f"/api/v1/jobs/{job_id}/logs",
                             params={"offset": offset, "attempt": attempt or None})
        chunk = response.text
        if chunk:
            sys.stdout.write(chunk)
            sys.stdout.flush()
        offset = int(response.headers.get("x-jobsup-log-offset", offset))
        if chunk:
            continue
        job = c.get(f"/api/v1/jobs/{job_id}")
        if job["attempt"] > attempt:
            if attempt:
                print(f"--- jobsup: attempt {job['attempt']} ---", flush=True)
            attempt, offset = job["attempt"], 0
            continue
        if job["state"] in ("succeeded", "failed", "stopped", "lost"):
            return
        time.sleep(poll_s)


@app.command()
def stop(
    job_id: Annotated[str, typer.Argument(help="Job id.")],
    wait: Annotated[bool, typer.Option(help="Wait until the job has ended.")] = True,
    url: Url = DEFAULT_URL,
) -> None:
    """Stop a job: SIGTERM to its whole process group, SIGKILL after the grace."""
    try:
        c = client(url)
        job = c.post(f"/api/v1/jobs/{job_id}/stop")
        while wait and job["state"] in ("pending", "running"):
            time.sleep(0.2)
            job = c.get(f"/api/v1/jobs/{job_id}")
    except JobsupError as exc:
        fail(exc)
    console.print(Text.assemble(f"{job['id']} ", state_text(job["state"]),
                                f" {job.get('reason') or ''}"))


@app.command()
def watch(
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 2.0,
    all_jobs: Annotated[bool, typer.Option("--all", help="Also ended jobs.")] = False,
    once: Annotated[bool, typer.Option(help="Print the table once and exit.")] = False,
    url: Url = DEFAULT_URL,
) -> None:
    """Live table of jobs: progress, rate, ETA, bytes, disk runway, GPU memory, alerts."""
    from rich.live import Live

    c = client(url)

    def render() -> Table:
        jobs = c.get("/api/v1/jobs")
        if not all_jobs:
            jobs = [j for j in jobs if j["state"] in ("pending", "running")
                    or j.get("alerts")] or jobs[-10:]
        return jobs_table(jobs, console.width)

    try:
        if once:
            console.print(render())
            return
        with Live(render(), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(render(), refresh=True)
    except JobsupError as exc:
        fail(exc)
    except KeyboardInterrupt:
        return


pipeline_app = typer.Typer(no_args_is_help=True, help="Multi-step pipelines (EAGLE-3).")
app.add_typer(pipeline_app, name="pipeline")


@pipeline_app.command("run")
def pipeline_run(
    kind: Annotated[str, typer.Argument(help="Pipeline kind: eagle3.")],
    model: Annotated[Path, typer.Option(help="Target model directory (HF format).")],
    prompts: Annotated[Path, typer.Option(help="Prompts JSONL.")],
    out: Annotated[Path, typer.Option(help="Output directory of all steps.")],
    name: Annotated[str, typer.Option(help="Prefix of the jobs' names.")] = "eagle3",
    serve: Annotated[str | None, typer.Option(
        help="Launch the target's server as a job: vllm | stub.")] = None,
    endpoint: Annotated[str | None, typer.Option(
        help="Use a running OpenAI-compatible server (…/v1).")] = None,
    port: Annotated[int, typer.Option(help="Port of a served target.")] = 8000,
    max_tokens: Annotated[int | None, typer.Option(help="Generation length cap.")] = None,
    draft_vocab_size: Annotated[int, typer.Option(help="Draft vocabulary size.")] = 32000,
    ttt_steps: Annotated[int, typer.Option(help="Training-time-test steps.")] = 7,
    epochs: Annotated[int, typer.Option(help="Training epochs.")] = 1,
    device: Annotated[str | None, typer.Option(help="cuda | cpu (default: cuda if any).")] = None,
    extract_gpus: Annotated[str | None, typer.Option(
        help="Extraction on several GPUs: N | all (one process per GPU).")] = None,
    gpus_per_model: Annotated[int, typer.Option(
        help="Split the target over K GPUs during extraction (larger than one GPU).")] = 1,
    dtype: Annotated[str, typer.Option(
        help="auto | bf16 | fp16 | fp32 (extraction, evaluation; auto: bf16 on a GPU, "
             "fp32 on a CPU).")] = "auto",
    init: Annotated[Path | None, typer.Option(help="Pre-trained draft to finetune.")] = None,
    eval_prompts: Annotated[int, typer.Option(
        help="Hold the last N prompts out of training to measure the draft on (0: no "
             "evaluate step).")] = 16,
    eval_max_new_tokens: Annotated[int, typer.Option(
        help="Tokens generated per held-out prompt.")] = 256,
    min_acceptance_length: Annotated[float, typer.Option(
        help="low_acceptance alert below this many tokens per target pass (0: off).")
    ] = DEFAULT_MIN_ACCEPTANCE_LENGTH,
    follow: Annotated[bool, typer.Option(help="Watch until every step has ended.")] = False,
    url: Url = DEFAULT_URL,
) -> None:
    """Submit a pipeline's steps as jobs chained with depends_on; prints their ids."""
    if kind != "eagle3":
        fail(JobsupError(f"unknown pipeline {kind!r}", hint="available: eagle3"))
    body: dict[str, Any] = {
        "model": str(model.resolve()), "prompts": str(prompts.resolve()),
        "out": str(out.resolve()), "name": name, "serve": serve, "endpoint": endpoint,
        "port": port, "max_tokens": max_tokens, "draft_vocab_size": draft_vocab_size,
        "ttt_steps": ttt_steps, "epochs": epochs, "device": device, "dtype": dtype,
        "extract_gpus": extract_gpus, "gpus_per_model": gpus_per_model,
        "init": str(init.resolve()) if init else None, "eval_prompts": eval_prompts,
        "eval_max_new_tokens": eval_max_new_tokens,
        "min_acceptance_length": min_acceptance_length or None}
    try:
        c = client(url)
        jobs = c.post("/api/v1/pipelines/eagle3", json=body)
        for job in jobs:
            console.print(f"{job['id']}  {job['name']}", highlight=False)
            for warning in job.get("warnings", []):
                err_console.print(f"[bold yellow]warning:[/] {warning}", highlight=False)
        if follow:
            ok = follow_jobs(c, [j["id"] for j in jobs], console)
            raise typer.Exit(0 if ok else 1)
    except JobsupError as exc:
        fail(exc)


@app.command()
def demo(
    data_dir: Annotated[Path | None, typer.Option(envvar="JOBSUP_DATA_DIR")] = None,
    model: Annotated[DemoModel, typer.Option(
        help="tiny: a random Llama built locally (fast, its draft learns nothing); "
             "smollm2: SmolLM2-135M-Instruct from the package registry (a real chat "
             "model, whose draft's acceptance means something; ~7 min on 2 cores)")] = \
        DemoModel.SMOLLM2,
    max_tokens: Annotated[int | None, typer.Option(
        help="Tokens generated per prompt (default: 48 tiny, 64 smollm2).")] = None,
    epochs: Annotated[int | None, typer.Option(
        help="Draft training epochs (default: 3 tiny, 8 smollm2).")] = None,
    keep_daemon: Annotated[bool, typer.Option(help="Leave the daemon running at the end.")] = True,
    url: Url = DEFAULT_URL,
) -> None:
    """The EAGLE-3 pipeline on a local model under the daemon (starts one if none
    answers at --url)."""
    from supervisor.client.demo import run_demo

    try:
        code = run_demo(url=url, data_dir=data_dir, keep_daemon=keep_daemon, console=console,
                        max_tokens=max_tokens, epochs=epochs, model_kind=model.value)
    except JobsupError as exc:
        fail(exc)
    raise typer.Exit(code)


def main() -> None:
    app(prog_name="jobsup")


if __name__ == "__main__":
    main()
