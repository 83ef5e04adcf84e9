"""Typed errors. The API turns them into HTTP answers in one handler, the CLI into
`error: ... / hint: ...` lines with exit code 1."""

from __future__ import annotations


class IllegalTransition(RuntimeError):
    """A state change the lifecycle does not allow (`spec.TRANSITIONS`): a bug in the
    daemon, refused before it is written."""


class JobsupError(Exception):
    """A failure the user can act on; never shown with a traceback."""

    status_code = 400

    def __init__(self, message: str, *, hint: str | None = None, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.field = field


class InvalidSpec(JobsupError):
    """A job spec that cannot run as given (missing executable, bad cwd, ...)."""

    status_code = 422


class JobNotFound(JobsupError):
    status_code = 404

    def __init__(self, job_id: str):
        super().__init__(
            f"no job with id {job_id!r}", hint="`jobsup ls` lists the jobs this daemon knows"
        )
        self.job_id = job_id


class AmbiguousJob(JobsupError):
    """A job reference (a name, or the start of an id) that names several jobs."""

    def __init__(self, reference: str, what: str, candidates: list[str], more: int = 0):
        listed = "; ".join(candidates) + (f"; and {more} more" if more else "")
        super().__init__(
            f"{reference!r} is {what} of {len(candidates) + more} jobs: {listed}",
            hint="give the whole id, or enough of its start to name one job "
                 "(`jobsup ls` shows them)", field="job_id")
        self.reference = reference


class Conflict(JobsupError):
    """The request is valid but the job's state does not allow it."""

    status_code = 409


class DaemonAlreadyRunning(JobsupError):
    """Another daemon holds the lock of this data dir."""


class DatabaseTaken(JobsupError):
    """This daemon's lock on its PostgreSQL database was lost (its connection ended) and
    another daemon holds it now: this one stops, its jobs are the other's."""


class JobsElsewhere(JobsupError):
    """Jobs of the database run from another data dir (`Job.data_dir_id`, `Job.jobs_dir`):
    their shims, logs and exit records are there, so a daemon here cannot watch them and
    would take them for launches cut short (and run them again)."""


class UnsafeBind(JobsupError):
    """A non-loopback bind without a token."""


class DatabaseDamaged(JobsupError):
    """The database file is not a database any more, or fails SQLite's quick check: the
    daemon does not start on it (`jobsup serve --rebuild-db` sets it aside)."""


class DatabaseUnavailable(JobsupError):
    """The configured database cannot be used: its driver is not installed, or its
    server cannot be reached at start (the message shows its URL without the password)."""

    status_code = 503


class JobRecordUnwritable(JobsupError):
    """A submitted job's record (`DATA_DIR/jobs/ID/job.json`) could not be written: the
    job is not accepted, since a lost database could not bring it back."""

    status_code = 507
