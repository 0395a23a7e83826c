"""A request's header block is bounded (--max-header-bytes, 64 KiB; --max-header-lines, 200), as
nginx and Go bound theirs, over plain HTTP and over TLS (a real server process, raw sockets): a
100 KiB block and a 10,000-line block each get 431, naming the bound and the setting that raises
it, and a closed connection, soon; a block at the bound is served; a flood of oversized blocks
leaves an honest client on another connection served."""

from __future__ import annotations

import json
import re
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from flexium.server.settings import Settings
from support.connection_clients import TimedJob, connect, read_to_end, self_signed_certificate
from support.live_server import ServerProcess, clean_env

pytestmark = pytest.mark.timeout(180)

MAX_BYTES = Settings().max_header_bytes
MAX_LINES = Settings().max_header_lines
# After its 431 the server closes the connection at once over plain HTTP, and within 2 s over TLS
# (it waits until the client has been quiet for half a second); four times that on a loaded machine.
CLOSED_WITHIN_S = 8.0
SERVED_WITHIN_S = 1.0
FLOOD = 200


class Server:
    def __init__(self, process: ServerProcess, certificate: Path | None) -> None:
        self.process = process
        self.certificate = certificate

    def exchange(self, head: bytes) -> tuple[int | None, bytes, float]:
        """Sends ``head`` (a request line and its header block) on a new connection; the answer's
        status, its body and how long the server took to close the connection after it was sent."""
        with connect(self.process.port, certificate=self.certificate) as sock:
            sock.sendall(head)
            received, closed_after = read_to_end(sock)
        status_line, _, rest = received.partition(b"\r\n")
        status = int(status_line.split()[1]) if status_line.startswith(b"HTTP/1.1 ") else None
        return status, rest.partition(b"\r\n\r\n")[2], closed_after


@pytest.fixture(scope="module", params=["http", "https"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp(request.param)
    args: tuple[str, ...] = ()
    certificate = None
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "https":
            certificate, key = self_signed_certificate(home / "tls")
            args = ("--certfile", str(certificate), "--keyfile", str(key))
            patch.setenv("REQUESTS_CA_BUNDLE", str(certificate))  # this test's requests trust it
        process = ServerProcess(home, *args, env=clean_env(home)).start()
        yield Server(process, certificate)
        process.stop(signal.SIGKILL)


def _head(*header_lines: bytes) -> bytes:
    return b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + b"".join(header_lines) + b"\r\n"


def _head_of(size: int) -> bytes:
    """A request whose header block, its request line and final empty line included, is ``size``
    bytes: a long bearer token, a browser's cookies and one cookie that makes up the rest."""
    token = b"Authorization: Bearer flx_" + b"t" * 252 + b"\r\n"
    cookies = b"".join(b"Cookie: c%d=%s\r\n" % (i, b"v" * 4000) for i in range(3))
    padding = size - len(_head(token, cookies, b"Cookie: rest=\r\n"))
    assert padding >= 0
    head = _head(token, cookies, b"Cookie: rest=" + b"r" * padding + b"\r\n")
    assert len(head) == size
    return head


def _lines(count: int) -> bytes:
    """A request with ``count`` header lines, Host and Connection among them."""
    return _head(*(b"X-Line-%d: %d\r\n" % (i, i) for i in range(count - 2)))


def _refusal(body: bytes) -> dict[str, str]:
    answer = json.loads(body)
    assert answer["error"] == "header_fields_too_large"
    return dict(answer)


@pytest.mark.parametrize(
    ("head", "bound", "setting"),
    [
        (
            _head(b"Cookie: " + b"c" * (100 << 10) + b"\r\n"),
            f"over {MAX_BYTES} bytes",
            "--max-header-bytes or FLEXIUM_MAX_HEADER_BYTES",
        ),
        (_lines(10_000), f"over {MAX_LINES} header lines", "--max-header-lines or FLEXIUM_MAX_HEADER_LINES"),
    ],
    ids=["100 KiB", "10,000 lines"],
)
def test_an_oversized_header_block_is_refused_431_and_closed(
    server: Server, head: bytes, bound: str, setting: str
) -> None:
    status, body, closed_after = server.exchange(head)
    assert status == 431
    message = _refusal(body)["message"]
    assert bound in message and setting in message
    assert closed_after < CLOSED_WITHIN_S


def test_a_header_block_at_the_bounds_is_served_and_one_past_them_is_not(server: Server) -> None:
    assert server.exchange(_head_of(MAX_BYTES))[0] == 200
    assert server.exchange(_head_of(MAX_BYTES + 1))[0] == 431
    assert server.exchange(_lines(MAX_LINES))[0] == 200
    assert server.exchange(_lines(MAX_LINES + 1))[0] == 431


def test_requests_pipelined_in_one_write_are_each_answered_in_turn(server: Server) -> None:
    """The parser is fed a connection's bytes in pieces; requests sent back to back, large header
    blocks among them, each get their answer, and one past the bound its 431 after theirs."""
    large = _head_of(MAX_BYTES // 2).replace(b"Connection: close\r\n", b"")
    small = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with connect(server.process.port, certificate=server.certificate) as sock:
        sock.sendall(large + small + large + _head(b"Cookie: " + b"c" * MAX_BYTES + b"\r\n"))
        received, _ = read_to_end(sock)
    statuses = [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", received)]
    assert statuses == [200, 200, 200, 431], received[-400:]


def test_a_flood_of_oversized_header_blocks_leaves_an_honest_client_served(
    server: Server, capsys: pytest.CaptureFixture[str]
) -> None:
    process = server.process
    assert process.token
    job = TimedJob(process.url, process.token, "honest-job")
    job.register()
    oversized = [_head(b"Cookie: " + b"c" * (100 << 10) + b"\r\n"), _lines(10_000)]
    flooding = threading.Event()
    flooding.set()
    results: list[tuple[int | None, bytes, float]] = []

    def flood() -> None:
        with ThreadPoolExecutor(8) as pool:
            results.extend(pool.map(server.exchange, (oversized[i % 2] for i in range(FLOOD))))
        flooding.clear()

    flooder = threading.Thread(target=flood)
    started = time.monotonic()
    flooder.start()
    served = []
    while flooding.is_set():
        served.append(job.beat(len(served) + 1))
    flooder.join()
    took = time.monotonic() - started
    assert [status for status, _, _ in results] == [431] * FLOOD
    assert max(closed_after for _, _, closed_after in results) < CLOSED_WITHIN_S
    assert served and statistics.median(served) < SERVED_WITHIN_S, served
    assert requests.get(f"{process.url}/healthz", timeout=10).status_code == 200
    assert any("refused a request from 127.0.0.1" in line for line in process.lines), process.lines[-5:]
    with capsys.disabled():
        print(
            f"\nFIGURES header-block flood ({'https' if server.certificate else 'http'}): {FLOOD} requests of "
            f"100 KiB or 10,000 header lines from 8 threads, all 431 in {took:.1f} s (closed within "
            f"{max(c for _, _, c in results):.2f} s of sending); {len(served)} heartbeats meanwhile, median "
            f"{statistics.median(served) * 1000:.0f} ms, max {max(served) * 1000:.0f} ms"
        )


def test_the_bounds_are_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--max-header-bytes must be at least 8192 bytes, not 4096"):
        Settings(max_header_bytes=4096)
    with pytest.raises(ValueError, match="--max-header-lines must be at least 40 lines, not 20"):
        Settings(max_header_lines=20)
    env = {**clean_env(tmp_path), "FLEXIUM_MAX_HEADER_LINES": "50"}
    process = ServerProcess(tmp_path, "--max-header-bytes", "16384", env=env).start()
    try:
        plain = Server(process, None)
        assert plain.exchange(_lines(50))[0] == 200
        status, body, _ = plain.exchange(_lines(51))
        assert status == 431 and "over 50 header lines" in _refusal(body)["message"]
        assert plain.exchange(_head_of(16384))[0] == 200
        status, body, _ = plain.exchange(_head_of(16385))
        assert status == 431 and "over 16384 bytes" in _refusal(body)["message"]
    finally:
        process.stop(signal.SIGKILL)
