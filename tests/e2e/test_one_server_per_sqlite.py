"""SQLite stays the single-process default (issue 40 item 2): a second server on the same file is
refused with a message naming the first and what to do, before it touches the database; the
first goes on serving, and a server started after the first was SIGKILLed starts at once."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from support.live_server import ServerProcess, clean_env, free_port

pytestmark = pytest.mark.timeout(180)


def test_a_second_server_on_one_sqlite_file_is_refused_until_the_first_is_gone(tmp_path: Path) -> None:
    home = tmp_path / "home"
    database = f"sqlite:///{home / 'team.db'}"
    first = ServerProcess(home, database=database, env=clean_env(home)).start()
    try:
        assert first.proc is not None
        second_port = free_port()
        second = subprocess.run(
            [sys.executable, "-m", "flexium.server", "--host", "127.0.0.1", "--port", str(second_port)]
            + ["--database", database],
            env=clean_env(home),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 1, second.stdout + second.stderr
        said = second.stderr.strip()
        assert said.startswith(f"flexium server: another flexium server (process {first.proc.pid}, 127.0.0.1:"), said
        assert "a SQLite database takes one server at a time" in said and "postgresql://" in said, said
        assert "Traceback" not in second.stdout + second.stderr
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{second_port}/healthz", timeout=2)
        assert requests.get(f"{first.url}/healthz", timeout=5).status_code == 200

        first.stop(signal.SIGKILL)  # the kernel drops its lock with the process
        successor = ServerProcess(home, database=database, env=clean_env(home)).start()
        successor.stop(signal.SIGINT)
        assert successor.proc is not None and successor.proc.returncode == 0, successor.lines[-10:]
    finally:
        first.stop(signal.SIGKILL)
