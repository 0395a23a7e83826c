"""processes.state_seq: the sequence number of the body whose state was last applied

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-08
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("processes", sa.Column("state_seq", sa.BigInteger, nullable=True))


def downgrade() -> None:
    op.drop_column("processes", "state_seq")
