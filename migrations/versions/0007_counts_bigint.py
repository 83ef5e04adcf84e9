"""Counts that pass 2**31 are 64-bit on PostgreSQL: a worker's and a shim's start ticks
(after 248 days of uptime at 100 Hz), a sample's items done and total (tokens), and the
samples' ids (never reused: 100 a second pass 2**31 in 248 days) with their sequence. SQLite's
INTEGER is 64-bit already: nothing changes there (`tables.Count`).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

COLUMNS = (("jobs", "pid_start_ticks"), ("jobs", "shim_start_ticks"),
           ("samples", "items_done"), ("samples", "items_total"), ("samples", "id"))


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    for table, column in COLUMNS:
        op.alter_column(table, column, type_=sa.BigInteger(), existing_type=sa.Integer())
    op.execute("ALTER SEQUENCE IF EXISTS samples_id_seq AS bigint")


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    op.execute("ALTER SEQUENCE IF EXISTS samples_id_seq AS integer")
    for table, column in COLUMNS:
        op.alter_column(table, column, type_=sa.Integer(), existing_type=sa.BigInteger())
