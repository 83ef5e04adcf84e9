"""The status page (issue #17): server-side HTML of the jobs, one job and a pipeline, for
people without Grafana or on a laptop over an SSH tunnel.

Pages and their live fragments are rendered here from the API's own response models
(`api/views.py`), with `supervisor/formatting.py` for every byte count and duration; the
page's JS (`static/page.js`) swaps the fragments in every 2 s, draws the charts from
`GET /api/v1/jobs/{id}/samples` with the vendored uPlot, and tails the log. Nothing is
fetched from outside the daemon. Auth is the Guard's: the bearer token, or the session
cookie the login form here sets (docs/security.md)."""

import hashlib
import hmac
import shlex
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, PackageLoader, select_autoescape
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import Scope

from supervisor.api import listing
from supervisor.api.guard import SESSION_COOKIE, SESSION_MAX_AGE_S, session_value
from supervisor.api.metrics import mountpoint
from supervisor.api.models import AlertOut, JobOut
from supervisor.api.views import alert_out, job_out, shown_states
from supervisor.config import Settings
from supervisor.errors import JobNotFound
from supervisor.formatting import MISSING, format_bytes, format_duration, format_number, iso
from supervisor.observe.view import JobView
from supervisor.spec import AlertState, JobState, stored_spec
from supervisor.storage import store
from supervisor.storage.tables import Job

PUBLIC_PATHS = frozenset({"/login"})
"""The login form's POST: it carries the token, so it cannot need it (the Guard's Host
and Origin checks still apply)."""
STATIC_DIR = Path(__file__).parent / "static"
DOCS_PATH = "/docs"
"""The API's interactive docs: Swagger UI from `static/` (vendored, static/VENDORED.md),
never a CDN, so the page's CSP holds and the login's cookie may open it."""
PIPELINE_STEPS = ("generate", "serve", "extract", "vocab", "train", "evaluate")
"""The EAGLE-3 steps in pipeline order (`supervisor/pipeline.py`'s `step` labels)."""
NO_STORE = {
    "Cache-Control": "no-store",
    # only the daemon's own scripts, styles and connections; never inside another site's
    # frame (a framed page's Stop button is a click away from a hostile page: clickjacking)
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "style-src 'self' 'unsafe-inline'; frame-ancestors 'none'; "
                               "base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",  # not no-referrer: its form POSTs say `Origin: null`
}
LOGIN_HEADERS = {**NO_STORE, "WWW-Authenticate": "Bearer"}

_templates = Environment(loader=PackageLoader("supervisor.api", "templates"),
                         autoescape=select_autoescape(["html"]), trim_blocks=True,
                         lstrip_blocks=True, auto_reload=False,
                         finalize=lambda value: MISSING if value is None else value)
"""`auto_reload=False`: the templates are the package's files, which do not change
while the daemon runs; with it on, the table's `{% include %}` per row statted its file
twice (~6 % of `/`'s time at 100 rows). `finalize`: a value not known yet reads `-`,
never `None`; numbers go through the `number` filter, which does the same (a `%`
format of `None` in a template was an HTTP 500 for the whole page)."""
_templates.filters.update(bytes=format_bytes, duration=format_duration, number=format_number)


def is_page_path(path: str) -> bool:
    """A path of the status page (the login form answers these without auth), the API's
    docs among them: served from the daemon's own files, they open with the session."""
    return path in ("/", DOCS_PATH) or path.startswith(("/jobs/", "/pipelines/"))


def render(template: str, status_code: int = 200, headers: Mapping[str, str] = NO_STORE,
           /, **context: Any) -> HTMLResponse:
    return HTMLResponse(_templates.get_template(template).render(**context),
                        status_code=status_code, headers=dict(headers))


def login_page(scope: Scope) -> Response | None:
    """The Guard's answer to a page request without the token or a session: the login
    form (401), which returns the user to the page asked for. None for anything else
    (the API keeps its JSON 401)."""
    if scope["method"] not in ("GET", "HEAD") or not is_page_path(scope["path"]):
        return None
    query = scope.get("query_string", b"").decode("latin-1")
    return render("login.html", 401, LOGIN_HEADERS,
                  next=scope["path"] + (f"?{query}" if query else ""), error=None)


def safe_next(target: str) -> str:
    """A same-origin path to return to after the login, never another site (`//host`,
    `/\\host`, a scheme)."""
    if not target.startswith("/") or target.startswith(("//", "/\\")) or any(
            c in target for c in "\\\r\n\t"):
        return "/"
    return target


# -- what the templates show -------------------------------------------------------------

@dataclass(frozen=True)
class Filesystem:
    """Disk runway of one filesystem that running jobs write to."""

    mountpoint: str
    free_bytes: int | None
    remaining_bytes: int
    """What its running jobs are still projected to write."""
    full_in_s: float | None
    """The soonest any of them fills it."""
    jobs: int
    fits: bool
    """False when some job's remaining output does not fit (its `will_fit`)."""


def filesystems(jobs: Iterable[tuple[str | None, JobView | None]]) -> list[Filesystem]:
    """The filesystems of the running jobs, from each one's output dir and view (not its
    JobOut: a thousand running jobs are shown every 2 s)."""
    grouped: dict[str, list[JobView]] = {}
    for output_dir, view in jobs:
        if output_dir and view is not None:
            mount = mountpoint(output_dir)
            if mount:
                grouped.setdefault(mount, []).append(view)
    out = []
    for mount, members in sorted(grouped.items()):
        forecasts = [view.forecast for view in members]
        free = [f.disk_free_bytes for f in forecasts if f.disk_free_bytes is not None]
        full_in = [f.disk_full_in_s for f in forecasts if f.disk_full_in_s is not None]
        remaining = sum(max(view.forecast.projected_total_bytes - view.progress.bytes_written, 0)
                        for view in members if view.forecast.projected_total_bytes is not None)
        out.append(Filesystem(mount, min(free) if free else None, remaining,
                              min(full_in) if full_in else None, len(members),
                              all(f.will_fit is not False for f in forecasts)))
    return out


def percent(job: JobOut) -> float | None:
    done, total = job.progress.items_done, job.progress.items_total
    if done is None or not total:
        return None
    return max(0.0, min(100.0, 100.0 * done / total))


def rate_text(rate: float | None) -> str:
    """Items per second for people; a count, not a size or a span."""
    if rate is None:
        return MISSING
    if rate >= 1 or rate == 0:
        return f"{rate:.3g}/s"
    return f"{rate * 60:.3g}/min" if rate * 60 >= 1 else f"{rate * 3600:.3g}/h"


@dataclass(frozen=True)
class Pipeline:
    name: str
    steps: list[JobOut]
    """The latest run's jobs in step order."""
    current: JobOut | None
    """The step it is at: the first that has not succeeded (None: all succeeded)."""
    runs: int


def pipelines(jobs: Sequence[JobOut]) -> dict[str, list[list[JobOut]]]:
    """Pipeline name -> its runs (oldest first), each its jobs in submission order. A
    run begins with a `generate` step (pipelines are submitted all at once)."""
    runs: dict[str, list[list[JobOut]]] = {}
    for job in jobs:
        name = job.spec.labels.get("pipeline_name")
        if not name or "pipeline" not in job.spec.labels:
            continue
        named = runs.setdefault(name, [])
        if not named or job.spec.labels.get("step") == "generate":
            named.append([])
        named[-1].append(job)
    return runs


def pipeline_view(name: str, runs: list[list[JobOut]]) -> Pipeline:
    order = {step: i for i, step in enumerate(PIPELINE_STEPS)}
    steps = sorted(runs[-1], key=lambda j: order.get(j.spec.labels.get("step", ""),
                                                        len(order)))
    current = next((j for j in steps if j.state is not JobState.SUCCEEDED
                    and j.spec.labels.get("step") != "serve"), None)
    return Pipeline(name, steps, current, len(runs))


@dataclass(frozen=True)
class Dependency:
    """A job another waits for, as its page links it."""

    id: str
    name: str | None
    """None: no such job any more."""
    state: str | None


def dependency(session: Session, job_id: str) -> Dependency:
    try:
        row = store.get_job(session, job_id)
    except JobNotFound:
        return Dependency(job_id, None, None)
    return Dependency(row.id, row.name, row.state)


TABLE_PAGE = 100
"""Jobs per page of the table (`/`): what a refresh every 2 s renders."""


@dataclass(frozen=True)
class TableQuery:
    """What the table shows: its filters, its order and its page, from the URL's query
    (read leniently: a URL typed by hand shows what it can, never an error)."""

    state: JobState | None = None
    label: str = ""
    q: str = ""
    """A part of the name or the id."""
    sort: listing.SortKey = "created"
    descending: bool = True
    page: int = 1

    @property
    def labels(self) -> dict[str, str]:
        key, equals, value = self.label.partition("=")
        return {key: value} if equals and key else {}

    def link(self, **changed: Any) -> str:
        """The query string of this view with some of it changed (a page 1 where the
        order or a filter changes)."""
        values = {"state": self.state.value if self.state else "", "label": self.label,
                  "q": self.q, "sort": self.sort if self.sort != "created" else "",
                  "dir": "" if self.descending else "asc",
                  "page": str(self.page) if self.page > 1 else "", **changed}
        return urlencode({k: v for k, v in values.items() if v})

    def sort_link(self, key: str) -> str:
        """Sorted by `key`: newest / largest first, or the other way on a second click;
        names and states A to Z first."""
        if key == self.sort:
            return self.link(sort=key if key != "created" else "",
                             dir="" if not self.descending else "asc", page="")
        ascending = key in ("name", "state")
        return self.link(sort=key if key != "created" else "", dir="asc" if ascending else "",
                         page="")


def table_query(state: str | None = None,
                label: Annotated[str | None, Query(max_length=1000)] = None,
                q: Annotated[str | None, Query(max_length=200)] = None,
                sort: str | None = None, dir: str | None = None,  # noqa: A002 - the URL's
                page: str | None = None) -> TableQuery:
    try:
        shown_state = JobState(state) if state else None
    except ValueError:
        shown_state = None
    key = sort if sort in listing.SORT_KEYS else "created"
    number = int(page) if page and page.isdigit() else 1
    return TableQuery(state=shown_state, label=label or "", q=(q or "").strip(),
                      sort=key, descending=dir != "asc",
                      page=max(1, min(number, 1_000_000)))


def duration_s(job: JobOut, now: float) -> float | None:
    """How long the job ran: from its start to its end, or to now."""
    if job.started_at is None:
        return None
    started = datetime.fromisoformat(job.started_at).timestamp()
    ended = datetime.fromisoformat(job.ended_at).timestamp() if job.ended_at else now
    return max(0.0, ended - started)


def pipeline_names(spec_jsons: Iterable[str]) -> list[str]:
    """The names of the pipelines these specs' jobs belong to, sorted."""
    names = set()
    for spec_json in spec_jsons:
        labels = stored_spec(spec_json).labels
        if "pipeline" in labels and labels.get("pipeline_name"):
            names.add(labels["pipeline_name"])
    return sorted(names)


# -- the routes --------------------------------------------------------------------------

def mount(app: FastAPI, settings: Settings, sessions: sessionmaker[Session], *,
          views: Callable[[], Mapping[str, JobView]]) -> None:
    """Add the status page's routes and static files to the API's app."""
    router = APIRouter(include_in_schema=False)
    host = settings.resolved_hostname

    def db() -> Iterator[Session]:
        with sessions() as session:
            yield session

    DB = Annotated[Session, Depends(db)]

    def jobs_out(session: Session, rows: Iterable[Job]) -> list[JobOut]:
        current = views()
        firing = store.firing_alerts_by_job(session)
        return [job_out(j, current.get(j.id), alerts=firing.get(j.id, ())) for j in rows]

    pipelines_known: list[tuple[int, list[str]]] = [(-1, [])]
    """(how many jobs there were, the names of their pipelines): jobs are only added,
    never removed or changed in their labels, so the names change only with the count
    (a search of every stored spec took ~15 ms at 10,000 jobs, each view of `/`; #30)."""

    def pipelines_of(session: Session, jobs: int) -> list[str]:
        known_jobs, names = pipelines_known[0]
        if known_jobs != jobs:
            names = pipeline_names(store.spec_jsons_like(session, '%"pipeline_name"%'))
            pipelines_known[0] = (jobs, names)
        return names

    def jobs_context(session: Session, query: TableQuery) -> dict[str, Any]:
        current = views()
        shown = shown_states(current)
        counts = store.count_by_state(session)
        jobs = sum(counts.values())
        for job_id, state in shown.items():  # ends not recorded yet count as shown
            if job_id in current and counts.get(JobState.RUNNING.value, 0):
                counts[JobState.RUNNING.value] -= 1
                counts[state.value] = counts.get(state.value, 0) + 1
        wanted = listing.JobFilter(state=query.state, labels=query.labels, search=query.q)
        page = listing.page_of_jobs(session, wanted, limit=TABLE_PAGE, sort=query.sort,
                                    descending=query.descending,
                                    offset=(query.page - 1) * TABLE_PAGE,
                                    shown_states=shown, now=time.time())
        running = store.output_dirs_of_running(session)
        return {"jobs": jobs_out(session, page.jobs), "matching": page.total,
                "total": jobs, "counts": {k: v for k, v in counts.items() if v},
                "host": host, "table": query, "firing": store.count_firing_alerts(session),
                "first": (query.page - 1) * TABLE_PAGE + 1,
                "pages": max(1, -(-page.total // TABLE_PAGE)),
                "filesystems": filesystems((output_dir, current.get(job_id))
                                           for job_id, output_dir in running),
                "pipelines": pipelines_of(session, jobs),
                "states": list(JobState), "sort_keys": listing.SORT_KEYS,
                "percent": percent, "rate_text": rate_text, "command_text": shlex.join,
                "duration_s": duration_s, "now": time.time()}

    @router.get("/", response_class=HTMLResponse)
    def jobs_page(session: DB, query: Annotated[TableQuery, Depends(table_query)]) -> Response:
        return render("jobs.html", **jobs_context(session, query), token=bool(settings.token))

    @router.get("/fragments/jobs", response_class=HTMLResponse)
    def jobs_fragment(session: DB,
                      query: Annotated[TableQuery, Depends(table_query)]) -> Response:
        return render("_jobs.html", **jobs_context(session, query))

    def job_context(session: Session, job_id: str) -> dict[str, Any]:
        row = store.get_job(session, job_id)
        rows = [a for a in store.alerts(session) if a.job_id == job_id]
        alerts: list[AlertOut] = [alert_out(a) for a in rows]
        job = job_out(row, views().get(job_id),
                      alerts=[a for a in rows if a.state == AlertState.FIRING.value])
        events = [(iso(e.t), e.from_state, e.to_state, e.reason)
                  for e in store.events(session, job_id)]
        return {"job": job, "alerts": list(reversed(alerts)), "events": events,
                "host": host, "percent": percent, "rate_text": rate_text,
                "command": shlex.join(job.spec.command),
                "dependencies": [dependency(session, dep) for dep in job.spec.depends_on],
                "duration_s": None if row.started_at is None
                else (row.ended_at or time.time()) - row.started_at,
                "pipeline": job.spec.labels.get("pipeline_name")
                if "pipeline" in job.spec.labels else None}

    @router.get("/jobs/{job_id}", response_class=HTMLResponse)
    def job_page(job_id: str, session: DB) -> Response:
        """The job's page; a name or the start of an id (`store.find_job`) redirects to
        the page at its id."""
        found = store.find_job(session, job_id).id
        if found != job_id:
            return RedirectResponse(f"/jobs/{found}", status_code=307, headers=NO_STORE)
        return render("job.html", **job_context(session, job_id), token=bool(settings.token))

    @router.get("/fragments/jobs/{job_id}", response_class=HTMLResponse)
    def job_fragment(job_id: str, session: DB) -> Response:
        return render("_job.html", **job_context(session, job_id))

    @router.get(DOCS_PATH, response_class=HTMLResponse)
    def api_docs() -> Response:
        return render("docs.html", host=host)

    def pipeline_context(session: Session, name: str) -> dict[str, Any]:
        rows = store.list_jobs(session, spec_like='%"pipeline_name"%')
        runs = pipelines(jobs_out(session, rows)).get(name)
        return {"pipeline": pipeline_view(name, runs) if runs else None, "name": name,
                "host": host, "percent": percent, "rate_text": rate_text}

    @router.get("/pipelines/{name}", response_class=HTMLResponse)
    def pipeline_page(name: str, session: DB) -> Response:
        context = pipeline_context(session, name)
        return render("pipeline.html", 200 if context["pipeline"] else 404, **context,
                      token=bool(settings.token))

    @router.get("/fragments/pipelines/{name}", response_class=HTMLResponse)
    def pipeline_fragment(name: str, session: DB) -> Response:
        context = pipeline_context(session, name)
        return render("_pipeline.html", 200 if context["pipeline"] else 404, **context)

    @router.post("/login")
    async def login(request: Request) -> Response:
        """The login form's POST (urlencoded `token`, `next`): a session cookie and back
        to the page, or the form again. The token travels in the body, never a URL."""
        form = parse_qs((await request.body()).decode("utf-8", errors="replace"))
        given = form.get("token", [""])[0]
        target = safe_next(form.get("next", ["/"])[0])
        if not settings.token:
            return RedirectResponse(target, status_code=303)
        if not hmac.compare_digest(hashlib.sha256(given.encode()).digest(),
                                   hashlib.sha256(settings.token.encode()).digest()):
            return render("login.html", 401, LOGIN_HEADERS, next=target, error="wrong token")
        expires_at = int(time.time()) + SESSION_MAX_AGE_S
        answer = RedirectResponse(target, status_code=303, headers=NO_STORE)
        answer.set_cookie(SESSION_COOKIE, session_value(settings.token, expires_at),
                          max_age=SESSION_MAX_AGE_S, path="/", httponly=True,
                          samesite="strict", secure=request.url.scheme == "https")
        return answer

    @router.post("/logout")
    def logout() -> Response:
        answer = RedirectResponse("/", status_code=303, headers=NO_STORE)
        answer.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
        return answer

    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
