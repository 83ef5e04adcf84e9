"""Shell completion (`jobsup completion bash|zsh|fish`), on Typer's own machinery: the
script printed calls `jobsup` back with `_JOBSUP_COMPLETE=complete_<shell>`, and the
command line's parser answers (commands, options, the values of `--state`, `--restart`,
and job ids from the daemon at `$JOBSUP_URL` when one answers)."""

from __future__ import annotations

import os
from typing import Any

from typer.completion import completion_init, get_completion_script

from supervisor.client.http import Client
from supervisor.config import Settings

SHELLS = ("bash", "zsh", "fish")
PROG = "jobsup"
COMPLETE_VAR = "_JOBSUP_COMPLETE"


def init() -> None:
    """Register Typer's completion formats (its scripts read them) before the app runs."""
    completion_init()


def script(shell: str) -> str:
    return get_completion_script(prog_name=PROG, complete_var=COMPLETE_VAR, shell=shell)


def choices(values: tuple[str, ...]) -> Any:
    """A completer offering `values` that start with what was typed."""
    def complete(incomplete: str) -> list[str]:
        return [v for v in values if v.startswith(incomplete)]
    return complete


def job_ids(incomplete: str) -> list[tuple[str, str]]:
    """Ids (with the job's name and state as help) of the daemon's jobs; none when no
    daemon answers within a second: completion never hangs or prints an error."""
    url = os.environ.get("JOBSUP_URL", "http://127.0.0.1:8765")
    try:
        client = Client(url, token=Settings().token, timeout_s=1.0)
        try:
            jobs = client.get("/api/v1/jobs", params={"limit": 1000})  # the newest
        finally:
            client.close()
    except Exception:  # a completer must never print a traceback
        return []
    return [(j["id"], f"{j['name']} ({j['state']})") for j in jobs
            if j["id"].startswith(incomplete)]
