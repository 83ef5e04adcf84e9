"""Processes are identified by (pid, start ticks): the start time after boot in clock
ticks, which no clock adjustment moves. The create time computed from /proc/stat's boot
time moves when the wall clock is stepped or slewed, so a daemon that had run for a while
found its own newly launched shims "gone" by create time. Rows written before this
revision keep their create times and are matched by them (`procfs.is_same_process`).

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("pid_start_ticks", sa.Integer))
        batch.add_column(sa.Column("shim_start_ticks", sa.Integer))


def downgrade() -> None:
    # never a copy-and-swap of `jobs` on SQLite (its DROP TABLE would delete every
    # sample, alert and event through ON DELETE CASCADE): ALTER TABLE ... DROP COLUMN
    with op.batch_alter_table("jobs", recreate="never") as batch:
        batch.drop_column("shim_start_ticks")
        batch.drop_column("pid_start_ticks")
