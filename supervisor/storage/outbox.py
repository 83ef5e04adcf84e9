"""The notification outbox: one row per message and destination, written in the same
transaction as what it tells (an alert, a job's end), then sent by the delivery thread
(`alerting/notify.py`), which records each attempt here before it is made and its
outcome after."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from supervisor.storage.tables import Notification

OUTCOME_COLUMNS = frozenset({"in_flight_since", "sent_at", "failed_at", "next_attempt_at",
                             "last_error", "redelivery"})
"""What an attempt's outcome may set."""


def add(session: Session, destinations: Iterable[str], *, kind: str, job_id: str,
        alert_id: int | None, payload_json: str, event_id: str, now: float) -> None:
    """One message for each destination, due now, in the caller's transaction."""
    for name in destinations:
        session.add(Notification(destination=name, kind=kind, job_id=job_id,
                                 alert_id=alert_id, payload_json=payload_json,
                                 created_at=now, attempts=0, next_attempt_at=now,
                                 event_id=event_id, redelivery=False))


def head(session: Session, destination: str) -> Notification | None:
    """The destination's oldest message neither sent nor given up (messages go out in
    order, one destination's failures never hold another's)."""
    return session.scalars(
        select(Notification)
        .where(Notification.destination == destination, Notification.sent_at.is_(None),
               Notification.failed_at.is_(None))
        .order_by(Notification.id).limit(1)
    ).first()


def start_attempt(row: Notification, *, now: float) -> None:
    """Count an attempt and mark it in flight (committed before the request is made). A
    row still in flight was being sent when a daemon died: it may have arrived, so this
    attempt is marked as a possible redelivery."""
    if row.in_flight_since is not None:
        row.redelivery = True
    row.attempts += 1
    row.in_flight_since = now


def record_outcome(session: Session, row_id: int, outcome: Mapping[str, Any]) -> bool:
    """An attempt's outcome (columns of OUTCOME_COLUMNS); False if the row is gone."""
    unknown = outcome.keys() - OUTCOME_COLUMNS
    if unknown:
        raise ValueError(f"not an outcome column: {sorted(unknown)}")
    row = session.get(Notification, row_id)
    if row is None:
        return False
    for column, value in outcome.items():
        setattr(row, column, value)
    return True


def jobs_notified(session: Session, kind: str, since: Mapping[str, float]) -> set[str]:
    """Which of these jobs already have a message of this kind in the outbox written at
    or after their time in `since` (the attempt's start: a job restarted by hand that
    succeeds again gets a message again)."""
    if not since:
        return set()
    rows = session.execute(
        select(Notification.job_id, func.max(Notification.created_at))
        .where(Notification.kind == kind, Notification.job_id.in_(list(since)))
        .group_by(Notification.job_id)).all()
    return {job_id for job_id, created_at in rows
            if job_id is not None and created_at >= since[job_id]}
