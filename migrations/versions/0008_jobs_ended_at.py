"""An index on jobs.ended_at: each tick asks for the jobs that ended in the last ten
minutes (their late alerts, their success messages), and without it that question read
every job the daemon ever ran: 7.8 ms per tick with 5,000 ended jobs, 0.16 ms with it
(#15).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_ended_at", "jobs", ["ended_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_ended_at", table_name="jobs")
