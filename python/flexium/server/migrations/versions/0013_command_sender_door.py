"""who sent a command and by which door (command line, dashboard, a policy, the API), on the
command and on audit entries

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

SHORT = 128


def upgrade() -> None:
    # Nullable plain columns are added in place, on SQLite too (see 0007).
    op.add_column("commands", sa.Column("sent_by", sa.String(SHORT), nullable=True))
    op.add_column("commands", sa.Column("door", sa.String(16), nullable=True))
    op.add_column("audit_log", sa.Column("door", sa.String(16), nullable=True))


def downgrade() -> None:
    # Nothing refers to commands or audit entries, so SQLite's copies lose nothing (see 0009).
    with op.batch_alter_table("audit_log") as batch:
        batch.drop_column("door")
    with op.batch_alter_table("commands", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_column("door")
        batch.drop_column("sent_by")
    if op.get_bind().dialect.name == "sqlite":
        _recreate_one_active_index()


def _recreate_one_active_index() -> None:
    """Batch mode re-creates indexes from reflection, which may lose a partial index's WHERE (see 0005)."""
    op.execute("DROP INDEX IF EXISTS uq_commands_one_active")
    op.create_index(
        "uq_commands_one_active",
        "commands",
        ["process_pk"],
        unique=True,
        sqlite_where=sa.text("state IN ('queued', 'delivered', 'running')"),
    )
