"""One page of the jobs, for `GET /api/v1/jobs` and the status page's table: filters (a
state, labels, a search in names and ids), an order (newest first by default), where the
page begins (the API's cursor, the table's numbered pages) and how many match in all.

Thousands of jobs are normal (a sweep, months of history: #30), so a page is a query of
its own rows: the filters and the order are SQL where they can be. Two cannot always
be: a label (inside the stored spec's JSON: a LIKE narrows the rows, then each one's
labels are read) and the state of a job whose end the database has not taken yet (shown
from memory, `JobView.unrecorded_end`). Then the matching rows' keys are read (a few
columns each) and checked here, and only the page's rows loaded."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sqlalchemy import ColumnElement, and_, func, literal, or_, select
from sqlalchemy.orm import Session

from supervisor.errors import InvalidSpec
from supervisor.spec import JobState
from supervisor.storage import store
from supervisor.storage.tables import Job

API_PAGE_DEFAULT = 100
"""Jobs in a `GET /api/v1/jobs` answer without `limit`."""
API_PAGE_MAX = 1000
"""The largest `limit`: ~1 MB of JSON, ~0.2 s to build on a small machine."""

SortKey = Literal["created", "name", "state", "started", "ended", "duration"]
SORT_KEYS: tuple[SortKey, ...] = ("created", "name", "state", "started", "ended", "duration")
"""The columns a page can be sorted by (the table's headers); ties by submission."""

LIKE_ESCAPE = "\\"


@dataclass(frozen=True)
class JobFilter:
    state: JobState | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    search: str | None = None
    """A part of the job's name or id, any case."""


@dataclass(frozen=True)
class JobPage:
    jobs: list[Job]
    """The page's rows, in order."""
    total: int
    """Jobs matching the filter, on every page."""
    next_cursor: str | None
    """Where the next page begins (`cursor=`); None on the last."""


def encode_cursor(job: Job) -> str:
    raw = json.dumps([job.created_at, job.id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    """(created_at, id) of the job a page ends with; InvalidSpec for anything else."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, job_id = json.loads(raw)
        if isinstance(created_at, int | float) and isinstance(job_id, str):
            return float(created_at), job_id
    except (ValueError, TypeError, binascii.Error):
        pass
    raise InvalidSpec("cursor: not a cursor of this API (use the `Link: rel=\"next\"` "
                      "header's URL of the page before)", field="cursor")


def page_of_jobs(session: Session, wanted: JobFilter, *, limit: int,
                 shown_states: Mapping[str, JobState] | None = None,
                 sort: SortKey = "created", descending: bool = True,
                 cursor: str | None = None, offset: int = 0, now: float = 0.0) -> JobPage:
    """The jobs matching `wanted`, sorted, `limit` of them from `cursor` (the API:
    sorted by submission only) or from `offset` (the table). `shown_states`: the state
    shown for a job whose end is not recorded yet, by id; `now` ends a running job's
    duration."""
    shown_states = shown_states or {}
    conditions = _conditions(wanted, shown_states)
    order = _order(sort, descending, now)
    after = decode_cursor(cursor) if cursor is not None else None
    if after is not None and sort != "created":
        raise InvalidSpec("cursor: pages by cursor are sorted by submission", field="cursor")
    if wanted.labels or (wanted.state is not None and shown_states):
        return _checked_page(session, wanted, conditions, order, shown_states, limit=limit,
                             after=after, descending=descending, offset=offset)
    total = session.scalar(select(func.count()).select_from(Job).where(*conditions)) or 0
    # the page's ids first, then their rows: sorting whole rows to pick 100 of 10,000
    # took SQLite ~40 ms (its sorter carries every column), the ids ~6 ms (#30)
    query = select(Job.id).where(*conditions).order_by(*order)
    if after is not None:
        query = query.where(_after(after, descending))
    ids = list(session.scalars(query.offset(offset).limit(limit + 1)))
    more = len(ids) > limit
    found = store.jobs_with_ids(session, ids[:limit])
    rows = [found[job_id] for job_id in ids[:limit] if job_id in found]
    return JobPage(rows, total, encode_cursor(rows[-1]) if more and rows else None)


def _checked_page(session: Session, wanted: JobFilter, conditions: list[ColumnElement[bool]],
                  order: list[Any], shown_states: Mapping[str, JobState], *, limit: int,
                  after: tuple[float, str] | None, descending: bool,
                  offset: int) -> JobPage:
    """The page where each candidate row is checked here: its labels, or its shown
    state. The keys of every candidate are read (four columns), the page's rows after."""
    keys = session.execute(select(Job.id, Job.created_at, Job.state, Job.spec_json)
                           .where(*conditions).order_by(*order)).all()
    matching = [(job_id, created_at) for job_id, created_at, state, spec_json in keys
                if _labels_match(spec_json, wanted.labels)
                and (wanted.state is None
                     or _shown(job_id, JobState(state), shown_states) is wanted.state)]
    start = offset + (_first_after(matching, after, descending) if after is not None else 0)
    chosen = matching[start:start + limit]
    rows = store.jobs_with_ids(session, [job_id for job_id, _ in chosen])
    jobs = [rows[job_id] for job_id, _ in chosen if job_id in rows]
    more = start + limit < len(matching)
    return JobPage(jobs, len(matching), encode_cursor(jobs[-1]) if more and jobs else None)


def _shown(job_id: str, stored: JobState, shown_states: Mapping[str, JobState]) -> JobState:
    """The state the API shows: an end not recorded yet, of a job stored running."""
    return shown_states.get(job_id, stored) if stored is JobState.RUNNING else stored


def _first_after(matching: Sequence[tuple[str, float]], after: tuple[float, str],
                 descending: bool) -> int:
    """The index of the first key past the cursor's (the cursor's job may have gone)."""
    created_at, job_id = after
    for index, (other_id, other_created_at) in enumerate(matching):
        past = ((other_created_at, other_id) < (created_at, job_id) if descending
                else (other_created_at, other_id) > (created_at, job_id))
        if past:
            return index
    return len(matching)


def _labels_match(spec_json: str, labels: Mapping[str, str]) -> bool:
    if not labels:
        return True
    try:
        stored = json.loads(spec_json).get("labels")
    except (ValueError, AttributeError):
        return False
    return isinstance(stored, dict) and all(stored.get(k) == v for k, v in labels.items())


def _like_escaped(text: str) -> str:
    return (text.replace(LIKE_ESCAPE, LIKE_ESCAPE * 2).replace("%", LIKE_ESCAPE + "%")
            .replace("_", LIKE_ESCAPE + "_"))


def _json_plain(text: str) -> bool:
    """`text` reads the same inside the stored JSON (nothing JSON escapes in it)."""
    return all(c >= " " and c not in '"\\' and c != "\x7f" for c in text)


def _conditions(wanted: JobFilter,
                shown_states: Mapping[str, JobState]) -> list[ColumnElement[bool]]:
    conditions: list[ColumnElement[bool]] = []
    if wanted.state is not None:
        stored = Job.state == wanted.state.value
        # a job shown ended from memory is `running` in its row: a candidate too
        conditions.append(or_(stored, Job.id.in_(list(shown_states))) if shown_states
                          else stored)
    for key, value in wanted.labels.items():
        if _json_plain(key) and _json_plain(value):  # a narrowing; each row checked after
            pattern = f'%"{_like_escaped(key)}":"{_like_escaped(value)}"%'
            conditions.append(Job.spec_json.like(pattern, escape=LIKE_ESCAPE))
    if wanted.search:
        pattern = f"%{_like_escaped(wanted.search.lower())}%"
        conditions.append(or_(func.lower(Job.name).like(pattern, escape=LIKE_ESCAPE),
                              Job.id.like(pattern, escape=LIKE_ESCAPE)))
    return conditions


def _order(sort: SortKey, descending: bool, now: float) -> list[Any]:
    """ORDER BY the key (jobs without one last, either way), then submission."""
    columns: dict[str, Any] = {
        "name": Job.name, "state": Job.state, "started": Job.started_at,
        "ended": Job.ended_at,
        "duration": func.coalesce(Job.ended_at, literal(now)) - Job.started_at}
    tie = [Job.created_at.desc(), Job.id.desc()] if descending else [Job.created_at, Job.id]
    if sort == "created":
        return tie
    key = columns[sort]
    return [(key.desc() if descending else key.asc()).nulls_last(), *tie]


def _after(after: tuple[float, str], descending: bool) -> ColumnElement[bool]:
    created_at, job_id = after
    if descending:
        return or_(Job.created_at < created_at,
                   and_(Job.created_at == created_at, Job.id < job_id))
    return or_(Job.created_at > created_at, and_(Job.created_at == created_at, Job.id > job_id))
