"""when a request last came with a token (None: none since it was recorded)

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable plain columns are added in place, on SQLite too (see 0007).
    op.add_column("tokens", sa.Column("last_used_at", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("tokens", "last_used_at")
