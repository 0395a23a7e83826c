"""The `flexium` command starts without the engine, torch or the server (each call would pay for
them: about 0.2 CPU-seconds of a 0.6 s call), and `import flexium` still offers the whole API."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

import flexium

# What a command that talks to the server never uses.
NOT_FOR_THE_COMMAND_LINE = ("torch", "flexium.engine", "flexium.api", "flexium.client.process", "flexium.server.app")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_command_imports_neither_the_engine_nor_torch() -> None:
    code = (
        "import sys\n"
        "from flexium.cli.main import main\n"
        "try:\n"
        "    main(['ps'])\n"
        "except SystemExit as exc:\n"
        "    print('exit', exc.code)\n"
        f"print(sorted(m for m in {NOT_FOR_THE_COMMAND_LINE!r} if m in sys.modules))\n"
    )
    env = {**os.environ, "FLEXIUM_SERVER": f"127.0.0.1:{_free_port()}/default", "FLEXIUM_TOKEN": "unused"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "cannot reach the flexium server" in out.stderr  # the command ran as far as the server
    assert out.stdout.splitlines()[-1] == "[]"


def test_the_package_offers_every_name_it_lists() -> None:
    from flexium.api import runtime

    missing = [name for name in flexium.__all__ if getattr(flexium, name, None) is None]
    assert missing == []
    assert (flexium.init, flexium.shutdown, flexium.is_initialized) == (
        runtime.init,
        runtime.shutdown,
        runtime.is_initialized,
    )
    assert set(flexium.__all__) <= set(dir(flexium))


def test_an_unknown_name_is_refused_by_name() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        flexium.no_such_name  # type: ignore[attr-defined]  # noqa: B018
