"""jobs.data_dir_id and jobs.jobs_dir: the data dir (its id, `DATA_DIR/data_dir.json`,
and its jobs dir's path) of the daemon that launched the job's current attempt, where
its shim, log and exit record are. A daemon on another data dir with the same database
(`JOBSUP_DATABASE_URL`) saw none of them and ran a running job a second time; it now
refuses to start while such a job runs (#30, item 7). NULL in rows written before: the
data dir they ran from was not recorded.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("data_dir_id", sa.String(32)))
        batch.add_column(sa.Column("jobs_dir", sa.Text))


def downgrade() -> None:
    # ALTER TABLE ... DROP COLUMN, never a copy-and-swap of `jobs` (as 0006's downgrade)
    with op.batch_alter_table("jobs", recreate="never") as batch:
        batch.drop_column("jobs_dir")
        batch.drop_column("data_dir_id")
