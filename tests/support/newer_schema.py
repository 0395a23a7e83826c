"""A flexium one version newer than this one, for the rolling-upgrade test: this code, with one more
schema change on top of this version's head, additive as docs/guide/server.md says a change must be
for old and new replicas to run side by side (a new table, a nullable column, a column with a
default). The change is written into a folder of the test's (``write_revision``), never into the
package; a server runs with it when started through this file:

    python tests/support/newer_schema.py FOLDER python -m flexium.server --port ...

which runs the command after FOLDER in this process with FOLDER's revision added to the schema's
(``command_prefix`` gives the part before ``python -m flexium.server``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REVISION = "newer_for_tests"
PROBE_TABLE = "upgrade_probe"  # the new table; its one row says which database session upgraded
NULLABLE_COLUMN = ("commands", "newer_note")  # a nullable column on the table commands live in
DEFAULT_COLUMN = ("processes", "newer_rank")  # NOT NULL DEFAULT 0 on the table jobs register in

_TEMPLATE = '''"""An additive schema change of a newer flexium (tests/support/newer_schema.py)."""

import sqlalchemy as sa
from alembic import op

revision = "{revision}"
down_revision = "{down_revision}"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "{probe}",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("backend_pid", sa.Integer, nullable=False),
    )
    op.execute("INSERT INTO {probe} (backend_pid) VALUES (pg_backend_pid())")
    op.add_column("{nullable_table}", sa.Column("{nullable_column}", sa.Text, nullable=True))
    op.add_column(
        "{default_table}", sa.Column("{default_column}", sa.Integer, nullable=False, server_default="0")
    )
'''


def write_revision(folder: Path) -> str:
    """Writes the newer version's schema change into ``folder``, on top of this version's head;
    returns its revision."""
    from alembic.script import ScriptDirectory

    from flexium.server.db import migration_config

    head = ScriptDirectory.from_config(migration_config()).get_current_head()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{REVISION}.py").write_text(
        _TEMPLATE.format(
            revision=REVISION,
            down_revision=head,
            probe=PROBE_TABLE,
            nullable_table=NULLABLE_COLUMN[0],
            nullable_column=NULLABLE_COLUMN[1],
            default_table=DEFAULT_COLUMN[0],
            default_column=DEFAULT_COLUMN[1],
        )
    )
    return REVISION


def command_prefix(folder: Path) -> tuple[str, ...]:
    """What goes before ``python -m flexium.server ...`` to run it as the newer version."""
    return (sys.executable, str(Path(__file__).resolve()), str(folder))


def _run_newer(folder: str, command: list[str]) -> None:
    if command[1:3] != ["-m", "flexium.server"]:
        raise SystemExit(f"usage: newer_schema.py FOLDER python -m flexium.server ...; got {command}")
    from alembic.script import ScriptDirectory

    from flexium.server import db

    shipped = db.migration_config

    def newer() -> object:
        config = shipped()
        versions = ScriptDirectory.from_config(config).versions
        config.set_main_option("path_separator", "os")
        config.set_main_option("version_locations", os.pathsep.join([versions, folder]))
        return config

    db.migration_config = newer  # type: ignore[assignment]
    import runpy

    sys.argv = ["flexium.server", *command[3:]]
    runpy.run_module("flexium.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    del sys.path[0]  # this folder: its modules' names must not hide the ones flexium imports
    _run_newer(sys.argv[1], sys.argv[2:])
