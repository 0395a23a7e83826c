"""The benchmarks' HTTP client: a minimal HTTP/1.1 keep-alive client on asyncio, so that the 2
cores of a small machine go to the server rather than to client overhead (bench/server.py,
bench/fleet.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any


class HttpError(Exception):
    pass


class Conn:
    """One keep-alive connection; one request at a time (callers hold ``lock``)."""

    def __init__(self, port: int, token: str) -> None:
        self.port = port
        self.auth = f"Authorization: Bearer {token}\r\n"
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.lock = asyncio.Lock()

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def request(self, method: str, path: str, body: Any = None, *, timeout: float = 60.0) -> tuple[int, Any]:
        payload = b"" if body is None else json.dumps(body).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{self.auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode()
        for attempt in (0, 1):
            if self.writer is None:
                await self._connect()
            assert self.reader is not None and self.writer is not None
            try:
                self.writer.write(head + payload)
                return await asyncio.wait_for(self._read(), timeout)
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                self.close()
                if attempt:
                    raise
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self.close()  # its answer must not be read as the next request's
                raise
        raise HttpError("unreachable")

    async def _read(self) -> tuple[int, Any]:
        assert self.reader is not None
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length, close = 0, False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "connection" and value.strip().lower() == "close":
                close = True
        data = await self.reader.readexactly(length) if length else b""
        if close:
            self.close()
        return status, (json.loads(data) if data else None)


def tune_client() -> None:
    """uvloop when installed, and the client's garbage collector out of the way: its own
    collections must not show as the server's latency."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    import gc

    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


async def read_events(
    port: int, token: str, path: str, on_event: Callable[[str, Any], None], opened: asyncio.Event
) -> None:
    """A dashboard's live events (server-sent events at ``path``): ``on_event(name, data)`` for
    each as it arrives, until the connection closes or the task is cancelled."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            "Accept: text/event-stream\r\n\r\n".encode()
        )
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        if not head.startswith(("http/1.1 200", "http/1.0 200")):
            raise HttpError(f"event stream {path}: {head.splitlines()[0]}")
        opened.set()
        buffer = b""
        async for piece in _body(reader, chunked="transfer-encoding: chunked" in head):
            buffer += piece
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                name, data = "message", ""
                for line in event.decode().splitlines():
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data += line[5:].strip()
                if data:
                    on_event(name, json.loads(data))
    finally:
        writer.close()


async def _body(reader: asyncio.StreamReader, *, chunked: bool) -> AsyncIterator[bytes]:
    """A response body as it arrives, its chunked framing undone."""
    while True:
        if not chunked:
            data = await reader.read(65536)
            if not data:
                return
            yield data
            continue
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)
