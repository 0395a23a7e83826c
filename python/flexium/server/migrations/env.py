"""Alembic environment for flexium's server. Migrations run from ``Database.upgrade`` on an
open connection (passed in ``config.attributes["connection"]``) so the server, the CLI and the
tests share one code path; the ``alembic`` command line works too with ``-x url=...``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection

from flexium.server.models import Base

config = context.config


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("give the database: alembic -x url=sqlite:///PATH ...")
    with create_engine(url).begin() as conn:
        _run(conn)
