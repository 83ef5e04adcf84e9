"""How the CLI writes: `error:` / `hint:` lines, the API's JSON (`--json`), and tables that
are rich on a terminal and plain, tab-separated lines in a pipe (`jobsup ls | grep NAME`
finds a job whatever its name's length: nothing is folded or cut)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from supervisor.errors import JobsupError

console = Console()
err_console = Console(stderr=True)

EXIT_ERROR = 1
"""A request failed (daemon unreachable, unknown job, rejected input)."""
EXIT_USAGE = 2
"""The command line is wrong; no request was made (click's own usage errors use 2 too)."""


def report(exc: JobsupError) -> None:
    """`error:` / `hint:` on stderr, each on one line however long (a path or a pattern
    such as `[z-a]` comes out as it is: no wrapping, no markup)."""
    err_console.print(Text.assemble(("error:", "bold red"), " ", exc.message),
                      soft_wrap=True, highlight=False)
    if exc.hint:
        err_console.print(Text.assemble(("hint:", "bold"), " ", exc.hint), soft_wrap=True,
                          highlight=False)


def fail(exc: JobsupError, code: int = EXIT_ERROR) -> NoReturn:
    """`report` the error, then exit with `code`."""
    report(exc)
    raise typer.Exit(code)


def usage_error(message: str, hint: str | None = None) -> NoReturn:
    """A wrong argument caught before any request: exit code 2."""
    fail(JobsupError(message, hint=hint), EXIT_USAGE)


def warn(message: str) -> None:
    err_console.print(Text.assemble(("warning:", "bold yellow"), " ", message),
                      soft_wrap=True, highlight=False)


def print_json(data: Any) -> None:
    """The API's JSON as it came, on stdout."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
    sys.stdout.flush()


def short_time(iso: str | None) -> str:
    return iso.replace("T", " ")[:19] if iso else "-"


def is_terminal() -> bool:
    return console.is_terminal


def plain_cell(value: Any) -> str:
    """A cell of a plain line: never empty (`-`), no tab or newline inside."""
    text = value.plain if isinstance(value, Text) else str(value)
    text = " ".join(text.split("\t")).replace("\n", " ").strip()
    return text or "-"


def print_rows(header: Sequence[str], rows: Sequence[Sequence[Any]],
               folding: Sequence[str] = ()) -> None:
    """A table: rich on a terminal, where only the `folding` columns fold when it is too
    narrow (the others keep their width); in a pipe, the header and one tab-separated
    line per row, unwrapped."""
    if not is_terminal():
        for row in [list(header), *rows]:
            sys.stdout.write("\t".join(plain_cell(cell) for cell in row) + "\n")
        sys.stdout.flush()
        return
    table = Table(box=None, header_style="bold")
    for column in header:
        table.add_column(column, overflow="fold", no_wrap=column not in folding)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def print_fields(rows: Sequence[tuple[str, Any]]) -> None:
    """Key and value per line (`jobsup show`): a rich grid on a terminal, `key<TAB>value`
    lines in a pipe."""
    if not is_terminal():
        for key, value in rows:
            sys.stdout.write(f"{key}\t{plain_cell(value)}\n")
        sys.stdout.flush()
        return
    table = Table(box=None, show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
