"""A server on SQLite and the workspace commands on it never import psycopg (PostgreSQL's driver,
about 0.13 CPU-seconds of each start: the tests start servers and commands by the hundred); on
PostgreSQL the replica link and a revocation's message to the servers import it when used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

POSTGRESQL_ONLY = ("psycopg", "flexium.server.replica_link")


def test_a_server_and_the_workspace_commands_on_sqlite_never_import_psycopg(tmp_path: Path) -> None:
    database = f"sqlite:///{tmp_path / 'server.db'}"
    code = (
        "import sys\n"
        "from fastapi.testclient import TestClient\n"
        "from flexium.cli.main import main\n"
        "from flexium.server.app import bootstrap, create_app\n"
        "from flexium.server.settings import load_settings\n"
        f"app = create_app(load_settings(database_url={database!r}))\n"
        "token = bootstrap(app.state.ctx.db)\n"
        "with TestClient(app) as client:\n"
        "    answer = client.get('/api/w/default/processes', headers={'Authorization': 'Bearer ' + token})\n"
        "    assert answer.status_code == 200, answer.text\n"
        f"assert main(['workspace', 'create', 'team', '--database', {database!r}]) == 0\n"
        f"assert main(['token', 'revoke', 'default', token, '--database', {database!r}]) == 0\n"
        f"print(sorted(m for m in {POSTGRESQL_ONLY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"
