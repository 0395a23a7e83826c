"""the audit log kept by age and class, not by count: each entry keeps until its kept_until (a
login or a refusal for weeks, a change for a year), and an entry repeated within the hour (a
login, a refusal) counts its repeats instead of taking a row each

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

_DAY = 86400.0
# What storage/audit.py keeps each class for, as of this revision.
_ACCESS_ACTIONS = ("login", "logout", "login.refused", "request.refused")


def upgrade() -> None:
    # Plain columns with a default are added in place, on SQLite too (see 0007).
    op.add_column("audit_log", sa.Column("repeats", sa.Integer(), nullable=False, server_default="1"))
    op.add_column("audit_log", sa.Column("last_at", sa.Double(), nullable=True))
    op.add_column("audit_log", sa.Column("kept_until", sa.Double(), nullable=False, server_default="0"))
    audit = sa.table("audit_log", sa.column("action", sa.String), sa.column("at", sa.Double), sa.column("kept_until"))
    op.execute(
        audit.update().values(
            kept_until=sa.case(
                (audit.c.action.in_(_ACCESS_ACTIONS), audit.c.at + 90 * _DAY),
                else_=audit.c.at + 365 * _DAY,
            )
        )
    )
    op.create_index("ix_audit_log_kept_until", "audit_log", ["workspace_id", "kept_until"])
    op.create_index("ix_audit_log_repeated", "audit_log", ["workspace_id", "action", "token_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_audit_log_repeated", table_name="audit_log")
    op.drop_index("ix_audit_log_kept_until", table_name="audit_log")
    op.drop_column("audit_log", "kept_until")
    op.drop_column("audit_log", "last_at")
    op.drop_column("audit_log", "repeats")
