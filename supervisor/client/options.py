"""What every client command shares: `--url`, the client it makes, and the checks of
arguments that run before any request (a wrong one exits 2 with `error:` / `hint:`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

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


BOOLEAN_WORDS = frozenset({"true", "false", "yes", "no", "on", "off"})
"""Words after a flag that mean its value was given (`--json true`), not an argument."""


def flag_names(command: Any) -> Iterator[str]:
    """Every flag (an option that takes no value: `--json`, `-q`) of `command` (the app's
    click command: `typer.main.get_command`) and of its subcommands. Read by attribute:
    Typer's commands and options are its own classes, not click's."""
    for param in command.params:
        if getattr(param, "is_flag", False):
            yield from (*param.opts, *param.secondary_opts)
    for sub in getattr(command, "commands", {}).values():
        yield from flag_names(sub)


def refuse_flag_values(command: Any, args: Sequence[str]) -> None:
    """`--json true`: a usage error that says a flag takes no value. Left alone, click
    read the word as an argument: `ls` answered 'unexpected extra argument', `wait` took
    it for a job id. Only before `--` (what follows is a job's own command line)."""
    flags = set(flag_names(command))
    for i, arg in enumerate(args):
        if arg == "--":
            return
        flag, equals, word = arg.partition("=")
        if not equals:
            after = args[i + 1] if i + 1 < len(args) else ""
            word = after if after.lower() in BOOLEAN_WORDS else ""
        if flag in flags and word:
            usage_error(f"{flag} is a flag and takes no value ({flag} {word} / {flag}={word}: "
                        "a word after it would be read as an argument)",
                        hint=f"{flag} alone turns it on; leave it out to keep it off")
