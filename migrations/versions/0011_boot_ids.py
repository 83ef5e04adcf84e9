"""jobs.pid_boot_id and jobs.shim_boot_id: the boot (`/proc/sys/kernel/random/boot_id`)
the worker and the shim started in, with their pid and start ticks their identity
(`procfs.is_same_process`). Start ticks count from each boot, and a process of another
boot was told apart by its create time, which is computed from the wall clock: a step of
more than an hour, then a daemon restart, made the daemon take its own jobs for
strangers and record them lost (#46). NULL in rows written before: those are matched by
create time as before, and a live shim's row gets this boot's id the first time it is
seen.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("pid_boot_id", sa.String(36)))
        batch.add_column(sa.Column("shim_boot_id", sa.String(36)))


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN, never a copy-and-swap of `jobs` (as 0006's downgrade)
    with op.batch_alter_table("jobs", recreate="never") as batch:
        batch.drop_column("shim_boot_id")
        batch.drop_column("pid_boot_id")
