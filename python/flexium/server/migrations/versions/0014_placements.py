"""flexium run's placements: a job not started yet, waiting for room on a GPU of its host

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

SHORT = 128
HOST = 255


def upgrade() -> None:
    op.create_table(
        "placements",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("workspace_id", sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False),
        sa.Column("host", sa.String(HOST), nullable=False),
        sa.Column("gpu_uuid", sa.String(SHORT), nullable=True),
        sa.Column("need_bytes", sa.BigInteger, nullable=False),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("asked_at", sa.Double, nullable=False),
        sa.Column("placed_at", sa.Double, nullable=True),
        sa.Column("finished_at", sa.Double, nullable=True),
        sa.Column("placed_uuid", sa.String(SHORT), nullable=True),
        sa.Column("reservation_id", sa.Integer, nullable=True),
        sa.Column("process_id", sa.String(SHORT), nullable=True),
        sa.Column("requested_by", sa.String(SHORT), nullable=False),
        sa.Column("token_id", sa.Integer, nullable=True),
        sa.Column("command", sa.Text, nullable=False),
        sa.Column("note", sa.Text, nullable=True),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_placements_queue", "placements", ["workspace_id", "host", "state"])


def downgrade() -> None:
    op.drop_index("ix_placements_queue", table_name="placements")
    op.drop_table("placements")
