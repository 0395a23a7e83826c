"""a token's end of validity (None: valid until revoked)

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable plain columns are added in place, on SQLite too (see 0007).
    op.add_column("tokens", sa.Column("expires_at", sa.Double(), nullable=True))


def downgrade() -> None:
    op.drop_column("tokens", "expires_at")
