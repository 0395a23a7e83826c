"""The client's long-poll against a server that answers later than the client waits: asked again
at once (the server hands out again a command whose answer the client gave up on), not after a
backoff wait, and a server that stays late is then asked with backoff."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from flexium.client.http import ApiClient, Backoff
from flexium.protocol import parse_server_address

COMMAND = {
    "id": 7,
    "kind": "pause",
    "process_id": "job-1",
    "state": "delivered",
    "target_uuid": None,
    "created_at": 1.0,
    "delivered_at": 1.0,
    "started_at": None,
    "finished_at": None,
    "deliveries": 1,
    "result": None,
    "error": None,
}


class LateServer(http.server.ThreadingHTTPServer):
    """Answers the first ``late`` polls after ``delay`` seconds, then at once with ``COMMAND``;
    records when each poll arrived."""

    def __init__(self, late: int, delay: float) -> None:
        self.late = late
        self.delay = delay
        self.arrivals: list[float] = []
        super().__init__(("127.0.0.1", 0), _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: LateServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.server.arrivals.append(time.monotonic())
        if len(self.server.arrivals) <= self.server.late:
            time.sleep(self.server.delay)
        body = json.dumps(COMMAND).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the client gave up on this one

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def late_server(request: pytest.FixtureRequest) -> Iterator[LateServer]:
    server = LateServer(*request.param)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _poll(server: LateServer) -> Any:
    api = ApiClient(parse_server_address(f"http://127.0.0.1:{server.server_address[1]}/default"), "flx_unit")
    # A long backoff: a retry that waited for it would show.
    return api.next_command("job-1", wait=0.1, stop=threading.Event(), backoff=Backoff(base=3.0, cap=3.0))


@pytest.mark.parametrize("late_server", [(2, 10.5)], indirect=True)
def test_a_late_long_poll_is_asked_again_at_once_and_then_after_a_backoff(late_server: LateServer) -> None:
    command = _poll(late_server)
    assert command is not None and command.id == 7
    first, second, third = late_server.arrivals[:3]
    assert 10.0 <= second - first < 11.0  # its timeout (wait + 10 s), and no backoff after it
    assert third - second >= 10.1 + 1.5  # late again: its timeout, then half the backoff at least


@pytest.mark.parametrize("late_server", [(100, 30.0)], indirect=True)
def test_a_server_that_stops_answering_keeps_a_wait_no_longer_than_its_deadline(late_server: LateServer) -> None:
    """`flexium pause --timeout 3` against a server that took the request and then stalls: the
    wait ends near its deadline (each attempt waits for what is left of it), not at its long-poll's
    own timeout (wait + 10 s) and again."""
    from flexium.client.http import LateAnswer

    api = ApiClient(parse_server_address(f"http://127.0.0.1:{late_server.server_address[1]}/default"), "flx_unit")
    started = time.monotonic()
    with pytest.raises(LateAnswer):
        api.wait_command(7, wait=3.0, deadline=started + 3.0)
    assert time.monotonic() - started < 3.0 + 2.0 + 1.0  # the deadline, its grace, and some slack
