"""Several real ``flexium server`` processes (replicas) on one PostgreSQL database behind Debian's
nginx, configured as docs/guide/server.md says (support/nginx.py): what a team runs when one
process is not enough. Jobs and the command line reach them through nginx (``address``) or one
replica directly (``servers[i].address``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import requests

from support.e2e import WORKSPACE, Server, wait_until
from support.nginx import NginxFront

START_S = 120.0  # a server's start is mostly imports, which several at once on a loaded machine slow


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """A new database on the test PostgreSQL ($FLEXIUM_TEST_POSTGRES_URL), dropped afterwards."""
    admin = os.environ.get("FLEXIUM_TEST_POSTGRES_URL")
    if not admin:
        if os.environ.get("CI"):
            raise RuntimeError("FLEXIUM_TEST_POSTGRES_URL is not set: ci/test.sh starts PostgreSQL and sets it")
        pytest.skip("replicas share a PostgreSQL database: set FLEXIUM_TEST_POSTGRES_URL")
    import psycopg

    name = "flx_" + uuid.uuid4().hex[:12]
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{admin.rsplit('/', 1)[0]}/{name}"
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Replicas:
    """``count`` servers on ``database`` and nginx in front of them; the first creates the
    workspace, all share its tokens."""

    def __init__(
        self, tmp: Path, database: str, count: int = 2, *, options: Sequence[str] = ("--stale-after", "20")
    ) -> None:
        self.servers = [Server(tmp / f"replica-{i}", options=options, database=database) for i in range(count)]
        self.front = NginxFront(tmp / "nginx", [s.port for s in self.servers])

    @property
    def address(self) -> str:
        """``FLEXIUM_SERVER`` for a job or the command line that goes through nginx."""
        return f"127.0.0.1:{self.front.port}/{WORKSPACE}"

    @property
    def api(self) -> str:
        return f"{self.front.url}/api/w/{WORKSPACE}"

    def start(self) -> Replicas:
        first = self.servers[0]
        first.create_workspace()
        for server in self.servers:
            server.token, server.job_token = first.token, first.job_token
        failures: list[BaseException] = []

        def start(server: Server) -> None:
            try:
                server.start(START_S)
            except BaseException as exc:  # said by the caller's thread
                failures.append(exc)

        # at once: each start is mostly imports, which a loaded machine makes slow
        threads = [threading.Thread(target=start, args=(server,)) for server in self.servers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            self.stop()
            raise failures[0]
        self.front.start()
        return self

    def stop(self) -> None:
        self.front.stop()
        for server in self.servers:
            server.stop(signal.SIGKILL)


class EventStream:
    """A dashboard's live events (``GET /events``) read as a browser's EventSource reads them, on
    a thread: each event's name, its data and when it arrived (``time.time()``, the clock the
    server stamps ``created_at`` with; one machine)."""

    def __init__(self, api: str, token: str) -> None:
        self.api = api
        self.token = token
        self.events: list[tuple[float, str, Any]] = []
        self._response: requests.Response | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self.opened = threading.Event()

    def start(self, timeout: float = 10.0) -> EventStream:
        self._thread.start()
        if not self.opened.wait(timeout):
            raise AssertionError(f"the event stream of {self.api} did not open within {timeout:.0f} s")
        return self

    def _read(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "text/event-stream"}
        with requests.get(f"{self.api}/events", headers=headers, stream=True, timeout=(5, 60)) as response:
            self._response = response
            self.opened.set()
            name, data = "message", ""
            try:
                for line in response.iter_lines(decode_unicode=True):
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data += line[5:].strip()
                    elif not line and data:
                        self.events.append((time.time(), name, json.loads(data)))
                        name, data = "message", ""
            except (requests.RequestException, AttributeError):
                pass  # closed by close(), or the server went away

    def wait_for(self, match: Callable[[str, Any], bool], timeout: float, what: str) -> tuple[float, str, Any]:
        return wait_until(
            lambda: next((e for e in list(self.events) if match(e[1], e[2])), None), timeout, f"an event: {what}"
        )

    def close(self) -> None:
        if self._response is not None:
            self._response.close()
        self._thread.join(5)
