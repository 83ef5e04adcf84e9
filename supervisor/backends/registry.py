"""The backends by name, as a job's spec, the settings (`JOBSUP_BACKEND`), the API and
the CLI name them: `BACKENDS` maps each name to the class that implements it, as
"module:Class", imported only when a job first runs there (`base.backend_class`; uvicorn
picks its protocol implementations the same way). A new backend is a module with a
`base.Backend` subclass and one line here; the spec, the settings, the API and the CLI
accept its name from this table.

Imports nothing: the spec and the CLI read the names without loading a backend.
"""

from __future__ import annotations

BACKENDS: dict[str, str] = {
    "local": "supervisor.backends.local:LocalBackend",
    "slurm": "supervisor.backends.slurm:SlurmBackend",
}
"""Backend name -> "module:Class" of its `Backend`."""

DEFAULT_BACKEND = "local"
"""Where a job runs when nothing names another: the settings' default, and a job stored
before jobs named their backend."""


def names() -> tuple[str, ...]:
    """The backends' names, in the table's order."""
    return tuple(BACKENDS)


def check_name(name: str) -> str:
    """`name` if a backend has it, else ValueError naming the ones there are."""
    if name not in BACKENDS:
        raise ValueError(f"{name!r} is not a backend: use one of {', '.join(names())}")
    return name

