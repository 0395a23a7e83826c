"""the token whose report a GPU's row holds (a report of another token never makes a healthy GPU
look sick while that token's report is fresh)

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable plain columns are added in place, on SQLite too (see 0007).
    op.add_column("devices", sa.Column("reported_by", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("devices", "reported_by")
