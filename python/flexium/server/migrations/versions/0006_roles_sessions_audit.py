"""roles of tokens and who minted them, the process a job token registered, dashboard
sessions, one-time login codes, the audit log

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

SHORT = 128


def upgrade() -> None:
    # Every token made before roles existed could do everything: it becomes admin, so no one
    # is locked out by the upgrade. Plain columns (no foreign keys) are added in place on
    # SQLite too: neither table is copied (see 0005).
    op.add_column("tokens", sa.Column("role", sa.String(16), nullable=False, server_default="admin"))
    op.add_column("tokens", sa.Column("minted_by", sa.Integer, nullable=True))
    op.create_index("ix_tokens_minted_by", "tokens", ["minted_by"])
    op.add_column("processes", sa.Column("token_id", sa.Integer, nullable=True))
    op.create_table(
        "dashboard_sessions",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("token_id", sa.Integer, sa.ForeignKey("tokens.id", ondelete="CASCADE"), nullable=False),
        sa.Column("session_hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("last_used", sa.Double, nullable=False),
        sa.UniqueConstraint("session_hash", name="uq_dashboard_sessions_hash"),
    )
    op.create_index("ix_dashboard_sessions_token_id", "dashboard_sessions", ["token_id"])
    op.create_table(
        "login_codes",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("token_id", sa.Integer, sa.ForeignKey("tokens.id", ondelete="CASCADE"), nullable=False),
        sa.Column("code_hash", sa.String(64), nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
        sa.UniqueConstraint("code_hash", name="uq_login_codes_hash"),
    )
    op.create_index("ix_login_codes_token_id", "login_codes", ["token_id"])
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("workspace_id", sa.Integer, sa.ForeignKey("workspaces.id", ondelete="CASCADE"), nullable=False),
        sa.Column("at", sa.Double, nullable=False),
        sa.Column("token_id", sa.Integer, nullable=True),
        sa.Column("token_name", sa.String(SHORT), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("target", sa.String(SHORT), nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("detail", sa.Text, nullable=False),
    )
    op.create_index("ix_audit_log_workspace_id", "audit_log", ["workspace_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_audit_log_workspace_id", table_name="audit_log")
    op.drop_table("audit_log")
    op.drop_index("ix_login_codes_token_id", table_name="login_codes")
    op.drop_table("login_codes")
    op.drop_index("ix_dashboard_sessions_token_id", table_name="dashboard_sessions")
    op.drop_table("dashboard_sessions")
    # Dropping columns copies the table on SQLite; neither is referenced by a foreign key with
    # ON DELETE CASCADE that would take rows with it except commands -> processes: kept aside (see 0005).
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        op.execute("CREATE TEMP TABLE commands_kept AS SELECT * FROM commands")
    with op.batch_alter_table("processes") as batch:
        batch.drop_column("token_id")
    if sqlite:
        op.execute("DELETE FROM commands")
        op.execute("INSERT INTO commands SELECT * FROM commands_kept")
        op.execute("DROP TABLE commands_kept")
    op.drop_index("ix_tokens_minted_by", table_name="tokens")
    with op.batch_alter_table("tokens") as batch:
        batch.drop_column("minted_by")
        batch.drop_column("role")
