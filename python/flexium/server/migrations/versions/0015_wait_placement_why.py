"""the reason the requester of a wait or a placement gave (flexium resume --when-free --reason,
flexium run --reason)

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable plain columns are added in place, on SQLite too (see 0007).
    op.add_column("waits", sa.Column("why", sa.Text(), nullable=True))
    op.add_column("placements", sa.Column("why", sa.Text(), nullable=True))


def downgrade() -> None:
    # SQLite drops a plain column in place (3.35+): no copy of the tables, whose reservations
    # refer to the waits.
    op.drop_column("placements", "why")
    op.drop_column("waits", "why")
