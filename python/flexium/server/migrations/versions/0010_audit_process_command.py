"""the process and the command an audit entry is about, so a job's page asks for its own entries

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

import re

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

SHORT = 128
# What the entries written before this revision said in their target (storage/audit.py then):
# "command 12 (pause gpu-1)" for a command created or finished, "pause gpu-1 to 2" for one
# refused. A process id has no space (protocol.PROCESS_ID_RE).
_COMMAND_TARGET = re.compile(r"^command (\d+) \(\w+ (\S+)\)$")
_REFUSED_TARGET = re.compile(r"^\w+ (\S+)")


def upgrade() -> None:
    # Nullable plain columns are added in place, on SQLite too (see 0007).
    op.add_column("audit_log", sa.Column("process_id", sa.String(SHORT), nullable=True))
    op.add_column("audit_log", sa.Column("command_id", sa.Integer, nullable=True))
    op.create_index("ix_audit_log_process", "audit_log", ["workspace_id", "process_id", "id"])
    _fill_in_from_targets()


def _fill_in_from_targets() -> None:
    """The entries already written say who sent each command on its job's page after the
    upgrade too: their ids, read once from the text they were written with."""
    audit = sa.table(
        "audit_log",
        sa.column("id", sa.Integer),
        sa.column("action", sa.String),
        sa.column("target", sa.String),
        sa.column("outcome", sa.String),
        sa.column("process_id", sa.String),
        sa.column("command_id", sa.Integer),
    )
    bind = op.get_bind()
    rows = bind.execute(
        sa.select(audit.c.id, audit.c.target, audit.c.outcome).where(audit.c.action.like("command.%"))
    ).all()
    filled = []
    for entry_id, target, outcome in rows:
        command = _COMMAND_TARGET.match(target)
        refused = _REFUSED_TARGET.match(target) if outcome == "refused" else None
        if command is not None:
            filled.append({"b_id": entry_id, "b_process": command.group(2), "b_command": int(command.group(1))})
        elif refused is not None:
            filled.append({"b_id": entry_id, "b_process": refused.group(1), "b_command": None})
    if filled:
        bind.execute(
            audit.update()
            .where(audit.c.id == sa.bindparam("b_id"))
            .values(process_id=sa.bindparam("b_process"), command_id=sa.bindparam("b_command")),
            filled,
        )


def downgrade() -> None:
    # Nothing refers to audit_log, so SQLite's copy of the table loses nothing.
    op.drop_index("ix_audit_log_process", table_name="audit_log")
    with op.batch_alter_table("audit_log") as batch:
        batch.drop_column("command_id")
        batch.drop_column("process_id")
