"""A real server process under a flood of connections that never send a whole request: jobs
still register, heartbeat and poll; the flood is closed after --request-timeout; long-polls and
event streams longer than that bound are not cut. The figures measured are printed (they go
into docs/ under the reliability heading)."""

from __future__ import annotations

import signal
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from support.connection_clients import TimedJob, closed_by_server, open_sockets
from support.live_server import ServerProcess, clean_env, wait_until
from support.server import LiveServer

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("enough_file_descriptors")]

REQUEST_TIMEOUT_S = 8.0
# A request answered at once, on a machine shared with other work (CI's has two cores): the failures
# looked for here (a request queued behind the flood until --request-timeout closes it, refused, cut)
# show as errors or as waits of REQUEST_TIMEOUT_S or more, so half of it leaves room for a slow
# machine without letting them through. A 1 s long-poll takes its second more.
AT_ONCE_S = REQUEST_TIMEOUT_S / 2
IDLE_CONNECTIONS = 1000
HALF_HEADER_CONNECTIONS = 200


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LiveServer]:
    srv = LiveServer("", str(tmp_path / "home"), "--request-timeout", str(REQUEST_TIMEOUT_S)).start()
    yield srv
    srv.stop(signal.SIGKILL)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _flood(port: int, idle: int, half: int) -> list[socket.socket]:
    held = []
    for i in range(idle + half):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if i >= idle:  # the request line and part of the headers, never the end
            sock.sendall(b"GET /api/w/default/processes HTTP/1.1\r\nHost: flood\r\nX-Slow: ")
        held.append(sock)
    return held


def test_jobs_are_served_through_a_flood_of_idle_and_half_header_connections(
    server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert server.proc is not None and server.token
    pid = server.proc.pid
    job = TimedJob(server.url, server.token, "flood-job")
    job.register()
    before = job.beats(20)
    rss_before = _rss_mib(pid)

    opened = time.monotonic()
    flood = _flood(server.port, IDLE_CONNECTIONS, HALF_HEADER_CONNECTIONS)
    try:
        held = wait_until(
            lambda: (n := open_sockets(pid)) >= IDLE_CONNECTIONS + HALF_HEADER_CONNECTIONS and n,
            REQUEST_TIMEOUT_S / 2,
            "the server to accept the flood",
        )
        register_s = TimedJob(server.url, server.token, "late-job").register()
        during = job.beats(20)
        poll_s = job.poll(1)
        rss_during = _rss_mib(pid)
        served_within = time.monotonic() - opened
        assert served_within < REQUEST_TIMEOUT_S, "the flood was closed before the job was measured inside it"
        assert register_s < AT_ONCE_S
        assert max(during) < AT_ONCE_S, during
        assert 0.9 < poll_s < 1 + AT_ONCE_S

        # Past the bound every flood connection is closed (408 and EOF), none is left holding.
        deadline = opened + REQUEST_TIMEOUT_S + 30
        remaining = list(flood)
        while remaining and time.monotonic() < deadline:
            remaining = [s for s in remaining if not closed_by_server(s)]
            time.sleep(0.5)
        closed_after = time.monotonic() - opened
        assert not remaining, f"{len(remaining)} flood connections still open {closed_after:.0f} s after opening"
        assert closed_after >= REQUEST_TIMEOUT_S - 0.5
        after = job.beats(5)
        assert max(after) < AT_ONCE_S
    finally:
        for sock in flood:
            sock.close()
    with capsys.disabled():
        print(
            "\nFIGURES connection flood: "
            f"{IDLE_CONNECTIONS} idle + {HALF_HEADER_CONNECTIONS} half-header connections held "
            f"({held} sockets open in the server); heartbeat median/max "
            f"{statistics.median(before) * 1000:.1f}/{max(before) * 1000:.1f} ms before, "
            f"{statistics.median(during) * 1000:.1f}/{max(during) * 1000:.1f} ms during the flood; "
            f"a new job registered in {register_s * 1000:.1f} ms, a 1 s long-poll answered in {poll_s:.2f} s; "
            f"server RSS {rss_before:.0f} MiB before, {rss_during:.0f} MiB during; "
            f"all closed {closed_after:.1f} s after opening (--request-timeout {REQUEST_TIMEOUT_S:g})"
        )


def test_a_flood_past_the_open_file_limit_leaves_room_for_jobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The failure the issue found: with 1024 descriptors, about a thousand idle connections
    left none for the jobs. Now the limit leaves a reserve and the oldest idle connections make
    room: a job's requests go through the whole flood, none of them refused."""
    home = tmp_path / "home"
    srv = ServerProcess(
        home,
        "--request-timeout",
        "60",  # the flood stays: only eviction makes room
        env=clean_env(home),
        prefix=("prlimit", "--nofile=1024:1024", "--"),
    ).start()
    try:
        assert srv.proc is not None and srv.token
        assert any("open file limit 1024: up to 960 connections" in line for line in srv.lines), srv.lines
        job = TimedJob(srv.url, srv.token, "crowded-job")
        job.register()
        flood = _flood(srv.port, IDLE_CONNECTIONS, HALF_HEADER_CONNECTIONS)
        try:
            wait_until(
                # the job's own idle connections are among the oldest: some of the room is theirs
                lambda: sum(1 for s in flood if closed_by_server(s)) >= len(flood) - 960 - 4,
                30,
                "the oldest flood connections to be closed",
            )
            register_s = TimedJob(srv.url, srv.token, "late-job").register()
            beats = job.beats(20)
            poll_s = job.poll(1)
            held = open_sockets(srv.proc.pid)
            assert held <= 1024
            assert register_s < AT_ONCE_S and max(beats) < AT_ONCE_S and 0.9 < poll_s < 1 + AT_ONCE_S
        finally:
            for sock in flood:
                sock.close()
    finally:
        srv.stop(signal.SIGKILL)
    with capsys.disabled():
        print(
            f"\nFIGURES flood past a 1024 descriptor limit: {len(flood)} connections opened, the server held {held}; "
            f"a new job registered in {register_s * 1000:.1f} ms, heartbeat max {max(beats) * 1000:.1f} ms, "
            f"a 1 s long-poll answered in {poll_s:.2f} s"
        )


def test_long_polls_and_event_streams_outlive_the_request_timeout(server: LiveServer) -> None:
    """Their request arrives at once; only the answer takes long, which the bound does not cover."""
    assert server.token
    job = TimedJob(server.url, server.token, "patient-job")
    job.register()
    assert job.poll(REQUEST_TIMEOUT_S + 2) >= REQUEST_TIMEOUT_S + 1.5
    with requests.get(
        f"{server.url}/api/w/default/events",
        headers={"Authorization": f"Bearer {server.token}"},
        stream=True,
        timeout=30,
    ) as stream:
        assert stream.status_code == 200
        started = time.monotonic()
        received = b""
        for chunk in stream.iter_content(chunk_size=None):
            received += chunk
            if time.monotonic() - started > REQUEST_TIMEOUT_S + 2:
                break
        assert time.monotonic() - started > REQUEST_TIMEOUT_S + 2  # not cut at the bound
        assert b"event: hello" in received


def test_past_max_connections_the_oldest_idle_one_makes_room(tmp_path: Path) -> None:
    srv = LiveServer("", str(tmp_path / "home"), "--max-connections", "100", "--request-timeout", "60").start()
    try:
        assert srv.proc is not None and srv.token
        flood = _flood(srv.port, 150, 0)
        try:
            job = TimedJob(srv.url, srv.token, "room-job")
            job.register()  # its connection evicts the oldest idle one, not itself
            assert max(job.beats(5)) < AT_ONCE_S
            time.sleep(1)
            closed = sum(1 for s in flood if closed_by_server(s))
            assert closed >= 50  # 150 opened against a limit of 100
            assert closed < 150
            assert any("closed the oldest connection outside a request" in line for line in srv.lines)
        finally:
            for sock in flood:
                sock.close()
    finally:
        srv.stop(signal.SIGKILL)


def test_requests_past_max_requests_are_answered_503_with_retry_after(tmp_path: Path) -> None:
    srv = LiveServer("", str(tmp_path / "home"), "--max-requests", "2").start()
    try:
        assert srv.token
        waiting = [TimedJob(srv.url, srv.token, f"waiter-{i}") for i in range(2)]
        for job in waiting:
            job.register()
        import threading

        polls = [threading.Thread(target=job.poll, args=(4,)) for job in waiting]
        for t in polls:
            t.start()
        time.sleep(1.0)  # both long-polls are in progress
        r = requests.get(f"{srv.url}/healthz", timeout=10)
        assert r.status_code == 503
        assert r.headers["Retry-After"] == "1"
        assert r.json()["error"] == "unavailable"
        assert "--max-requests or FLEXIUM_MAX_REQUESTS" in r.json()["message"]
        for t in polls:
            t.join(20)
        assert requests.get(f"{srv.url}/healthz", timeout=10).status_code == 200
    finally:
        srv.stop(signal.SIGKILL)


def test_a_body_that_never_arrives_is_cut_at_the_bound(tmp_path: Path) -> None:
    """Headers complete, the body promised and never sent: the request waits for it no longer
    than the bound, and no answer is made up for it."""
    srv = LiveServer("", str(tmp_path / "home"), "--request-timeout", "2").start()
    try:
        assert srv.token
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        started = time.monotonic()
        sock.sendall(
            b"POST /api/w/default/processes HTTP/1.1\r\nHost: slow\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + srv.token.encode() + b"\r\nContent-Length: 100\r\n\r\n{"
        )
        received = b""
        while chunk := sock.recv(4096):
            received += chunk
        closed_after = time.monotonic() - started
        sock.close()
        assert 1.5 < closed_after < 4 * 2  # no sooner than the 2 s bound; four times it on a slow machine
        assert not received.startswith(b"HTTP/1.1 2")
        assert TimedJob(srv.url, srv.token, "fine-job").register() < AT_ONCE_S
        listed = requests.get(
            f"{srv.url}/api/w/default/processes", headers={"Authorization": f"Bearer {srv.token}"}, timeout=10
        )
        assert [p["process_id"] for p in listed.json()] == ["fine-job"]
    finally:
        srv.stop(signal.SIGKILL)
