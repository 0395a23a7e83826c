"""A request that never reached the server (no connection could be made) is told apart from one
whose answer was lost (the connection was made, then cut): only the first may be sent again without
making what it asks for twice, which flexium run relies on to wait for a restarting server."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from flexium import wire
from flexium.cli import run as run_cli
from flexium.client.http import ApiClient, NotDelivered, Unreachable
from flexium.protocol import parse_server_address


def closed_port() -> int:
    """A port of 127.0.0.1 where nothing listens (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def cutting_server() -> Iterator[int]:
    """Accepts each connection, reads the request and closes it without an answer."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)

    threading.Thread(target=serve, daemon=True).start()
    yield int(listener.getsockname()[1])
    listener.close()


def client(port: int) -> ApiClient:
    return ApiClient(parse_server_address(f"http://127.0.0.1:{port}/default"), "flx_unit")


def test_a_refused_connection_never_delivered_the_request() -> None:
    with pytest.raises(NotDelivered) as refused:
        client(closed_port()).request("POST", "/placements", json={})
    assert "cannot reach the flexium server at http://127.0.0.1:" in refused.value.message


def test_a_connection_cut_after_the_request_may_have_delivered_it(cutting_server: int) -> None:
    with pytest.raises(Unreachable) as cut:
        client(cutting_server).request("POST", "/placements", json={}, timeout=5)
    assert not isinstance(cut.value, NotDelivered), cut.value.message


def _request() -> wire.PlacementRequest:
    return wire.PlacementRequest(host="node1", memory_bytes=0, priority=50, command="python t.py", devices=[])


def test_flexium_run_asks_again_until_the_server_is_reached(monkeypatch: pytest.MonkeyPatch) -> None:
    created = wire.PlacementCreated.model_construct(placement=None, commands=[])
    down = NotDelivered("cannot reach the flexium server at http://s: refused", code="unreachable")
    answers: list[object] = [down, down, created]
    sent: list[wire.PlacementRequest] = []

    class Api:
        def create_placement(self, body: wire.PlacementRequest) -> object:
            sent.append(body)
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    said: list[str] = []
    monkeypatch.setattr(run_cli, "TRY_AGAIN_EVERY_S", 0.0)
    monkeypatch.setattr(run_cli, "_say", said.append)
    assert run_cli._create_placement(Api(), _request()) is created  # type: ignore[arg-type]
    assert len(sent) == 3
    assert said == [f"{down.message}; trying again for up to 60 s (Ctrl-C stops)"]


def test_flexium_run_gives_up_after_its_patience_and_never_resends_what_may_have_arrived(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(run_cli, "TRY_AGAIN_EVERY_S", 0.01)
    monkeypatch.setattr(run_cli, "SERVER_PATIENCE_S", 0.2)
    monkeypatch.setattr(run_cli, "_say", lambda _text: None)
    calls = {"n": 0}

    class Down:
        def create_placement(self, body: wire.PlacementRequest) -> object:
            calls["n"] += 1
            raise NotDelivered("refused", code="unreachable")

    with pytest.raises(NotDelivered):
        run_cli._create_placement(Down(), _request())  # type: ignore[arg-type]
    assert calls["n"] > 2

    class Cut:
        def create_placement(self, body: wire.PlacementRequest) -> object:
            calls["n"] += 1
            raise Unreachable("connection aborted", code="unreachable")

    calls["n"] = 0
    with pytest.raises(Unreachable):
        run_cli._create_placement(Cut(), _request())  # type: ignore[arg-type]
    assert calls["n"] == 1
