"""The job commands of `jobsup` (registered on the app in cli.py): ls, show, logs, stop,
restart, wait, alerts (submit: submit_cli.py). Read commands take `--json` (the API's
JSON as it came); `ls` takes `-q` (ids only); in a pipe, tables are plain tab-separated
lines."""

from __future__ import annotations

import math
import shlex
import sys
import time
from typing import Annotated, Any

import typer
from rich.text import Text

from supervisor.client import outcome
from supervisor.client.completion import choices, job_ids
from supervisor.client.http import Client, DaemonUnreachable
from supervisor.client.options import (
    DEFAULT_URL,
    Url,
    check_choice,
    client,
    pairs,
)
from supervisor.client.output import (
    EXIT_ERROR,
    console,
    err_console,
    fail,
    is_terminal,
    print_fields,
    print_json,
    print_rows,
    report,
    short_time,
    usage_error,
)
from supervisor.client.tui import gpu_memory_text, job_detail, rate_text, state_text
from supervisor.errors import JobsupError
from supervisor.formatting import format_duration
from supervisor.spec import AlertState, JobState, RestartPolicy

STATES = tuple(s.value for s in JobState)
POLICIES = tuple(p.value for p in RestartPolicy)
ALERT_STATES = tuple(s.value for s in AlertState)

LIST_PAGE = 1000
"""Jobs asked for per request by `ls` (the API's largest page): it follows the pages
to the last, so it lists every job."""
LOG_TAIL_DEFAULT = 100
LOG_TAIL_MAX = 1_000_000
"""The daemon's bounds on /logs?tail (api/routes.py job_logs)."""
JobId = Annotated[str, typer.Argument(
    help="Job id, name, or the start of an id (`8a84`): one that names several jobs is "
         "refused, listing them.", autocompletion=job_ids, show_default=False,
    metavar="JOB")]
Json = Annotated[bool, typer.Option("--json", help="Print the API's JSON.")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="Print job ids only.")]
Timeout = Annotated[float | None, typer.Option(
    help="Give up after this many seconds (exit 124).", show_default=False)]

def check_timeout(timeout: float | None) -> None:
    if timeout is not None and not (math.isfinite(timeout) and timeout >= 0):
        usage_error(f"--timeout: {timeout} is not a number of seconds >= 0",
                    hint="--timeout: seconds, e.g. 3600")


def job_line(job: dict[str, Any]) -> Text:
    return Text.assemble(f"{job['id']} ", state_text(job["state"]),
                         f" {job.get('reason') or ''}".rstrip())


def finish(c: Client, ids: list[str], *, timeout: float | None, as_json: bool, quiet: bool,
           one: bool = False) -> None:
    """Wait for the jobs and exit with their outcome (outcome.py). A line per job as it
    ends (stdout, or stderr with `one`: submit's stdout is its id), or the JSON at the end."""
    def ended(job: dict[str, Any]) -> None:
        if not (quiet or as_json):
            (err_console if one else console).print(job_line(job), highlight=False,
                                                     soft_wrap=True)

    try:
        jobs, done = outcome.wait_for_jobs(c, ids, timeout_s=timeout, on_end=ended)
    except KeyboardInterrupt:
        raise typer.Exit(outcome.EXIT_INTERRUPTED) from None
    if as_json:
        print_json(jobs[0] if one else jobs)
    if not done:
        if not quiet:
            left = ", ".join(f"{j['id']} ({j['state']})" for j in jobs if not outcome.ended(j))
            err_console.print(f"timed out after {format_duration(timeout)}: {left}",
                              highlight=False, soft_wrap=True)
        raise typer.Exit(outcome.EXIT_TIMEOUT)
    raise typer.Exit(outcome.combined_exit_code(jobs))


def exit_text(job: dict[str, Any]) -> str:
    return (f"sig {job['signal']}" if job["signal"] is not None
            else "-" if job["exit_code"] is None else str(job["exit_code"]))


def list_jobs(
    state: Annotated[str | None, typer.Option(
        help="Only jobs in this state: " + " | ".join(STATES) + ".",
        autocompletion=choices(STATES))] = None,
    label: Annotated[list[str] | None, typer.Option(
        "--label", "-l", help="Only jobs with this label KEY=VALUE; repeatable.")] = None,
    as_json: Json = False,
    quiet: Quiet = False,
    url: Url = DEFAULT_URL,
) -> None:
    """List jobs. On a terminal a table; in a pipe a header and one tab-separated line per
    job, never folded."""
    check_choice("--state", state, STATES)
    labels = pairs(label or [], "--label")
    params: dict[str, Any] = {"label": [f"{k}={v}" for k, v in labels.items()],
                              "order": "oldest", "limit": LIST_PAGE}
    if state:
        params["state"] = state
    try:
        jobs = client(url).get_all("/api/v1/jobs", params=params)  # every page
    except JobsupError as exc:
        fail(exc)
    if as_json:
        print_json(jobs)
        return
    if quiet:
        for job in jobs:
            print(job["id"])
        return
    if not jobs:
        what = " ".join(filter(None, (state, "jobs")))
        if labels:
            what += " with label " + ", ".join(f"{k}={v}" for k, v in labels.items())
        message = (f"no {what}" if state or labels
                   else "no jobs yet: `jobsup submit --name NAME -- CMD ...`")
        (console if is_terminal() else err_console).print(message, highlight=False)
        return
    # a terminal shows progress and alerts beside the state; a pipe keeps the first eight
    # columns where scripts (`cut -f`) found them and adds the two at the end
    order = TERMINAL_LS_COLUMNS if is_terminal() else PIPE_LS_COLUMNS
    rows = [ls_row(job) for job in jobs]
    print_rows(order, [[row[name] for name in order] for row in rows],
               folding=("NAME", "REASON", "ALERTS"))


TERMINAL_LS_COLUMNS = ("ID", "NAME", "STATE", "PROGRESS", "ALERTS", "PID", "EXIT",
                       "RESTARTS", "STARTED", "REASON")
PIPE_LS_COLUMNS = ("ID", "NAME", "STATE", "PID", "EXIT", "RESTARTS", "STARTED", "REASON",
                   "PROGRESS", "ALERTS")


def ls_row(job: dict[str, Any]) -> dict[str, Any]:
    alerts = ", ".join(a["rule"] for a in job.get("alerts") or [])
    return {"ID": job["id"], "NAME": job["name"], "STATE": state_text(job["state"]),
            "PROGRESS": progress_text(job), "ALERTS": Text(alerts, style="bold red"),
            "PID": str(job["pid"] or "-"), "EXIT": exit_text(job),
            "RESTARTS": str(job["restarts"]), "STARTED": short_time(job["started_at"]),
            "REASON": job.get("reason") or ""}


def progress_text(job: dict[str, Any]) -> str:
    """`done/total (pct%)`, `done` without a total, `-` before any; `, stalled` while a
    running job is: its `stalled` alert fires, or its rate is 0 (its forecast: no item
    for longer than its stall timeout; a tick apart, either may come first)."""
    done, total = job["progress"]["items_done"], job["progress"]["items_total"]
    if done is None:
        return "-"
    text = f"{done}/{total} ({100 * done / total:.0f}%)" if total else str(done)
    stalled = job["forecast"]["rate_items_per_s"] == 0 or any(
        a["rule"] == "stalled" for a in job.get("alerts") or [])
    if job["state"] == JobState.RUNNING.value and stalled:
        text += ", stalled"
    return text


def show(job_id: JobId, as_json: Json = False, url: Url = DEFAULT_URL) -> None:
    """Show one job: state, exit, spec, progress and its state transitions (--json: the
    job as GET /api/v1/jobs/ID answers)."""
    try:
        c = client(url)
        job = c.get(f"/api/v1/jobs/{job_id}")  # the daemon resolves a name or a prefix
        if as_json:
            print_json(job)
            return
        job_id = job["id"]
        events = c.get(f"/api/v1/jobs/{job_id}/events")
        samples = c.get(f"/api/v1/jobs/{job_id}/samples", params={"limit": 2000})
    except JobsupError as exc:
        fail(exc)
    spec, p, f = job["spec"], job["progress"], job["forecast"]
    done, total = p["items_done"], p["items_total"]
    rows = [
        ("id", job["id"]), ("name", job["name"]), ("state", state_text(job["state"])),
        ("reason", job.get("reason") or waiting_for(c, job) or "-"),
        ("command", shlex.join(spec["command"])),
        ("cwd", spec.get("cwd") or "-"), ("pid", str(job["pid"] or "-")),
        ("exit", f"code {job['exit_code']}" if job["exit_code"] is not None
         else f"signal {job['signal']}" if job["signal"] is not None else "-"),
        ("attempt", f"{job['attempt']} (restarts {job['restarts']}/{spec['max_restarts']}, "
                    f"policy {spec['restart_policy']})"),
        ("created", short_time(job["created_at"])), ("started", short_time(job["started_at"])),
        ("ended", short_time(job["ended_at"])),
        ("output", spec.get("output_dir") or "-"),
        ("depends on", ", ".join(spec["depends_on"]) or "-"),
        ("labels", ", ".join(f"{k}={v}" for k, v in spec.get("labels", {}).items()) or "-"),
        ("GPU memory", gpu_memory_text(job["resources"])),
    ]
    if job["resources"].get("node"):  # read by its shim there (docs/scale-out.md)
        rows.append(("node", job["resources"]["node"]))
    if job["resources"].get("scheduler_job_id"):
        rows.append(("SLURM job", job["resources"]["scheduler_job_id"]))
    if not is_terminal():  # the terminal shows these in the job's table row below
        rows += [("progress", "-" if done is None else f"{done}/{total}" if total else str(done)),
                 ("rate", rate_text(f["rate_items_per_s"])), ("eta", format_duration(f["eta_s"]))]
    print_fields(rows)
    if is_terminal():
        console.print(job_detail(job, samples, console.width))
        console.print("[bold]events[/]")
        for event in events:
            console.print(f"  {short_time(event['t'])}  {event['from_state'] or '-':>9} -> "
                          f"{event['to_state']:<9} {event['reason'] or ''}", highlight=False)
        return
    for event in events:
        sys.stdout.write(f"event\t{short_time(event['t'])}\t{event['from_state'] or '-'}\t"
                         f"{event['to_state']}\t{event['reason'] or '-'}\n")


def waiting_for(c: Client, job: dict[str, Any]) -> str | None:
    """What a pending job without a reason waits for: its dependencies not yet
    succeeded (None when it waits for nothing the CLI can name)."""
    if job["state"] != JobState.PENDING.value:
        return None
    waits = []
    for dep_id in job["spec"].get("depends_on") or []:
        try:
            dep = c.get(f"/api/v1/jobs/{dep_id}")
        except JobsupError:
            waits.append(dep_id)
            continue
        if dep["state"] != JobState.SUCCEEDED.value:
            waits.append(f"{dep_id} ({dep['name']}, {dep['state']})")
    return "waiting for " + ", ".join(waits) if waits else None


def logs(
    job_id: JobId,
    tail: Annotated[int, typer.Option(
        "--tail", "-n", help="Lines to show, from the end (0: none, e.g. with --follow).")
    ] = LOG_TAIL_DEFAULT,
    follow: Annotated[bool, typer.Option(
        "--follow", "-f", help="Keep printing new output (and later attempts' output) until "
                               "the job ends; exit with its outcome (see `jobsup wait`).")
    ] = False,
    attempt: Annotated[int | None, typer.Option(
        help="This attempt's output (1 is the first launch; default: the latest).",
        show_default=False)] = None,
    url: Url = DEFAULT_URL,
) -> None:
    """Print a job's stdout+stderr (the latest attempt, or --attempt N)."""
    if attempt is not None and attempt < 1:
        usage_error(f"--attempt: {attempt} is not an attempt number",
                    hint="--attempt: 1 for the first launch, 2 for the next, ...")
    if not 0 <= tail <= LOG_TAIL_MAX:
        usage_error(f"--tail: {tail} is not a number of lines",
                    hint=f"--tail N, N from 0 to {LOG_TAIL_MAX:,} (the last N lines)")
    try:
        c = client(url)
        if follow:  # one job throughout, whatever is submitted meanwhile under its name
            job_id = c.get(f"/api/v1/jobs/{job_id}")["id"]
        params = {"tail": tail} if attempt is None else {"tail": tail, "attempt": attempt}
        response = c.request("GET", f"/api/v1/jobs/{job_id}/logs", params=params)
        sys.stdout.write(response.text)
        sys.stdout.flush()
        if tail and response.text.count("\n") >= tail:  # earlier lines may be left out
            err_console.print(f"(the last {tail} line{'s' * (tail != 1)}; --tail N for more)",
                              highlight=False, soft_wrap=True)
        if follow:
            job = outcome.follow_log(c, job_id,
                                     int(response.headers.get("x-jobsup-log-offset", "0")),
                                     int(response.headers.get("x-jobsup-attempt", "0")))
            raise typer.Exit(outcome.exit_code(job))
    except JobsupError as exc:
        fail(exc)
    except KeyboardInterrupt:
        raise typer.Exit(outcome.EXIT_INTERRUPTED) from None


def stop(
    ids: Annotated[list[str], typer.Argument(
        help="Job ids, names or starts of ids (`jobsup ls -q --state running | xargs "
             "jobsup stop`).",
        autocompletion=job_ids, show_default=False, metavar="ID")],
    wait: Annotated[bool, typer.Option(help="Wait until the jobs have ended.")] = True,
    url: Url = DEFAULT_URL,
) -> None:
    """Stop jobs: SIGTERM to each one's whole process group, SIGKILL after its grace.
    Every job is asked first, then waited for. One that cannot be stopped (an unknown id,
    a job already ended) is reported and the others are still stopped; the exit code is
    then 1."""
    c = client(url)
    asked: list[dict[str, Any]] = []
    refused = 0
    for job_id in dict.fromkeys(ids):
        try:
            asked.append(c.post(f"/api/v1/jobs/{job_id}/stop"))
        except DaemonUnreachable as exc:
            fail(exc)
        except JobsupError as exc:
            report(exc)
            refused += 1
    for job in asked:
        try:
            job = until_ended(c, job) if wait else job
        except JobsupError as exc:
            fail(exc)
        console.print(job_line(job), highlight=False, soft_wrap=True)
    if refused:
        raise typer.Exit(EXIT_ERROR)


def stop_job(c: Client, job_id: str, *, wait: bool) -> dict[str, Any]:
    job: dict[str, Any] = c.post(f"/api/v1/jobs/{job_id}/stop")
    return until_ended(c, job) if wait else job


def until_ended(c: Client, job: dict[str, Any]) -> dict[str, Any]:
    while not outcome.ended(job):
        time.sleep(0.2)
        job = c.get(f"/api/v1/jobs/{job['id']}")
    return job


def restart(
    job_id: JobId,
    stop_first: Annotated[bool, typer.Option(
        "--stop", help="A pending or running job: stop it first (and wait for its end).")
    ] = False,
    wait: Annotated[bool, typer.Option(
        "--wait", help="Wait for the new attempt to end; exit with its outcome.")] = False,
    timeout: Timeout = None,
    as_json: Json = False,
    quiet: Quiet = False,
    url: Url = DEFAULT_URL,
) -> None:
    """A new attempt of an ended job: pending again, then started as soon as its
    dependencies allow; its earlier attempts' logs and events are kept. A pending or
    running job is refused unless --stop."""
    check_timeout(timeout)
    try:
        c = client(url)
        job_id = c.get(f"/api/v1/jobs/{job_id}")["id"]  # a name or a prefix, resolved
        if stop_first and not outcome.ended(c.get(f"/api/v1/jobs/{job_id}")):
            stop_job(c, job_id, wait=True)
        job = c.post(f"/api/v1/jobs/{job_id}/restart")
        if not (as_json and wait):
            if as_json:
                print_json(job)
            elif quiet:
                print(job["id"])
            else:
                console.print(job_line(job), highlight=False, soft_wrap=True)
        if wait:
            finish(c, [job_id], timeout=timeout, as_json=as_json, quiet=quiet, one=True)
    except JobsupError as exc:
        if exc.message.endswith("(HTTP 409)"):
            exc.hint = f"stop it first: `jobsup restart --stop {job_id}`"
        fail(exc)


def wait(
    ids: Annotated[list[str], typer.Argument(
        help="Job ids, names or starts of ids.", autocompletion=job_ids, show_default=False,
        metavar="ID")],
    timeout: Timeout = None,
    as_json: Json = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print nothing.")] = False,
    url: Url = DEFAULT_URL,
) -> None:
    """Wait until the jobs have ended; exit with their outcome. Prints a line per job as
    it ends (--json: the jobs at the end)."""
    check_timeout(timeout)
    try:
        c = client(url)
        # each name or prefix resolved once: a job submitted meanwhile under the same name
        # does not make it ambiguous halfway through
        resolved = [c.get(f"/api/v1/jobs/{job_id}")["id"] for job_id in ids]
        finish(c, list(dict.fromkeys(resolved)), timeout=timeout, as_json=as_json,
               quiet=quiet)
    except JobsupError as exc:
        fail(exc)


def alerts(
    state: Annotated[str | None, typer.Option(
        help="Only alerts in this state: " + " | ".join(ALERT_STATES) + ".",
        autocompletion=choices(ALERT_STATES))] = None,
    as_json: Json = False,
    url: Url = DEFAULT_URL,
) -> None:
    """List alerts, firing and resolved (--state to choose)."""
    check_choice("--state", state, ALERT_STATES)
    try:
        found = client(url).get("/api/v1/alerts", params={"state": state} if state else None)
    except JobsupError as exc:
        fail(exc)
    if as_json:
        print_json(found)
        return
    if not found:
        (console if is_terminal() else err_console).print(
            f"no {state + ' ' if state else ''}alerts", highlight=False)
        return
    print_rows(("JOB", "RULE", "SEVERITY", "STATE", "STARTED", "RESOLVED", "MESSAGE"),
               [(a["job_id"], a["rule"], a["severity"], a["state"], short_time(a["started_at"]),
                 short_time(a["resolved_at"]), a["message"]) for a in found],
               folding=("MESSAGE",))
