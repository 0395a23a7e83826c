"""the resume-when-free queue: a job's priority, the waits, room held for a job, a command's reason, drains

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

SHORT = 128
HOST = 255
NORMAL_PRIORITY = "50"  # protocol.DEFAULT_PRIORITY when this revision was written
_LIVE = "state IN ('waiting', 'dispatched')"
_LIVE_DRAIN = "ended_at IS NULL"


def upgrade() -> None:
    # Plain columns are added in place, on SQLite too (see 0007): a NOT NULL one with its default.
    op.add_column("processes", sa.Column("priority", sa.Integer, nullable=False, server_default=NORMAL_PRIORITY))
    op.add_column("commands", sa.Column("reason", sa.Text, nullable=True))
    op.create_table(
        "waits",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("workspace_id", sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False),
        sa.Column("process_pk", sa.Integer, sa.ForeignKey("processes.pk", ondelete="CASCADE"), nullable=False),
        sa.Column("job_key", sa.String(SHORT), nullable=True),
        sa.Column("host", sa.String(HOST), nullable=False),
        sa.Column("gpu_uuid", sa.String(SHORT), nullable=True),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("finished_at", sa.Double, nullable=True),
        sa.Column("command_id", sa.Integer, nullable=True),
        sa.Column("dispatches", sa.Integer, nullable=False),
        sa.Column("refused_at", sa.Double, nullable=True),
        sa.Column("requested_by", sa.String(SHORT), nullable=False),
        sa.Column("token_id", sa.Integer, nullable=True),
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("note", sa.Text, nullable=True),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_waits_queue", "waits", ["workspace_id", "host", "state"])
    op.create_index("ix_waits_process_pk", "waits", ["process_pk"])
    op.create_index(
        "uq_waits_one_live",
        "waits",
        ["process_pk"],
        unique=True,
        sqlite_where=sa.text(_LIVE),
        postgresql_where=sa.text(_LIVE),
    )
    op.create_table(
        "reservations",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("workspace_id", sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False),
        sa.Column("host", sa.String(HOST), nullable=False),
        sa.Column("gpu_uuid", sa.String(SHORT), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("wait_id", sa.Integer, sa.ForeignKey("waits.id", ondelete="CASCADE"), nullable=True),
        sa.Column("holder", sa.String(SHORT), nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
    )
    op.create_index("ix_reservations_gpu", "reservations", ["workspace_id", "host", "gpu_uuid"])
    op.create_index("ix_reservations_wait_id", "reservations", ["wait_id"])
    op.create_table(
        "drains",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("workspace_id", sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False),
        sa.Column("host", sa.String(HOST), nullable=False),
        sa.Column("gpu_uuid", sa.String(SHORT), nullable=False),
        sa.Column("gpu_index", sa.Integer, nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("ended_at", sa.Double, nullable=True),
        sa.Column("requested_by", sa.String(SHORT), nullable=False),
        sa.Column("token_id", sa.Integer, nullable=True),
        sa.Column("ended_by", sa.String(SHORT), nullable=True),
        sa.Column("reason", sa.Text, nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index(
        "uq_drains_one_live",
        "drains",
        ["workspace_id", "host", "gpu_uuid"],
        unique=True,
        sqlite_where=sa.text(_LIVE_DRAIN),
        postgresql_where=sa.text(_LIVE_DRAIN),
    )
    op.create_table(
        "drain_moves",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("drain_id", sa.Integer, sa.ForeignKey("drains.id", ondelete="CASCADE"), nullable=False),
        sa.Column("process_pk", sa.Integer, nullable=False),
        sa.Column("process_id", sa.String(SHORT), nullable=False),
        sa.Column("job_key", sa.String(SHORT), nullable=True),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("command_id", sa.Integer, nullable=True),
        sa.Column("target_uuid", sa.String(SHORT), nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("note", sa.Text, nullable=False),
    )
    op.create_index("ix_drain_moves_drain_id", "drain_moves", ["drain_id"])


def downgrade() -> None:
    op.drop_index("ix_drain_moves_drain_id", table_name="drain_moves")
    op.drop_table("drain_moves")
    op.drop_index("uq_drains_one_live", table_name="drains")
    op.drop_table("drains")
    op.drop_index("ix_reservations_wait_id", table_name="reservations")
    op.drop_index("ix_reservations_gpu", table_name="reservations")
    op.drop_table("reservations")
    op.drop_index("uq_waits_one_live", table_name="waits")
    op.drop_index("ix_waits_process_pk", table_name="waits")
    op.drop_index("ix_waits_queue", table_name="waits")
    op.drop_table("waits")
    # Nothing refers to commands, so SQLite's copy of the table loses nothing (see 0009).
    with op.batch_alter_table("commands", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_column("reason")
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        _recreate_one_active_index()
    # Dropping a column copies processes on SQLite, and dropping the old copy would delete every
    # process's commands (ON DELETE CASCADE): they are kept aside and put back (see 0007).
    if sqlite:
        op.execute("CREATE TEMP TABLE commands_kept AS SELECT * FROM commands")
    with op.batch_alter_table("processes") as batch:
        batch.drop_column("priority")
    if sqlite:
        op.execute("DELETE FROM commands")
        op.execute("INSERT INTO commands SELECT * FROM commands_kept")
        op.execute("DROP TABLE commands_kept")


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
