"""what a process holds on each GPU (a process may use several)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # A nullable plain column is added in place, on SQLite too (see 0007).
    op.add_column(
        "processes", sa.Column("gpu_bytes", sa.JSON().with_variant(postgresql.JSONB(), "postgresql"), nullable=True)
    )


def downgrade() -> None:
    # Dropping a column copies processes on SQLite, and dropping the old copy would delete every
    # process's commands (ON DELETE CASCADE): they are kept aside and put back (see 0006).
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        op.execute("CREATE TEMP TABLE commands_kept AS SELECT * FROM commands")
    with op.batch_alter_table("processes") as batch:
        batch.drop_column("gpu_bytes")
    if sqlite:
        op.execute("DELETE FROM commands")
        op.execute("INSERT INTO commands SELECT * FROM commands_kept")
        op.execute("DROP TABLE commands_kept")
