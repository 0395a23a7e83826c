"""initial schema: workspaces, tokens, processes, devices, commands

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

SHORT = 128
HOST = 255
ACTIVE_SQL = "state IN ('queued', 'delivered', 'running')"


def _json() -> sa.types.TypeEngine[Any]:
    return sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "workspaces",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.UniqueConstraint("name", name="uq_workspaces_name"),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("workspace_id", sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(SHORT), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("revoked_at", sa.Double, nullable=True),
        sa.UniqueConstraint("token_hash", name="uq_tokens_token_hash"),
    )
    op.create_index("ix_tokens_workspace_id", "tokens", ["workspace_id"])
    op.create_table(
        "processes",
        sa.Column("pk", sa.Integer, primary_key=True),
        sa.Column("workspace_id", sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False),
        sa.Column("process_id", sa.String(SHORT), nullable=False),
        sa.Column("host", sa.String(HOST), nullable=False),
        sa.Column("user", sa.String(SHORT), nullable=False),
        sa.Column("pid", sa.BigInteger, nullable=False),
        sa.Column("gpu_uuid", sa.String(SHORT), nullable=True),
        sa.Column("gpu_model", sa.String(SHORT), nullable=False),
        sa.Column("gpu_index", sa.Integer, nullable=True),
        sa.Column("logical_device", sa.String(SHORT), nullable=False),
        sa.Column("physical_device", sa.String(SHORT), nullable=False),
        sa.Column("visible_gpus", _json(), nullable=False),
        sa.Column("torch_version", sa.String(SHORT), nullable=False),
        sa.Column("driver_version", sa.String(SHORT), nullable=False),
        sa.Column("flexium_version", sa.String(SHORT), nullable=False),
        sa.Column("capabilities", _json(), nullable=False),
        sa.Column("memory_bytes", sa.BigInteger, nullable=False),
        sa.Column("footprint_bytes", sa.BigInteger, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("started_at", sa.Double, nullable=True),
        sa.Column("registered_at", sa.Double, nullable=False),
        sa.Column("last_seen", sa.Double, nullable=False),
        sa.Column("cmdline", sa.Text, nullable=False),
        sa.UniqueConstraint("workspace_id", "process_id", name="uq_processes_workspace_process"),
    )
    op.create_index("ix_processes_workspace_last_seen", "processes", ["workspace_id", "last_seen"])
    op.create_table(
        "devices",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("workspace_id", sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False),
        sa.Column("host", sa.String(HOST), nullable=False),
        sa.Column("uuid", sa.String(SHORT), nullable=False),
        sa.Column("index", sa.Integer, nullable=True),
        sa.Column("name", sa.String(SHORT), nullable=False),
        sa.Column("memory_total", sa.BigInteger, nullable=False),
        sa.Column("memory_used", sa.BigInteger, nullable=False),
        sa.Column("utilization", sa.Integer, nullable=True),
        sa.Column("temperature", sa.Integer, nullable=True),
        sa.Column("health", sa.String(SHORT), nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
        sa.UniqueConstraint("workspace_id", "host", "uuid", name="uq_devices_workspace_host_uuid"),
    )
    op.create_table(
        "commands",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("workspace_id", sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False),
        sa.Column("process_pk", sa.Integer, sa.ForeignKey("processes.pk", ondelete="CASCADE"), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("target_uuid", sa.String(SHORT), nullable=True),
        sa.Column("target_index", sa.Integer, nullable=True),
        sa.Column("target_device", sa.String(SHORT), nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("delivered_at", sa.Double, nullable=True),
        sa.Column("started_at", sa.Double, nullable=True),
        sa.Column("finished_at", sa.Double, nullable=True),
        sa.Column("deliveries", sa.Integer, nullable=False),
        sa.Column("result", _json(), nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        # ids are never reused (SQLite would hand out a deleted last row's id again, and a
        # process recognises a repeated delivery by id)
        sqlite_autoincrement=True,
    )
    op.create_index("ix_commands_process_state", "commands", ["process_pk", "state"])
    op.create_index("ix_commands_workspace_id", "commands", ["workspace_id", "id"])
    op.create_index("ix_commands_state_created", "commands", ["state", "created_at"])
    op.create_index(
        "uq_commands_one_active",
        "commands",
        ["process_pk"],
        unique=True,
        sqlite_where=sa.text(ACTIVE_SQL),
        postgresql_where=sa.text(ACTIVE_SQL),
    )


def downgrade() -> None:
    op.drop_table("commands")
    op.drop_table("devices")
    op.drop_table("processes")
    op.drop_table("tokens")
    op.drop_table("workspaces")
