"""training history: a process's steps, steps/s and loss sampled for the job page's curves

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "progress_samples",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("process_pk", sa.Integer, sa.ForeignKey("processes.pk", ondelete="CASCADE"), nullable=False),
        sa.Column("at", sa.Double, nullable=False),
        sa.Column("steps", sa.BigInteger, nullable=True),
        sa.Column("steps_per_s", sa.Double, nullable=True),
        sa.Column("loss", sa.Double, nullable=True),
    )
    op.create_index("ix_progress_samples_process_at", "progress_samples", ["process_pk", "at"])
    op.create_index("ix_progress_samples_at", "progress_samples", ["at"])


def downgrade() -> None:
    op.drop_index("ix_progress_samples_at", table_name="progress_samples")
    op.drop_index("ix_progress_samples_process_at", table_name="progress_samples")
    op.drop_table("progress_samples")
