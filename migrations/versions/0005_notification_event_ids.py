"""Notifications get an event id (what a receiver dedupes on) and record each delivery
attempt before its request leaves (`in_flight_since`), so a restarted daemon re-sends
only what a crash cut short, marked as a possible redelivery.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("notifications") as batch:
        batch.add_column(sa.Column("event_id", sa.String(36)))
        batch.add_column(sa.Column("in_flight_since", sa.Float))
        batch.add_column(sa.Column("redelivery", sa.Boolean, nullable=False,
                                   server_default=sa.false()))
    # rows already in the outbox: one id per message (the rows of its destinations were
    # written together: same time, kind, job and alert), never twice per destination
    conn = op.get_bind()
    ids: dict[tuple[object, ...], str] = {}
    used: set[tuple[str, str]] = set()
    for row in conn.execute(sa.text(
            "SELECT id, destination, created_at, kind, job_id, alert_id FROM notifications "
            "ORDER BY id")).all():
        key = (row.created_at, row.kind, row.job_id, row.alert_id)
        event_id = ids.setdefault(key, str(uuid.uuid4()))
        if (row.destination, event_id) in used:
            event_id = ids[key] = str(uuid.uuid4())
        used.add((row.destination, event_id))
        conn.execute(sa.text("UPDATE notifications SET event_id = :event_id WHERE id = :id"),
                     {"event_id": event_id, "id": row.id})
    with op.batch_alter_table("notifications") as batch:
        batch.alter_column("event_id", existing_type=sa.String(36), nullable=False)
        batch.create_index("ux_notifications_event", ["destination", "event_id"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("notifications") as batch:
        batch.drop_index("ux_notifications_event")
        batch.drop_column("redelivery")
        batch.drop_column("in_flight_since")
        batch.drop_column("event_id")
