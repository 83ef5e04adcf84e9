"""What every client command shares: `--url`, the client it makes, and the checks of
arguments that run before any request (a wrong one exits 2 with `error:` / `hint:`)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import typer

from supervisor.client.http import Client
from supervisor.client.output import usage_error
from supervisor.config import Settings

DEFAULT_URL = "http://127.0.0.1:8765"
Url = Annotated[str, typer.Option("--url", envvar="JOBSUP_URL",
                                  help="Where the daemon listens.")]


def client(url: str) -> Client:
    return Client(url, token=Settings().token)


def check_choice(option: str, value: str | None, allowed: Iterable[str]) -> None:
    names = list(allowed)
    if value is not None and value not in names:
        usage_error(f"{option}: {value!r} is not one of {', '.join(names)}",
                    hint=f"{option}: {' | '.join(names)}")


def pairs(items: list[str], option: str) -> dict[str, str]:
    """KEY=VALUE arguments as a dict."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            usage_error(f"{option} {item!r} is not of the form KEY=VALUE",
                        hint=f"{option}: KEY=VALUE")
        out[key] = value
    return out


def check_output_dir(option: str, value: str | None) -> None:
    """A directory, or a path that does not exist yet (the job makes it); not a file."""
    if value is not None and Path(value).exists() and not Path(value).is_dir():
        usage_error(f"{option}: {value} exists and is not a directory",
                    hint=f"{option}: a directory the job writes its items into (it may "
                         "not exist yet)")
