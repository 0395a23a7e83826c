"""processes: drop gpu_index and physical_device; a process's location is its gpu_uuid

Both are derived when a process is shown: the index from its host's device reports, cuda:N
from visible_gpus.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # SQLite drops a column by copying the table (batch mode) and dropping the old one. With
    # foreign keys on (they are, and cannot be turned off inside the migration's transaction)
    # that drop deletes every process's commands (ON DELETE CASCADE): they are kept aside and
    # put back, ids and all.
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        op.execute("CREATE TEMP TABLE commands_kept AS SELECT * FROM commands")
    with op.batch_alter_table("processes") as batch:
        batch.drop_column("gpu_index")
        batch.drop_column("physical_device")
    if sqlite:
        op.execute("INSERT INTO commands SELECT * FROM commands_kept")
        op.execute("DROP TABLE commands_kept")


def downgrade() -> None:
    # Adding a column needs no copy, on SQLite either.
    op.add_column("processes", sa.Column("gpu_index", sa.Integer, nullable=True))
    op.add_column("processes", sa.Column("physical_device", sa.String(128), nullable=False, server_default=""))
    # The older server stores what each heartbeat says, so these hold only until the next
    # beat: the index from the host's device report, the device the training code names.
    op.execute(
        'UPDATE processes SET physical_device = logical_device, gpu_index = (SELECT devices."index" FROM devices'
        " WHERE devices.workspace_id = processes.workspace_id AND devices.host = processes.host"
        " AND devices.uuid = processes.gpu_uuid)"
    )
