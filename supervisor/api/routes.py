"""FastAPI routes. Thin: validate, call the store, wake the engine, return.

In front of every route, `guard.Guard` (ASGI middleware) enforces what docs/security.md
promises: allowed Host, same Origin, the bearer token, the body cap."""


import errno
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, NamedTuple

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import StringConstraints
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from supervisor import __version__
from supervisor.api import listing, page
from supervisor.api.guard import Guard
from supervisor.api.models import AlertOut, ErrorOut, EventOut, HealthOut, JobOut, SampleOut
from supervisor.api.submission import submit_job
from supervisor.api.views import alert_out, event_out, job_out, sample_out, shown_states
from supervisor.config import Settings
from supervisor.errors import Conflict, InvalidSpec, JobsupError
from supervisor.observe.view import JobView
from supervisor.pipeline import Eagle3Pipeline, eagle3_jobs
from supervisor.runtime.fileio import read_from, tail_lines
from supervisor.runtime.files import log_path
from supervisor.spec import (
    MAX_INT64,
    AlertState,
    JobSpec,
    JobState,
    check_env,
    stored_spec,
)
from supervisor.storage import store
from supervisor.storage.database import sqlite_path
from supervisor.storage.tables import Job
from supervisor.storage.writability import Writability, unwritable_reason

log = logging.getLogger(__name__)

API_PREFIX = "/api/v1"
PUBLIC_PATHS = frozenset({"/healthz"})
LOG_CHUNK_BYTES = 1 << 20
"""Most bytes one `logs?offset=` answer carries."""
TICK_STALLED_INTERVALS = 5
TICK_STALLED_MIN_S = 5.0
"""/healthz answers 503 when the engine loop has not finished a tick for longer than
`max(TICK_STALLED_INTERVALS x sample_interval, TICK_STALLED_MIN_S)` seconds (10 s at the
default 2 s interval), or its last tick took that long: a healthy loop finishes one
every interval, in milliseconds to a few seconds (a first scan of a large output tree).
Not above SQLite's busy timeout (10 s): a loop whose every tick waits that long on a
locked database and then fails finishes ticks, yet supervises nothing; counting the
last tick's duration keeps that a steady 503, not one that flaps with each timeout."""


def tick_stalled_after_s(sample_interval: float) -> float:
    """Seconds without a finished tick (or of one tick) after which the engine counts
    as stalled."""
    return max(TICK_STALLED_INTERVALS * sample_interval, TICK_STALLED_MIN_S)


class TickTimes(NamedTuple):
    age_s: float
    """Seconds since the engine loop last finished a tick (one that raised too)."""
    duration_s: float
    """How long that tick took."""


def _errors(**described: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI responses, JSON whatever the route's own media type (a `model` would
    take the route's: text/plain for the logs)."""
    content = {"application/json": {"schema": ErrorOut.model_json_schema()}}
    return {int(code): {"description": text, "content": content}
            for code, text in described.items()}


GUARD_RESPONSES = _errors(**{
    "400": "malformed request (Content-Length)",
    "403": "Host or Origin not allowed (DNS rebinding, cross-site request)",
    "413": "request body too large (JOBSUP_MAX_BODY_BYTES)",
    "422": "invalid input; `error` names the field"})
"""What any route may answer besides its own: declared so the schema tells the truth."""
UNAUTHORIZED = _errors(**{"401": "missing or wrong bearer token"})
NOT_FOUND = _errors(**{
    "404": "no job with this id, name or start of an id",
    "400": "the name or start of an id names several jobs (`error` lists them)"})
JobReference = Annotated[str, PathParam(
    description="the job's id, its name, or the start of its id (as docker and git take "
                "them: `store.find_job`); one naming several jobs answers 400, listing them")]
LabelSelector = Annotated[str, StringConstraints(pattern=r"^[^=]+=")]


def _validation_message(errors: list[Any]) -> str:
    parts = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
        field = ".".join(loc) or "body"
        parts.append(f"{field}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def create_app(settings: Settings, sessions: sessionmaker[Session], *,
               wake: Callable[[], None], views: Callable[[], Mapping[str, JobView]],
               registry: CollectorRegistry | None = None,
               clock: Callable[[], float] = time.time,
               last_tick: Callable[[], TickTimes | None] = lambda: None,
               writability: Writability | None = None) -> FastAPI:
    """The API over a store. `wake` asks the engine for a tick (after a submit or stop);
    `views` returns the engine's latest per-job progress, forecast and resources;
    `clock` is the engine's, so a stop's time and the engine's timeouts agree;
    `last_tick` says when the engine loop last finished a tick and how long it took
    (/healthz); `writability` whether the database takes writes (the engine's: the API
    reports its refused writes to it, /healthz reads it)."""
    writes = writability or Writability()
    public_paths = PUBLIC_PATHS | page.PUBLIC_PATHS | (
        {"/metrics"} if settings.metrics_public else frozenset())
    # docs_url=None: /docs is the status page's (page.py), with Swagger UI from the
    # daemon's own files, not FastAPI's CDN
    app = FastAPI(title="jobsup", version=__version__, docs_url=None,
                  responses={**GUARD_RESPONSES, **(UNAUTHORIZED if settings.token else {})})
    if settings.token:
        _declare_bearer_auth(app, public_paths)

    app.add_middleware(Guard, settings=settings, public_paths=public_paths,
                       login_page=page.login_page)

    add_error_handlers(app, settings, writes)
    add_health_routes(app, settings, registry=registry, last_tick=last_tick, writes=writes)
    add_job_routes(app, settings, sessions, wake=wake, views=views, clock=clock)
    page.mount(app, settings, sessions, views=views)  # the status page: /, /jobs/{id}, ...
    return app


def add_error_handlers(app: FastAPI, settings: Settings, writes: Writability) -> None:
    """Every error as JSON `{error, hint, field}`: typed errors, a database or data dir
    that cannot be written (503, retry), HTTP errors, invalid requests (422)."""
    @app.exception_handler(JobsupError)
    async def jobsup_error(_request: Request, exc: JobsupError) -> JSONResponse:
        body = {"error": exc.message, "hint": exc.hint, "field": exc.field}
        return JSONResponse(body, status_code=exc.status_code)

    @app.exception_handler(OperationalError)
    async def database_unavailable(request: Request, exc: OperationalError) -> JSONResponse:
        """The database cannot take the write (its disk is full, it is read-only, or it
        is locked): a 503 the client can retry, never a bare 500."""
        reason = unwritable_reason(exc)
        local = sqlite_path(settings.resolved_database_url) is not None
        if reason is not None:
            writes.failed(reason, f"{request.method} {request.url.path}")
        if store.is_disk_full(exc):
            where = (f"the filesystem of {settings.data_dir} (df -h {settings.data_dir})"
                     if local else "the database server's disk")
            body = {"error": "the daemon's database cannot be written: its disk is full; "
                             "nothing was recorded",
                    "hint": f"free space on {where}, then retry", "field": None}
        elif reason is not None:
            where = (f"{settings.data_dir} and the database files in it (jobsup.db, "
                     "jobsup.db-wal, jobsup.db-shm)" if local else "the database")
            body = {"error": f"the daemon's database cannot be written: {reason}; nothing "
                             "was recorded",
                    "hint": f"make {where} writable for the daemon's user, then retry "
                            "(no restart needed)", "field": None}
        else:
            # the driver's message only: str(exc) would log the statement's parameters,
            # a submitted spec's env values among them
            log.warning("database error answered 503: %s", exc.orig)
            body = {"error": "the daemon's database is unavailable right now; nothing was "
                             "recorded", "hint": "retry in a few seconds", "field": None}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "10"})

    @app.exception_handler(OSError)
    async def storage_error(_request: Request, exc: OSError) -> JSONResponse:
        """A file of the data dir could not be written (a job's record at submit)."""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            body = {"error": f"the daemon's data dir is full ({exc.strerror}); nothing was "
                             "recorded",
                    "hint": f"free space on the filesystem of {settings.data_dir} "
                            f"(df -h {settings.data_dir}), then retry", "field": None}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "10"})
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            body = {"error": f"the daemon's data dir cannot be written ({exc.strerror}); "
                             "nothing was recorded",
                    "hint": f"make {settings.data_dir} writable for the daemon's user, then "
                            "retry", "field": None}
            return JSONResponse(body, status_code=503, headers={"Retry-After": "10"})
        log.error("file error answered 500: %s", exc)
        return JSONResponse({"error": f"the daemon could not access a file: {exc.strerror}",
                             "hint": "see the daemon's log", "field": None}, status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # every method of the path, not only one route's
            headers["Allow"] = ", ".join(_allowed_methods(app, request.scope))
        return JSONResponse({"error": str(exc.detail), "hint": None, "field": None},
                            status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")}
                  for e in exc.errors()]
        return JSONResponse({"error": _validation_message(errors), "detail": errors},
                            status_code=422)


def add_health_routes(app: FastAPI, settings: Settings, *, registry: CollectorRegistry | None,
                      last_tick: Callable[[], TickTimes | None], writes: Writability) -> None:
    """`/healthz` (the engine loop's pace, the database's writability) and `/metrics`."""
    stalled_after_s = tick_stalled_after_s(settings.sample_interval)

    @app.get("/healthz", response_model=HealthOut, responses={503: {
        "model": HealthOut, "description": "the engine loop has not ticked for "
                                           "several intervals (it is blocked)"}})
    async def healthz() -> JSONResponse:
        """200 while the engine loop ticks, 503 once it has not finished a tick for
        several intervals (or its last tick took that long). `degraded` (still 200: the
        daemon watches its jobs, and a watchdog's restart would not mend a disk) while
        the database refuses writes. Async on purpose: it
        answers even when every worker thread waits on a locked database."""
        times = last_tick()
        if times is None:
            return JSONResponse({"status": "ok", "last_tick_age_s": None})
        age, duration = round(times.age_s, 3), round(times.duration_s, 3)
        if max(age, duration) <= stalled_after_s:
            refused = writes.reason
            if refused is None:
                return JSONResponse({"status": "ok", "last_tick_age_s": age,
                                     "last_tick_duration_s": duration})
            return JSONResponse(HealthOut(
                status="degraded", last_tick_age_s=age, last_tick_duration_s=duration,
                error=f"the database cannot be written: {refused}; jobs are watched and "
                      "their ends and alerts sent, but nothing new is recorded and "
                      "submits answer 503",
                hint="free space under the database, or make it writable again: the daemon "
                     "takes writes again within a tick, without a restart (a restart "
                     "would not help)").model_dump())
        what = (f"has not finished a tick for {age:.0f} s" if age > stalled_after_s
                else f"took {duration:.0f} s for its last tick")
        body = HealthOut(
            status="stalled", last_tick_age_s=age, last_tick_duration_s=duration,
            error=f"the engine {what} (one is due every {settings.sample_interval:g} s): "
                  f"jobs are not being watched",
            hint="it is blocked, e.g. on a locked database or a hung filesystem; the daemon "
                 "log tells where. Restarting the daemon is safe: jobs keep running")
        return JSONResponse(body.model_dump(), status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> Response:
        data = generate_latest(registry) if registry is not None else b""
        return Response(data, media_type=CONTENT_TYPE_LATEST)


def add_job_routes(app: FastAPI, settings: Settings, sessions: sessionmaker[Session], *,
                   wake: Callable[[], None], views: Callable[[], Mapping[str, JobView]],
                   clock: Callable[[], float]) -> None:
    """The API's routes under `/api/v1`: jobs (submit, list, get, events, stop, restart),
    pipelines, alerts, samples and logs."""
    default_cwd = os.getcwd()

    def db() -> Iterator[Session]:
        with sessions() as session:
            yield session

    DB = Annotated[Session, Depends(db)]

    @app.post(f"{API_PREFIX}/jobs", status_code=201)
    def submit(spec: JobSpec, session: DB) -> JobOut:
        check_env(spec.env, settings.allowed_env)
        job, warnings = submit_job(session, spec, default_cwd=default_cwd, views=views(),
                                   default_backend=settings.backend, now=clock())
        session.commit()
        wake()
        return job_out(job, None, warnings=warnings)

    @app.post(f"{API_PREFIX}/pipelines/eagle3", status_code=201)
    def submit_eagle3(params: Eagle3Pipeline, session: DB) -> list[JobOut]:
        """The four EAGLE-3 steps (and the target's server, with `serve`) as jobs
        chained with `depends_on`; all or nothing."""
        check_env(params.env, settings.allowed_env)
        submitted: dict[str, tuple[Job, list[str]]] = {}  # by step, in submission order
        for spec in eagle3_jobs(params, resolve=lambda step: submitted[step][0].id):
            submitted[spec.labels["step"]] = submit_job(
                session, spec, default_cwd=default_cwd, views=views(),
                default_backend=settings.backend, now=clock())
        session.commit()
        wake()
        return [job_out(job, None, warnings=warnings)
                for job, warnings in submitted.values()]

    @app.get(f"{API_PREFIX}/jobs")
    def list_jobs(
        request: Request, response: Response, session: DB, state: JobState | None = None,
        label: Annotated[list[LabelSelector] | None,
                         Query(description="key=value, repeatable")] = None,
        limit: Annotated[int, Query(ge=1, le=listing.API_PAGE_MAX,
                                    description="jobs per page")] = listing.API_PAGE_DEFAULT,
        cursor: Annotated[str | None, Query(
            max_length=200, description="where the page begins: the `Link: rel=\"next\"` "
                                        "header's URL of the page before has it")] = None,
        order: Literal["newest", "oldest"] = "newest",
    ) -> list[JobOut]:
        """A page of jobs, newest first (`order=oldest`: by submission). Headers:
        `X-Total-Count` (the jobs matching the filters, on every page) and, unless this
        is the last page, `Link: <URL>; rel="next"`."""
        wanted = listing.JobFilter(state=state,
                                   labels=dict(item.partition("=")[::2] for item in label or []))
        current = views()
        page = listing.page_of_jobs(session, wanted, limit=limit, cursor=cursor,
                                    descending=order == "newest",
                                    shown_states=shown_states(current))
        firing = store.firing_alerts_by_job(session)
        response.headers["X-Total-Count"] = str(page.total)
        if page.next_cursor is not None:
            following = request.url.include_query_params(cursor=page.next_cursor)
            response.headers["Link"] = f'<{following.path}?{following.query}>; rel="next"'
        return [job_out(j, current.get(j.id), alerts=firing.get(j.id, ())) for j in page.jobs]

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}", responses=NOT_FOUND)
    def get_job(job_id: JobReference, session: DB) -> JobOut:
        job = store.find_job(session, job_id)
        job_id = job.id
        firing = store.firing_alerts_by_job(session, job_id=job_id)
        return job_out(job, views().get(job_id), alerts=firing.get(job_id, ()))

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}/events", responses=NOT_FOUND)
    def job_events(job_id: JobReference, session: DB) -> list[EventOut]:
        job_id = store.find_job(session, job_id).id
        return [event_out(e) for e in store.events(session, job_id)]

    @app.post(f"{API_PREFIX}/jobs/{{job_id}}/stop", status_code=202,
              responses={**NOT_FOUND, **_errors(**{"409": "the job already ended"})})
    def stop_job(job_id: JobReference, session: DB) -> JobOut:
        job = store.find_job(session, job_id)
        job_id = job.id
        if JobState(job.state).ended:
            raise Conflict(f"job {job_id} already ended ({job.state})")
        store.request_stop(session, job_id, now=clock())
        session.commit()
        wake()
        session.refresh(job)
        return job_out(job, views().get(job_id))

    @app.post(f"{API_PREFIX}/jobs/{{job_id}}/restart", status_code=202,
              responses={**NOT_FOUND, **_errors(**{"409": "the job has not ended"})})
    def restart_job(job_id: JobReference, session: DB) -> JobOut:
        """A new attempt of an ended job: pending again (attempt + 1 once it starts),
        its history kept. A pending or running job answers 409: stop it first."""
        job = store.requeue(session, store.find_job(session, job_id).id, now=clock())
        session.commit()
        answer = job_out(job, None)  # as requeued: the tick woken next may start it at once
        wake()
        return answer

    @app.post(f"{API_PREFIX}/jobs:restart", status_code=202)
    def restart_jobs(
        session: DB, state: Literal["failed", "stopped", "lost"] = "failed",
        label: Annotated[list[LabelSelector] | None,
                         Query(description="key=value, repeatable")] = None,
    ) -> list[JobOut]:
        """Restart every job in this ended state (with these labels), oldest first, as
        `POST /jobs/{id}/restart` does each (supervisord's `restart all`; the page's
        "restart all failed"): a job and the dependents its failure failed run again in
        order. The jobs restarted; none is an empty list."""
        wanted = dict(item.partition("=")[::2] for item in label or [])
        restarted = []
        for row in store.list_jobs(session, state=JobState(state)):
            if all(stored_spec(row.spec_json).labels.get(k) == v for k, v in wanted.items()):
                restarted.append(store.requeue(session, row.id, now=clock()))
        session.commit()
        answer = [job_out(job, None) for job in restarted]
        if restarted:
            wake()
        return answer

    @app.get(f"{API_PREFIX}/alerts")
    def list_alerts(session: DB, state: AlertState | None = None) -> list[AlertOut]:
        return [alert_out(a) for a in store.alerts(session, state=state)]

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}/samples", responses=NOT_FOUND)
    def job_samples(
        job_id: JobReference, session: DB, since: datetime | None = None,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    ) -> list[SampleOut]:
        """Stored readings, oldest first: from `since` on, else the latest `limit`."""
        job_id = store.find_job(session, job_id).id
        # ISO times carry microseconds, rounded: half a microsecond of slack keeps a
        # sample's own `t` inside `since=<that t>`
        if since is not None and since.tzinfo is None:
            since = since.replace(tzinfo=UTC)  # the contract's times are UTC
        rows = store.samples(session, job_id, limit=limit,
                             since=since.timestamp() - 5e-7 if since else None)
        return [sample_out(row) for row in rows]

    @app.get(f"{API_PREFIX}/jobs/{{job_id}}/logs", response_class=PlainTextResponse,
             responses=NOT_FOUND)
    def job_logs(
        job_id: JobReference, session: DB,
        tail: Annotated[int, Query(ge=0, le=1_000_000)] = 100,
        attempt: Annotated[int | None, Query(ge=1, le=MAX_INT64)] = None,
        offset: Annotated[int | None, Query(ge=0, le=MAX_INT64,
                                            description="bytes; for --follow")] = None,
    ) -> PlainTextResponse:
        """The last `tail` lines of the attempt's output, or (with `offset`) what follows
        that byte offset. Header `X-Jobsup-Log-Offset` says where to continue."""
        job = store.find_job(session, job_id)
        job_id, number = job.id, attempt or job.attempt
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


def _allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Every method some route serves at the request's path."""
    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches({**scope, "method": "GET"})
        route_methods = getattr(route, "methods", None)
        if match != Match.NONE and route_methods:
            methods |= set(route_methods)
    return sorted(methods)


def _declare_bearer_auth(app: FastAPI, public_paths: frozenset[str]) -> None:
    """Say in the OpenAPI schema what the Guard enforces: bearer auth on every operation
    but the public ones."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"bearer": []}]
            for path, operations in schema.get("paths", {}).items():
                if path in public_paths:
                    for operation in operations.values():
                        operation["security"] = []
                        operation.get("responses", {}).pop("401", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
