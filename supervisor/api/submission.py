"""Accepting a job: validate it against the machine and the store, warn about the disk,
record it. Shared by `POST /jobs` and the pipelines, which submit several at once."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

from sqlalchemy.orm import Session

from supervisor.backends import registry
from supervisor.backends.base import backend_class
from supervisor.backends.launch import check_runnable
from supervisor.errors import InvalidSpec
from supervisor.observe.view import JobView, preflight_warnings
from supervisor.spec import JobSpec
from supervisor.storage import store
from supervisor.storage.tables import Job


def submit_job(session: Session, spec: JobSpec, *, default_cwd: str,
               views: Mapping[str, JobView], jobs_dir: Path | None = None,
               default_backend: str = registry.DEFAULT_BACKEND,
               now: float | None = None) -> tuple[Job, list[str]]:
    """The recorded (pending, not yet committed) job and its submit-time warnings, or
    InvalidSpec naming the field that cannot be accepted.

    The job's record is also written to `jobs_dir/ID/job.json` (default: the session's
    `info["jobs_dir"]`, set by the daemon; none without either) before the caller
    commits, so the jobs can be rebuilt from the data dir if the database is lost; a
    record that cannot be written refuses the job (JobRecordUnwritable, 507).

    The job's backend is stored resolved (`JobSpec.backend_or(default_backend)`): a
    daemon restarted with another JOBSUP_BACKEND still finds its running jobs."""
    spec = check_runnable(spec, default_cwd=default_cwd)
    backend = spec.backend_or(default_backend)
    backend_class(backend).check_usable()
    spec = spec.model_copy(update={"backend": backend})
    for field in ("depends_on", "stop_when_ended"):
        ids = getattr(spec, field)
        missing = sorted(set(ids) - store.existing_ids(session, ids))
        if missing:
            raise InvalidSpec(f"{field}: unknown job id(s) {', '.join(missing)}", field=field)
    warnings = preflight_warnings(spec, views, store.learned_bytes_per_item(session, spec.name))
    # on the daemon's clock, as every later event of the job (`now`; the system's only
    # where no daemon runs): after a step of the system clock, a submit stamped with it
    # sorted after the job's own run (#33: a restarted job's events ended "submitted")
    job = store.create_job(session, spec=spec, now=time.time() if now is None else now)
    session.flush()
    jobs_dir = jobs_dir or session.info.get("jobs_dir")
    if jobs_dir is not None:
        store.write_job_record(session, job, Path(jobs_dir))
    return job, warnings
