"""Alerts and the notification outbox.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "alerts",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column(
            "job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("rule", sa.String(32), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("started_at", sa.Float, nullable=False),
        sa.Column("resolved_at", sa.Float),
        sa.Column("message", sa.Text, nullable=False),
    )
    op.create_index("ix_alerts_job_id", "alerts", ["job_id"])
    op.create_index("ix_alerts_state", "alerts", ["state"])
    # one firing alert per (job, rule), never duplicates
    op.create_index(
        "ux_alerts_firing", "alerts", ["job_id", "rule"], unique=True,
        sqlite_where=sa.text("state = 'firing'"), postgresql_where=sa.text("state = 'firing'"),
    )
    op.create_table(
        "notifications",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("destination", sa.String(16), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("job_id", sa.String(32)),
        sa.Column("alert_id", sa.Integer),
        sa.Column("payload_json", sa.Text, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("next_attempt_at", sa.Float, nullable=False),
        sa.Column("sent_at", sa.Float),
        sa.Column("failed_at", sa.Float),
        sa.Column("last_error", sa.Text),
    )
    op.create_index(
        "ix_notifications_pending", "notifications", ["destination", "sent_at", "failed_at"]
    )


def downgrade() -> None:
    op.drop_table("notifications")
    op.drop_table("alerts")
