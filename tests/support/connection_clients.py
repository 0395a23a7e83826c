"""Clients of a real server for the connection-bound tests (tests/server/test_connection_*.py):
raw sockets and what the server did with them, a certificate the tests' HTTPS clients trust,
and a job whose requests are timed."""

from __future__ import annotations

import socket
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import requests

from support.server import process_body


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (after a 408, or without a word), asked without
    waiting."""
    sock.settimeout(0)
    try:
        data = sock.recv(4096)
    except BlockingIOError:
        return False
    except OSError:
        return True
    if data.startswith(b"HTTP/1.1 408"):
        sock.settimeout(1)
        try:
            return sock.recv(4096) == b""
        except OSError:
            return True
    return data == b""


def answer_status(sock: socket.socket) -> int | None:
    """The status of the answer on ``sock`` (waiting up to 10 s); None when the server closed it
    without one."""
    sock.settimeout(10)
    try:
        head = sock.recv(4096)
    except OSError:
        return None
    return int(head.split()[1]) if head.startswith(b"HTTP/1.1 ") else None


def read_to_end(sock: socket.socket, timeout: float = 30) -> tuple[bytes, float]:
    """Everything the server sends on ``sock`` until it closes it, and how long that took."""
    started = time.monotonic()
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass  # closed with a reset: what arrived before it is the answer
    return received, time.monotonic() - started


def open_sockets(pid: int) -> int:
    """The sockets process ``pid`` holds open (the listening one among them)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += "socket" in str(fd.readlink())
        except FileNotFoundError:  # closed since the listing
            continue
    return count


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A new self-signed certificate for 127.0.0.1 in ``folder`` (made here), and its key."""
    folder.mkdir()
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", "key.pem", "-out", "cert.pem", "-days", "2", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        cwd=folder, check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return folder / "cert.pem", folder / "key.pem"


def connect(port: int, *, certificate: Path | None = None, source: str = "127.0.0.1") -> socket.socket:
    """A connection to the server on ``port`` from address ``source``; over TLS, handshake done,
    when ``certificate`` (the server's, trusted) is given."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    if certificate is None:
        return sock
    return ssl.create_default_context(cafile=str(certificate)).wrap_socket(sock, server_hostname="127.0.0.1")


class TimedJob:
    """A job's requests to the default workspace, each checked and timed (seconds)."""

    def __init__(self, base: str, token: str, process_id: str) -> None:
        self.base = f"{base}/api/w/default"
        self.process_id = process_id
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"

    def timed(self, method: str, path: str, **kw: Any) -> float:
        started = time.perf_counter()
        answer = self.session.request(method, self.base + path, timeout=30, **kw)
        assert answer.status_code in (200, 201, 204), answer.text
        return time.perf_counter() - started

    def register(self) -> float:
        return self.timed("POST", "/processes", json=process_body(self.process_id))

    def beat(self, seq: int) -> float:
        return self.timed("POST", f"/processes/{self.process_id}/heartbeat", json={"state": "RUNNING", "seq": seq})

    def beats(self, n: int) -> list[float]:
        return [self.beat(seq) for seq in range(1, n + 1)]

    def poll(self, wait: float) -> float:
        """A long-poll that ends with no command (204)."""
        started = time.perf_counter()
        answer = self.session.get(
            f"{self.base}/processes/{self.process_id}/commands/next", params={"wait": wait}, timeout=30
        )
        assert answer.status_code == 204, answer.text
        return time.perf_counter() - started
