"""jobs of several ranks: a process's job membership, job operations, a command's share of one

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

SHORT = 128
_ACTIVE = "state IN ('queued', 'delivered', 'running')"
_JOB_COLUMNS = ("job_key", "job_rank", "job_world_size", "job_local_rank", "job_local_world_size", "job_node_rank")


def _json() -> sa.types.TypeEngine[Any]:
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "job_operations",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("workspace_id", sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False),
        sa.Column("job_key", sa.String(SHORT), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("world_size", sa.Integer, nullable=False),
        sa.Column("moves", _json(), nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_job_operations_workspace_job", "job_operations", ["workspace_id", "job_key"])
    # Nullable columns are added in place, on SQLite too: the processes table is not copied, so
    # the commands that reference it stay as they are.
    op.add_column("processes", sa.Column("job_key", sa.String(SHORT), nullable=True))
    for name in _JOB_COLUMNS[1:]:
        op.add_column("processes", sa.Column(name, sa.Integer, nullable=True))
    op.create_index("ix_processes_workspace_job", "processes", ["workspace_id", "job_key"])
    # A column with a foreign key is added on SQLite by copying the table (batch mode); the copy
    # keeps the never-reused ids, and the partial unique index is made again (see 0003).
    with op.batch_alter_table("commands", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.add_column(sa.Column("operation_id", sa.Integer, nullable=True))
        batch.add_column(sa.Column("job", _json(), nullable=True))
        batch.create_foreign_key(
            "fk_commands_operation_id", "job_operations", ["operation_id"], ["id"], ondelete="CASCADE"
        )
        batch.create_index("ix_commands_operation_id", ["operation_id"])
    if op.get_bind().dialect.name == "sqlite":
        _recreate_one_active_index()


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    with op.batch_alter_table("commands", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_index("ix_commands_operation_id")
        batch.drop_constraint("fk_commands_operation_id", type_="foreignkey")
        batch.drop_column("job")
        batch.drop_column("operation_id")
    if sqlite:
        _recreate_one_active_index()
    op.drop_index("ix_processes_workspace_job", table_name="processes")
    # Dropping columns copies processes on SQLite, and dropping the old copy would delete every
    # process's commands (ON DELETE CASCADE): they are kept aside and put back (see 0004).
    if sqlite:
        op.execute("CREATE TEMP TABLE commands_kept AS SELECT * FROM commands")
    with op.batch_alter_table("processes") as batch:
        for name in _JOB_COLUMNS:
            batch.drop_column(name)
    if sqlite:
        op.execute("INSERT INTO commands SELECT * FROM commands_kept")
        op.execute("DROP TABLE commands_kept")
    op.drop_index("ix_job_operations_workspace_job", table_name="job_operations")
    op.drop_table("job_operations")


def _recreate_one_active_index() -> None:
    """Batch mode re-creates indexes from reflection, which may lose a partial index's WHERE."""
    op.execute("DROP INDEX IF EXISTS uq_commands_one_active")
    op.create_index("uq_commands_one_active", "commands", ["process_pk"], unique=True, sqlite_where=sa.text(_ACTIVE))
