"""Server replicas as tests run them in one process: ``create_app`` on a uvicorn server of its own on
a thread, with its own replica link, reached over real HTTP; and a dashboard's event stream read on
a thread."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import requests
import uvicorn

from flexium import protocol
from flexium.server.app import bootstrap, create_app
from flexium.server.settings import Settings
from support.live_server import free_port, wait_until


class Replica:
    """``create_app`` served by uvicorn on a thread of its own, as ``flexium server`` serves it."""

    def __init__(self, settings: Settings) -> None:
        self.app = create_app(settings)
        self.ctx = self.app.state.ctx
        self.port = free_port()
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.token = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api(self) -> str:
        return f"{self.url}/api/w/default"

    def start(self) -> Replica:
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "the replica to serve")
        wait_until(lambda: self.ctx.link is not None and self.ctx.link.listening.is_set(), 30, "its link to listen")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(20)

    def get(self, path: str, token: str | None = None, **kw: Any) -> requests.Response:
        return requests.get(self.api + path, headers=auth(token or self.token), timeout=kw.pop("timeout", 10), **kw)

    def post(self, path: str, body: Any = None, token: str | None = None) -> requests.Response:
        return requests.post(self.api + path, json=body, headers=auth(token or self.token), timeout=10)


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class EventStream:
    """``GET /events`` read on a thread: (id, event, data) as they come."""

    def __init__(
        self,
        replica: Replica,
        token: str | None,
        last_event_id: str | None = None,
        *,
        cookies: dict[str, str] | None = None,
    ) -> None:
        """``token`` None: as the dashboard's page subscribes, with its session's ``cookies``."""
        headers = {} if token is None else auth(token)
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        self.events: list[tuple[str, str, Any]] = []
        self.ended = threading.Event()
        self._response = requests.get(
            replica.api + "/events", headers=headers, cookies=cookies, stream=True, timeout=30
        )
        assert self._response.status_code == 200, self._response.text
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_for(lambda e: e[1] == protocol.EVENT_HELLO, "the hello")

    def _read(self) -> None:
        event_id, event = "", ""
        try:
            for line in self._response.iter_lines(decode_unicode=True):
                if line.startswith("id: "):
                    event_id = line[4:]
                elif line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    self.events.append((event_id, event, json.loads(line[6:])))
        except (requests.RequestException, AttributeError):  # closed by ``close`` (AttributeError: mid-read)
            pass
        finally:
            self.ended.set()

    def wait_for(self, match: Callable[[tuple[str, str, Any]], bool], what: str, timeout: float = 10) -> Any:
        return wait_until(lambda: next((e for e in self.events if match(e)), None), timeout, what, interval=0.01)

    def close(self) -> None:
        self._response.close()


@contextlib.contextmanager
def two_replicas(settings: Settings) -> Iterator[tuple[Replica, Replica]]:
    """Two replicas on ``settings``' database (at head), started, sharing the default workspace's
    admin token (``token``)."""
    a = Replica(settings)
    token = bootstrap(a.ctx.db)
    assert token
    b = Replica(settings)
    a.token = b.token = token
    started: list[Replica] = []
    try:
        for replica in (a, b):
            started.append(replica.start())
        yield a, b
    finally:
        for replica in started:
            replica.stop()
