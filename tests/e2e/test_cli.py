"""The `flexium` command's own parts: `flexium server` and the workspace / token commands (run by
the server package), and what it says when the server extra is missing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from support.e2e import WORKSPACE, Server, clean_env, flexium_command, free_port, wait_until

pytestmark = pytest.mark.timeout(120)

_BLOCK_SERVER_PACKAGES = (
    "import sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('fastapi', 'sqlalchemy', 'uvicorn', 'alembic', 'starlette'):\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "sys.meta_path.insert(0, Block())\n"
    "from flexium.cli.main import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_help_lists_every_command(tmp_path: Path) -> None:
    done = subprocess.run(
        [*flexium_command(), "--help"], env=clean_env(tmp_path), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0
    for command in ("doctor", "ps", "devices", "migrate", "pause", "resume", "demo", "server", "workspace", "token"):
        assert f"    {command}" in done.stdout, command
    done = subprocess.run(
        [*flexium_command(), "server", "--help"], env=clean_env(tmp_path), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0 and "--database" in done.stdout and "flexium server" in done.stdout


@pytest.mark.parametrize(
    "argv", [["server"], ["workspace", "create", "x"], ["token", "list", "x"], ["demo", "--port", "1"]]
)
def test_missing_server_extra_says_how_to_install_it(tmp_path: Path, argv: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _BLOCK_SERVER_PACKAGES, *argv],
        env=clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2, done.stderr
    assert 'pip install ".[server]"' in done.stderr
    assert "Traceback" not in done.stderr


def test_help_needs_no_server_extra(tmp_path: Path) -> None:
    """Every parser lives in cli/, so the server's commands explain themselves on a client install too."""
    for argv in (["server", "--help"], ["token", "issue", "--help"]):
        done = subprocess.run(
            [sys.executable, "-c", _BLOCK_SERVER_PACKAGES, *argv],
            env=clean_env(tmp_path),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        assert f"usage: flexium {' '.join(argv[:-1])}" in done.stdout and "--database" in done.stdout
        if argv[0] == "token":  # the roles, and which one is the default and why
            words = " ".join(done.stdout.split())
            assert "--role {admin,job,viewer}" in words and "(default job: most tokens go to training jobs" in words


def test_python_m_flexium_server_is_flexium_server(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    for argv, usage in ((["--help"], "usage: flexium server"), (["workspace", "--help"], "usage: flexium workspace")):
        done = subprocess.run(
            [sys.executable, "-m", "flexium.server", *argv], env=env, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0 and usage in done.stdout, done.stderr
    for argv, error in ((["--port", "x"], "argument --port"), (["--hots"], "unrecognized arguments: --hots")):
        done = subprocess.run(
            [sys.executable, "-m", "flexium.server", *argv], env=env, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 2 and f"flexium server: error: {error}" in done.stderr, done.stderr


def test_flexium_server_command_serves(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [*flexium_command(), "server", "--port", str(port), "--database", f"sqlite:///{tmp_path / 'cli.db'}"],
        env=clean_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:

        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            except requests.RequestException:
                return False

        wait_until(up, 60, "flexium server to answer")
    finally:
        proc.send_signal(signal.SIGTERM)
        # uvicorn re-raises the stop signal once it has shut down cleanly.
        assert proc.wait(20) in (0, -signal.SIGTERM)


def test_tokens_issued_and_revoked_from_the_command_line(server: Server) -> None:
    env = clean_env(server.home)
    job = server.cli("ps", "--token", server.job_token or "")  # the default role is job: no lists
    assert job.returncode == 1 and "needs a token with role admin or viewer" in job.stderr, job.stderr
    issued = subprocess.run(
        [
            *flexium_command(),
            "token",
            "issue",
            WORKSPACE,
            "--name",
            "ci",
            "--role",
            "viewer",
            "--database",
            server.database,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert issued.returncode == 0, issued.stderr
    token = issued.stdout.strip().splitlines()[-1]
    assert token.startswith("flx_") and token != server.token
    done = server.cli("ps", "--token", token)
    assert done.returncode == 0, done.stderr
    refused = server.cli("pause", "gpu-00000000", "--token", token)  # a viewer changes nothing
    assert refused.returncode == 1 and "needs a token with role admin" in refused.stderr, refused.stderr
    revoked = subprocess.run(
        [*flexium_command(), "token", "revoke", WORKSPACE, token, "--database", server.database],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert revoked.returncode == 0, revoked.stderr
    # A token revoked on the database directly stops working within the server's cache time.
    started = time.monotonic()
    wait_until(lambda: server.cli("ps", "--token", token).returncode == 1, 20, "the revoked token to be refused")
    assert time.monotonic() - started < 15  # the 5 s cache (token_cache_s), three times over on a loaded machine
    assert server.cli("ps").returncode == 0


def test_server_and_token_from_flexiumrc(server: Server) -> None:
    """No FLEXIUM_SERVER / FLEXIUM_TOKEN: the command line reads ~/.flexiumrc, like the client."""
    rc = server.home / ".flexiumrc"
    rc.write_text(f"server: http://{server.address}\ntoken: {server.token}\n")
    try:
        done = server.cli("ps", "--json", env={"FLEXIUM_SERVER": "", "FLEXIUM_TOKEN": ""})
        assert done.returncode == 0, done.stderr
        assert isinstance(json.loads(done.stdout), list)
    finally:
        rc.unlink()


def test_a_mistyped_target_is_refused_with_a_suggestion_before_anything_is_sent(server: Server) -> None:
    for typed, suggestion in (("cuda1", "cuda:1"), ("gpu:1", "cuda:1"), ("GPU 0", "cuda:0")):
        done = server.cli("migrate", "gpu-anything", typed)
        assert done.returncode == 2, done.stderr
        assert f"did you mean {suggestion}?" in done.stderr and "cuda:N" in done.stderr, done.stderr
    done = server.cli("migrate", "gpu-anything", "--ranks", "0=cuda:1,1=dev1")
    assert done.returncode == 2 and "'dev1'" in done.stderr and "did you mean cuda:1?" in done.stderr
    assert server.get("/commands").json() == []


def test_refusals_under_json_are_json_on_stdout(server: Server) -> None:
    done = server.cli("pause", "gpu-nosuchprocess", "--json")
    assert done.returncode == 1
    refusal = json.loads(done.stdout)
    assert refusal["error"] == "not_found" and refusal["exit_status"] == 1
    assert "gpu-nosuchprocess" in refusal["message"] and refusal["message"] in done.stderr
    done = server.cli("migrate", "gpu-anything", "cuda1", "--json")
    assert done.returncode == 2 and json.loads(done.stdout)["error"] == "bad_usage"


def test_token_problems_are_said_in_the_command_line_s_terms(server: Server) -> None:
    # No token is a setting missing here (exit 2, as no server); a wrong one the server's refusal (exit 1).
    for token, expected, status in (
        ("", "no token for workspace 'e2e'", 2),
        ("flx_wrong", "does not accept this token", 1),
    ):
        done = server.cli("ps", env={"FLEXIUM_TOKEN": token})
        assert done.returncode == status, done.stderr
        assert expected in done.stderr and "FLEXIUM_TOKEN, --token or 'token:' in .flexiumrc" in done.stderr
        assert "Authorization" not in done.stderr and "Bearer" not in done.stderr, done.stderr
