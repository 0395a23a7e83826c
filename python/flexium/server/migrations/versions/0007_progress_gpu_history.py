"""training progress of a process (steps, steps/s, last loss) and the GPU history samples

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

SHORT = 128
HOST = 255
_PROGRESS = (
    ("steps", sa.BigInteger),
    ("steps_at", sa.Double),
    ("steps_per_s", sa.Double),
    ("loss", sa.Double),
)


def upgrade() -> None:
    # Nullable plain columns are added in place, on SQLite too: processes is not copied (see 0005).
    for name, kind in _PROGRESS:
        op.add_column("processes", sa.Column(name, kind, nullable=True))
    op.create_table(
        "gpu_samples",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("workspace_id", sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False),
        sa.Column("host", sa.String(HOST), nullable=False),
        sa.Column("uuid", sa.String(SHORT), nullable=False),
        sa.Column("at", sa.Double, nullable=False),
        sa.Column("memory_used", sa.BigInteger, nullable=False),
        sa.Column("memory_total", sa.BigInteger, nullable=False),
        sa.Column("utilization", sa.Integer, nullable=True),
    )
    op.create_index("ix_gpu_samples_gpu_at", "gpu_samples", ["workspace_id", "host", "uuid", "at"])
    op.create_index("ix_gpu_samples_at", "gpu_samples", ["at"])


def downgrade() -> None:
    op.drop_index("ix_gpu_samples_at", table_name="gpu_samples")
    op.drop_index("ix_gpu_samples_gpu_at", table_name="gpu_samples")
    op.drop_table("gpu_samples")
    # Dropping columns copies processes on SQLite, and dropping the old copy would delete every
    # process's commands (ON DELETE CASCADE): they are kept aside and put back (see 0006).
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        op.execute("CREATE TEMP TABLE commands_kept AS SELECT * FROM commands")
    with op.batch_alter_table("processes") as batch:
        for name, _kind in reversed(_PROGRESS):
            batch.drop_column(name)
    if sqlite:
        op.execute("DELETE FROM commands")
        op.execute("INSERT INTO commands SELECT * FROM commands_kept")
        op.execute("DROP TABLE commands_kept")
