"""Samples (one reading per job per tick) and the jobs' latest progress.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "samples",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column(
            "job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False
        ),
        sa.Column("t", sa.Float, nullable=False),
        sa.Column("items_done", sa.Integer),
        sa.Column("items_total", sa.Integer),
        sa.Column("files", sa.Integer, nullable=False, server_default="0"),
        sa.Column("bytes_written", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("cpu_percent", sa.Float, nullable=False, server_default="0"),
        sa.Column("cpu_time_s", sa.Float, nullable=False, server_default="0"),
        sa.Column("rss_bytes", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("read_bytes", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("write_bytes", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("num_procs", sa.Integer, nullable=False, server_default="0"),
        sa.Column("num_threads", sa.Integer, nullable=False, server_default="0"),
        sa.Column("gpu_memory_bytes", sa.BigInteger),
        sa.Column("disk_free_bytes", sa.BigInteger),
    )
    op.create_index("ix_samples_job_t", "samples", ["job_id", "t"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("progress_json", sa.Text))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("progress_json")
    op.drop_table("samples")
