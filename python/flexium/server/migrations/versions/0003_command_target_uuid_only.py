"""commands: drop target_index and target_device; a command names its GPU by UUID only

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_ACTIVE = "state IN ('queued', 'delivered', 'running')"


def upgrade() -> None:
    # SQLite drops a column by copying the table (batch mode); the copy must keep the
    # never-reused ids and the partial unique index that allows one active command per process.
    with op.batch_alter_table("commands", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_column("target_index")
        batch.drop_column("target_device")
    if op.get_bind().dialect.name == "sqlite":
        _recreate_one_active_index()


def downgrade() -> None:
    with op.batch_alter_table("commands", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.add_column(sa.Column("target_index", sa.Integer, nullable=True))
        batch.add_column(sa.Column("target_device", sa.String(128), nullable=True))
    if op.get_bind().dialect.name == "sqlite":
        _recreate_one_active_index()


def _recreate_one_active_index() -> None:
    """Batch mode re-creates indexes from reflection, which may lose a partial index's WHERE."""
    op.execute("DROP INDEX IF EXISTS uq_commands_one_active")
    op.create_index("uq_commands_one_active", "commands", ["process_pk"], unique=True, sqlite_where=sa.text(_ACTIVE))
