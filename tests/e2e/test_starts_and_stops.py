"""Starts and stops as a newcomer meets them (issue 38 item 3): the first start hands training
jobs a job token, Ctrl-C ends the server in a line, its database is its owner's alone, a new
workspace comes with a login link, and a demo started in the background stops on SIGINT and
on SIGTERM at once, leaving no row behind for the next demo."""

from __future__ import annotations

import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import requests

from flexium.cli import demo as demo_command
from support.live_server import ProcessOutput, ServerProcess, clean_env, flexium_command, free_port

pytestmark = pytest.mark.timeout(240)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_first_start_hands_jobs_a_job_token_and_ctrl_c_ends_in_a_line(tmp_path: Path) -> None:
    home = tmp_path / "home"
    srv = ServerProcess(home, env=clean_env(home)).start()
    try:
        out = "\n".join(srv.lines)
        handed = re.search(
            rf"training jobs: FLEXIUM_SERVER=127\.0\.0\.1:{srv.port}/default FLEXIUM_TOKEN=(flx_\S+)  \(a job token",
            out,
        )
        assert handed, out
        admin = srv.token
        assert admin is not None and admin != handed.group(1)
        said = srv.lines[srv.lines.index(admin) - 1]
        assert said.startswith("flexium server: admin token of workspace 'default', for the command line"), said
        tokens = requests.get(
            f"{srv.url}/api/w/default/tokens", headers={"Authorization": f"Bearer {admin}"}, timeout=10
        ).json()
        [job] = [t for t in tokens if handed.group(1).startswith(t["prefix"])]
        assert job["role"] == "job"
        # the database, its write-ahead log and shared memory file: the owner's alone
        database = home / ".flexium" / "server.db"
        for path in (database, Path(f"{database}-wal"), Path(f"{database}-shm")):
            assert _mode(path) == 0o600, (path, oct(_mode(path)))
        assert srv.proc is not None
        srv.stop(signal.SIGINT)
        assert srv.proc.returncode == 0, srv.lines[-20:]
        assert srv.lines[-1] == "flexium server: stopped" and "Traceback" not in "\n".join(srv.lines)
    finally:
        srv.stop(signal.SIGKILL)


def test_a_database_an_earlier_server_left_readable_is_made_private(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    database = home / "server.db"
    done = subprocess.run(
        [*flexium_command(), "workspace", "create", "team", "--database", f"sqlite:///{database}"],
        env=clean_env(home),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    database.chmod(0o644)
    srv = ServerProcess(home, database=f"sqlite:///{database}", env=clean_env(home)).start()
    try:
        assert _mode(database) == 0o600
    finally:
        srv.stop(signal.SIGKILL)


def test_a_new_workspace_comes_with_a_login_link_and_token_list_with_a_header(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    database = f"sqlite:///{tmp_path / 'server.db'}"
    port = free_port()
    env = {**clean_env(home), "FLEXIUM_PUBLIC_URL": f"http://127.0.0.1:{port}"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*flexium_command(), *args, "--database", database], env=env, capture_output=True, text=True, timeout=60
        )

    created = cli("workspace", "create", "team")
    assert created.returncode == 0, created.stderr
    lines = created.stdout.splitlines()
    link = re.fullmatch(rf"dashboard: http://127\.0\.0\.1:{port}/login#code=(\S+)  \(works once, .*", lines[1])
    assert link, lines
    assert lines[-1].startswith("flx_") and lines[-1] not in lines[1]
    listed = cli("token", "list", "team")
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["ID", "PREFIX", "STATE", "ROLE", "EXPIRES", "LAST", "USED", "MINTED", "BY", "LABEL"]
    assert row.split()[1:6] == [f"{lines[-1][:10]}...", "active", "admin", "-", "-"]  # never used yet
    srv = ServerProcess(home, database=database, port=port, env=env).start()
    try:
        login = requests.post(f"{srv.url}/login", data={"code": link.group(1)}, allow_redirects=False, timeout=10)
        assert login.status_code == 303, login.text
    finally:
        srv.stop(signal.SIGKILL)


def test_a_new_workspace_links_to_the_server_that_serves_its_database(tmp_path: Path) -> None:
    """Created while a server runs on the SQLite file at a port of its own, the login link points at
    that server, not at the default port; once it has stopped, at the default address, saying so."""
    home = tmp_path / "home"
    home.mkdir()
    database = f"sqlite:///{tmp_path / 'server.db'}"
    env = clean_env(home)

    def create(name: str) -> list[str]:
        done = subprocess.run(
            [*flexium_command(), "workspace", "create", name, "--database", database],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    srv = ServerProcess(home, database=database, env=env).start()
    try:
        lines = create("team")
        link = re.fullmatch(
            rf"dashboard: {re.escape(srv.url)}/login#code=(\S+)  \(works once, within 10 min; the server that "
            r"serves this database\)",
            lines[1],
        )
        assert link, (srv.url, lines)
        login = requests.post(f"{srv.url}/login", data={"code": link.group(1)}, allow_redirects=False, timeout=10)
        assert login.status_code == 303, login.text
    finally:
        srv.stop(signal.SIGKILL)
    lines = create("team-b")
    assert re.fullmatch(
        r"dashboard: http://127\.0\.0\.1:8080/login#code=\S+  \(works once, within 10 min; a server at another "
        r"address: that address before /login\)",
        lines[1],
    ), lines


def _background_demo(home: Path) -> tuple[subprocess.Popen[str], ProcessOutput, int]:
    """`flexium demo &` from a script: a shell starts a background job with SIGINT ignored."""
    port = free_port()
    demo = subprocess.Popen(
        [*flexium_command(), "demo", "--port", str(port)],
        env=clean_env(home),
        cwd=home,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # noqa: PLW1509 (no threads here yet)
    )
    return demo, ProcessOutput(demo), port


def test_a_background_demo_stops_on_sigint_and_at_once_on_sigterm(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    demo, out, _port = _background_demo(home)
    try:
        out.wait_for(r"\[demo job\] step", 120)
        demo.send_signal(signal.SIGINT)
        assert demo.wait(30) == 0, out.text
        assert out.lines[-1] == "flexium demo: stopped"

        demo, out, port = _background_demo(home)
        process_id = out.wait_for(r"job (gpu-[0-9a-f]+) registered", 120).group(1)
        token = out.wait_for(r"admin token \(for the CLI and the dashboard\): (flx_\S+)$", 10).group(1)
        listed = requests.get(
            f"http://127.0.0.1:{port}/api/w/default/processes",
            headers={"Authorization": f"Bearer {token}"},
            timeout=10,
        ).json()
        assert [p["process_id"] for p in listed] == [process_id]  # nothing left of the first demo
        out.wait_for(r"\[demo job\] step", 60)
        started = time.monotonic()
        demo.send_signal(signal.SIGTERM)
        assert demo.wait(30) == 0, out.text
        # Before, the job ignored the SIGINT the demo stops it with, and was killed after STOP_S.
        assert time.monotonic() - started < demo_command.STOP_S, out.text
        assert "Traceback" not in out.text, out.text
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
