"""The `jobsup` command (also `python -m supervisor`). Every flag has a JOBSUP_ variable.

The app and the daemon's commands live here; the job commands in `jobs_cli.py` and
`submit_cli.py`, the pipeline's in `pipeline_cli.py`, the arguments' checks in
`options.py`, how things are printed in `output.py`, outcomes and exit codes in
`outcome.py`, shell completion in `completion.py`."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from supervisor import __version__
from supervisor.client import completion, jobs_cli, outcome, submit_cli
from supervisor.client.http import DaemonUnreachable
from supervisor.client.options import (
    DEFAULT_URL,
    Url,
    check_choice,
    client,
    refuse_flag_values,
)
from supervisor.client.output import console, fail
from supervisor.client.pipeline_cli import demo, pipeline_app
from supervisor.client.tui import jobs_table
from supervisor.config import Settings
from supervisor.errors import JobsupError

# rich_markup_mode=None: click's plain help. Typer's rich panels print a type after every
# option, flags too (`--json <bool>`, as if it took a value: #32 item 9)
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="jobsup: launch, watch and forecast long-running ML jobs.",
                  epilog=outcome.EXIT_CODES_HELP)


def show_version(value: bool) -> None:
    if value:
        print(f"jobsup {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[bool, typer.Option(
        "--version", callback=show_version, is_eager=True,
        help="Print the version and exit.")] = False,
) -> None:
    """jobsup: launch, watch and forecast long-running ML jobs."""


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
    abandon_jobs_elsewhere: Annotated[bool, typer.Option(
        "--abandon-jobs-elsewhere", envvar="JOBSUP_ABANDON_JOBS_ELSEWHERE",
        help="Record running jobs launched from another data dir (whose files are not in "
             "this one) lost, instead of refusing to start: for a data dir gone for "
             "good. They are not stopped.")] = False,
    stop_jobs_on_exit: Annotated[bool, typer.Option(
        "--stop-jobs-on-exit", envvar="JOBSUP_STOP_JOBS_ON_EXIT",
        help="On SIGTERM, stop every running job (SIGTERM, grace, SIGKILL) and wait for "
             "them before exiting (in a container). Default: jobs keep running.")] = False,
    body_timeout_s: Annotated[float | None, typer.Option(
        "--body-timeout-s", envvar="JOBSUP_BODY_TIMEOUT_S", min=0.001,
        help="Seconds a request's body has to arrive whole after its head; later it "
             "answers 408 and the connection is closed (default 10).")] = None,
) -> None:
    """Run the daemon (foreground)."""
    from supervisor.daemon.app import serve as run_daemon

    overrides: dict[str, Any] = {"host": host, "port": port, "rebuild_db": rebuild_db,
                                 "abandon_jobs_elsewhere": abandon_jobs_elsewhere,
                                 "stop_jobs_on_exit": stop_jobs_on_exit}
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    if body_timeout_s is not None:
        overrides["body_timeout_s"] = body_timeout_s
    settings = Settings(**overrides)
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "httpcore"):  # their request lines print the webhook URLs: secrets
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        run_daemon(settings)
    except JobsupError as exc:
        fail(exc)


wait_help = f"Wait until the jobs have ended; exit with their outcome. {outcome.EXIT_CODES_HELP}"
app.command(context_settings={"allow_interspersed_args": False})(submit_cli.submit)
app.command("ls")(jobs_cli.list_jobs)
app.command()(jobs_cli.show)
app.command()(jobs_cli.logs)
app.command()(jobs_cli.stop)
app.command()(jobs_cli.restart)
app.command(help=wait_help, short_help="Wait until jobs have ended; exit with their "
                                      "outcome (exit codes: wait --help).")(jobs_cli.wait)
app.command()(jobs_cli.alerts)


@app.command()
def watch(
    interval: Annotated[float, typer.Option(help="Seconds between refreshes.")] = 2.0,
    all_jobs: Annotated[bool, typer.Option("--all", help="Also ended jobs.")] = False,
    once: Annotated[bool, typer.Option(help="Print the table once and exit.")] = False,
    url: Url = DEFAULT_URL,
) -> None:
    """Live table of jobs: progress, rate, ETA, bytes, disk runway, GPU memory, alerts.
    Keeps going while the daemon restarts (a line says it is unreachable)."""
    from rich.console import Group, RenderableType
    from rich.live import Live
    from rich.text import Text

    c = client(url)

    def fetch() -> list[dict[str, Any]]:
        jobs = c.get_all("/api/v1/jobs", params={"order": "oldest", "limit": 1000})
        if not all_jobs:
            jobs = [j for j in jobs if j["state"] in ("pending", "running")
                    or j.get("alerts")] or jobs[-10:]
        return jobs

    def render(jobs: list[dict[str, Any]], gone_since: float | None) -> RenderableType:
        table = jobs_table(jobs, console.width)
        if gone_since is None:
            return table
        since = time.strftime("%H:%M:%S", time.localtime(gone_since))
        return Group(table, Text(
            f"daemon unreachable at {c.url} since {since}, retrying every {interval:g} s "
            "(the table is its last answer)", style="bold red"))

    try:
        jobs = fetch()  # no daemon at the start: an error, not an empty watch
        if once:
            console.print(render(jobs, None))
            return
        gone_since: float | None = None
        with Live(render(jobs, None), console=console, auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                try:
                    jobs, gone_since = fetch(), None
                except DaemonUnreachable:  # restarting: keep the last table and poll on
                    gone_since = gone_since or time.time()
                live.update(render(jobs, gone_since), refresh=True)
    except JobsupError as exc:
        fail(exc)
    except KeyboardInterrupt:
        return


@app.command("completion")
def completion_script(
    shell: Annotated[str, typer.Argument(
        help=" | ".join(completion.SHELLS), autocompletion=completion.choices(completion.SHELLS),
        show_default=False)],
) -> None:
    """Print the shell completion script: `source <(jobsup completion bash)` (bash, in
    ~/.bashrc), `jobsup completion zsh > ~/.zfunc/_jobsup` (zsh, with ~/.zfunc on
    $fpath), `jobsup completion fish > ~/.config/fish/completions/jobsup.fish`."""
    check_choice("SHELL", shell, completion.SHELLS)
    print(completion.script(shell))


app.add_typer(pipeline_app, name="pipeline")
app.command()(demo)


def main() -> None:
    completion.init()
    try:
        refuse_flag_values(typer.main.get_command(app), sys.argv[1:])
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    app(prog_name="jobsup")


if __name__ == "__main__":
    main()
