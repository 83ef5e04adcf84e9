"""FastAPI routes. Thin: validate, call the store, wake the engine, return."""


import hmac
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy.orm import Session, sessionmaker

from supervisor import __version__, store
from supervisor.config import Settings
from supervisor.errors import Conflict, InvalidSpec, JobsupError
from supervisor.fileio import read_from, tail_lines
from supervisor.launcher import log_path
from supervisor.models import Job
from supervisor.observe import JobView
from supervisor.pipeline import Eagle3Pipeline, eagle3_jobs
from supervisor.present import alert_out, job_out, sample_out
from supervisor.spec import (
    AlertOut,
    AlertState,
    EventOut,
    JobOut,
    JobSpec,
    JobState,
    SampleOut,
)
from supervisor.submission import submit_job
from supervisor.timefmt import iso

log = logging.getLogger(__name__)

API_PREFIX = "/api/v1"
PUBLIC_PATHS = frozenset({"/healthz"})
LOG_CHUNK_BYTES = 1 << 20
"""Most bytes one `logs?offset=` answer carries."""


def _validation_message(errors: list[Any]) -> str:
    parts = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
        field = ".".join(loc) or "body"
        parts.append(f"{field}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def create_app(settings: Settings, sessions: sessionmaker[Session], *,
               wake: Callable[[], None], views: Callable[[], Mapping[str, JobView]],
               registry: CollectorRegistry | None = None) -> FastAPI:
    """The API over a store. `wake` asks the engine for a tick (after a submit or stop);
    `views` returns the engine's latest per-job progress, forecast and resources."""
    app = FastAPI(title="jobsup", version=__version__)
    default_cwd = os.getcwd()
    public_paths = PUBLIC_PATHS | ({"/metrics"} if settings.metrics_public else set())

    def db() -> Iterator[Session]:
        with sessions() as session:
            yield session

    DB = Annotated[Session, Depends(db)]

    @app.middleware("http")
    async def require_token(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if settings.token and request.url.path not in public_paths:
            header = request.headers.get("authorization", "")
            given = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(given.encode(), settings.token.encode()):
                return JSONResponse(
                    {"error": "missing or wrong bearer token",
                     "hint": "send `Authorization: Bearer $JOBSUP_TOKEN`"},
                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    @app.exception_handler(JobsupError)
    async def jobsup_error(_request: Request, exc: JobsupError) -> JSONResponse:
        body = {"error": exc.message, "hint": exc.hint, "field": exc.field}
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")}
                  for e in exc.errors()]
        return JSONResponse({"error": _validation_message(errors), "detail": errors},
                            status_code=422)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> Response:
        data = generate_latest(registry) if registry is not None else b""
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    @app.post(f"{API_PREFIX}/jobs", status_code=201)
    def submit(spec: JobSpec, session: DB) -> JobOut:
        job, warnings = submit_job(session, spec, default_cwd=default_cwd, views=views())
        session.commit()
        wake()
        return job_out(job, None, warnings=warnings)

    @app.post(f"{API_PREFIX}/pipelines/eagle3", status_code=201)
    def submit_eagle3(params: Eagle3Pipeline, session: DB) -> list[JobOut]:
        """The four EAGLE-3 steps (and the target's server, with `serve`) as jobs
        chained with `depends_on`; all or nothing."""
        submitted: list[tuple[Job, list[str]]] = []
        for spec in eagle3_jobs(params, resolve=lambda i: submitted[i][0].id):
            submitted.append(submit_job(session, spec, default_cwd=default_cwd,
                                        views=views()))
        session.commit()
        wake()
        return [job_out(job, None, warnings=warnings) for job, warnings in submitted]

    @app.get(f"{API_PREFIX}/jobs")
    def list_jobs(
        session: DB, state: JobState | None = None,
        label: Annotated[list[str] | None, Query(description="k=v, repeatable")] = None,
    ) -> list[JobOut]:
        wanted: dict[str, str] = {}
        for item in label or []:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise InvalidSpec(f"label: {item!r} is not of the form key=value",
                                  field="label")
            wanted[key] = value
        current = views()
        firing = store.firing_alerts_by_job(session)
        jobs = [job_out(j, current.get(j.id), alerts=firing.get(j.id, ()))
                for j in store.list_jobs(session, state=state)]
        return [j for j in jobs if all(j.spec.labels.get(k) == v for k, v in wanted.items())]

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}")
    def get_job(job_id: str, session: DB) -> JobOut:
        job = store.get_job(session, job_id)
        firing = store.firing_alerts_by_job(session, job_id=job_id)
        return job_out(job, views().get(job_id), alerts=firing.get(job_id, ()))

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}/events")
    def job_events(job_id: str, session: DB) -> list[EventOut]:
        store.get_job(session, job_id)
        return [
            EventOut(t=iso(e.t) or "", from_state=JobState(e.from_state) if e.from_state else None,
                     to_state=JobState(e.to_state), reason=e.reason)
            for e in store.events(session, job_id)
        ]

    @app.post(f"{API_PREFIX}/jobs/{{job_id}}/stop", status_code=202)
    def stop_job(job_id: str, session: DB) -> JobOut:
        job = store.get_job(session, job_id)
        if JobState(job.state).ended:
            raise Conflict(f"job {job_id} already ended ({job.state})")
        store.request_stop(session, job_id, now=time.time())
        session.commit()
        wake()
        session.refresh(job)
        return job_out(job, views().get(job_id))

    @app.get(f"{API_PREFIX}/alerts")
    def list_alerts(session: DB, state: AlertState | None = None) -> list[AlertOut]:
        return [alert_out(a) for a in store.alerts(session, state=state)]

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}/samples")
    def job_samples(
        job_id: str, session: DB, since: datetime | None = None,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    ) -> list[SampleOut]:
        """Stored readings, oldest first: from `since` on, else the latest `limit`."""
        store.get_job(session, job_id)
        # ISO times carry microseconds, rounded: half a microsecond of slack keeps a
        # sample's own `t` inside `since=<that t>`
        if since is not None and since.tzinfo is None:
            since = since.replace(tzinfo=UTC)  # the contract's times are UTC
        rows = store.samples(session, job_id, limit=limit,
                             since=since.timestamp() - 5e-7 if since else None)
        return [sample_out(row) for row in rows]

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}/logs", response_class=PlainTextResponse)
    def job_logs(
        job_id: str, session: DB,
        tail: Annotated[int, Query(ge=0, le=1_000_000)] = 100,
        attempt: Annotated[int | None, Query(ge=1)] = None,
        offset: Annotated[int | None, Query(ge=0, description="bytes; for --follow")] = None,
    ) -> PlainTextResponse:
        """The last `tail` lines of the attempt's output, or (with `offset`) what follows
        that byte offset. Header `X-Jobsup-Log-Offset` says where to continue."""
        job = store.get_job(session, job_id)
        number = attempt or job.attempt
        if number > job.attempt:
            raise InvalidSpec(f"attempt: job {job_id} has {job.attempt} attempt(s)",
                              field="attempt")
        path = log_path(settings.jobs_dir, job_id, number) if number else None
        if path is None:
            text, end = "", 0
        elif offset is not None:
            data, end = read_from(path, offset, LOG_CHUNK_BYTES)
            text = data.decode("utf-8", errors="replace")
        else:
            lines, end = tail_lines(path, tail)
            text = "".join(line + "\n" for line in lines)
        headers = {"X-Jobsup-Log-Offset": str(end), "X-Jobsup-Attempt": str(number)}
        return PlainTextResponse(text, headers=headers)

    return app
