"""An index on samples.t: downsampling reads only the rows that aged into a tier since
its last pass (`t` in a window), not the whole table every five minutes.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_samples_t", "samples", ["t"])


def downgrade() -> None:
    op.drop_index("ix_samples_t", table_name="samples")
