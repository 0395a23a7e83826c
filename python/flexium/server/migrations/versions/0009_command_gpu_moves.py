"""a migrate of one process on several GPUs, GPU by GPU: where each of its GPUs' memory goes

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable plain column is added in place, on SQLite too (see 0007).
    op.add_column(
        "commands", sa.Column("gpu_moves", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=True)
    )


def downgrade() -> None:
    # Nothing refers to commands, so SQLite's copy of the table loses nothing.
    with op.batch_alter_table("commands") as batch:
        batch.drop_column("gpu_moves")
