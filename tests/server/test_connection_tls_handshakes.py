"""HTTPS connections are counted and timed from their accept, their TLS handshake included: a
flood of connections that never start a handshake neither holds every descriptor of a server
whose limit is low (the oldest handshakes make room) nor outlives --request-timeout."""

from __future__ import annotations

import signal
import socket
import statistics
import time
from pathlib import Path

import pytest
import requests

from support.connection_clients import closed_by_server, open_sockets, self_signed_certificate
from support.live_server import ServerProcess, clean_env, wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("enough_file_descriptors")]

OPEN_FILES = 256  # the server's descriptor limit: it holds up to 256 - 64 connections
STALLED = 300
SERVED_WITHIN_S = 1.0


@pytest.fixture
def certificate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, which this test's requests trust."""
    cert, key = self_signed_certificate(tmp_path / "tls")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
    return cert, key


def _https_server(home: Path, certificate: tuple[Path, Path], *args: str, open_files: int | None) -> ServerProcess:
    cert, key = certificate
    prefix = ("prlimit", f"--nofile={open_files}:{open_files}", "--") if open_files else ()
    return ServerProcess(
        home, "--certfile", str(cert), "--keyfile", str(key), *args, env=clean_env(home), prefix=prefix
    ).start()


def _stall(port: int, count: int) -> list[socket.socket]:
    """Connections that never send a byte, so never begin a TLS handshake."""
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(count)]


def test_stalled_handshakes_past_the_descriptor_limit_leave_room_for_an_honest_client(
    tmp_path: Path, certificate: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's failure, scaled down: the server's descriptors all held by connections that
    never start their handshake left new clients failing for about 50 s."""
    srv = _https_server(tmp_path / "home", certificate, "--request-timeout", "60", open_files=OPEN_FILES)
    try:
        assert srv.proc is not None
        bound = OPEN_FILES - 64
        assert any(f"open file limit {OPEN_FILES}: up to {bound} connections" in line for line in srv.lines)
        stalled = _stall(srv.port, STALLED)
        try:
            pid = srv.proc.pid
            wait_until(lambda: open_sockets(pid) >= bound, 30, "the server to accept the stalled connections")
            took = []
            for _ in range(5):
                started = time.perf_counter()
                answer = requests.get(f"{srv.url}/healthz", timeout=10)
                took.append(time.perf_counter() - started)
                assert answer.status_code == 200, answer.text
            held = open_sockets(pid)
            closed = sum(1 for s in stalled if closed_by_server(s))
            assert closed >= STALLED - bound
            assert held <= OPEN_FILES
            assert statistics.median(took) < SERVED_WITHIN_S, took
            assert any("closed the oldest connection in its TLS handshake" in line for line in srv.lines)
        finally:
            for sock in stalled:
                sock.close()
    finally:
        srv.stop(signal.SIGKILL)
    with capsys.disabled():
        print(
            f"\nFIGURES stalled TLS handshakes: {STALLED} opened against {OPEN_FILES} descriptors, {closed} closed "
            f"to make room, the server held {held} sockets; /healthz over HTTPS answered in "
            f"{statistics.median(took) * 1000:.0f} ms (median of 5, max {max(took) * 1000:.0f} ms)"
        )


def test_a_handshake_not_finished_within_the_request_timeout_isclosed_by_server(
    tmp_path: Path, certificate: tuple[Path, Path]
) -> None:
    """The event loop's own TLS would keep it 60 s."""
    srv = _https_server(tmp_path / "home", certificate, "--request-timeout", "2", open_files=None)
    try:
        stalled = _stall(srv.port, 20)
        opened = time.monotonic()
        try:
            wait_until(lambda: all(closed_by_server(s) for s in stalled), 20, "the stalled handshakes to be closed")
            closed_after = time.monotonic() - opened
        finally:
            for sock in stalled:
                sock.close()
        assert 1.5 < closed_after < 2 * 4  # no sooner than the bound; four times it on a slow machine
        answer = requests.get(f"{srv.url}/healthz", timeout=10)
        assert answer.status_code == 200
        assert answer.headers["strict-transport-security"] == "max-age=31536000"  # the scheme is https
    finally:
        srv.stop(signal.SIGKILL)


def test_what_the_server_prints_about_its_address_says_https(tmp_path: Path, certificate: tuple[Path, Path]) -> None:
    """uvicorn's own start line said http:// under --certfile (the TLS is not uvicorn's)."""
    srv = _https_server(tmp_path / "home", certificate, open_files=None)
    try:
        running = [line for line in srv.lines if "running on" in line]
        assert running and all(f"running on https://127.0.0.1:{srv.port}" in line for line in running), srv.lines
        assert not [line for line in srv.lines if "http://" in line], srv.lines
    finally:
        srv.stop(signal.SIGKILL)
