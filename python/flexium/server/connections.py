"""Bounds on the server's connections, below the ASGI app (uvicorn's HTTP protocol, subclassed).

uvicorn closes a keep-alive connection that stays idle between requests, but nothing closes one
that sends nothing, or half of its headers: each holds a file descriptor for good, and about a
thousand of them used to leave no descriptor for the jobs' heartbeats and polls. Here:
- a connection must deliver a whole request (headers and body) within ``request_timeout_s`` of
  opening, or of starting that request on a kept-alive connection; else it is answered 408 (when
  no answer is under way) and closed. Long-polls and event streams are not affected: their
  request is complete at once, only the answer takes long.
- past ``max_connections`` open connections, the oldest one that is not inside a request (it
  has not sent one yet, or is idle between two) is closed to make room; when every connection is
  busy with a request, the new one is closed instead.
Each request is stamped with the time it began to arrive (``received_at``).
Under HTTPS a connection reaches this protocol once its TLS handshake is done; one that never
finishes it is closed by the event loop after its own handshake timeout (60 s in asyncio and
uvloop; uvicorn does not expose it).
"""

from __future__ import annotations

import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("flexium.server")

_TIMEOUT_ANSWER = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 46\r\nconnection: close\r\n\r\nthe request did not arrive in time; reconnect\n"
)
_WARN_EVERY_S = 10.0
_RECEIVED_AT = "flexium_received_at"


def received_at(scope: Any) -> float | None:
    """When the request began to arrive (``time.monotonic()``), as stamped below; None for a request
    that came another way (tests call the app directly). A server that is behind runs a handler
    well after its request arrived, and a long-poll's wait is counted from the arrival."""
    state = scope.get("state")
    return None if state is None else state.get(_RECEIVED_AT)


def raise_open_file_limit() -> int:
    """Raises this process's soft limit on open files to its hard limit (every connection is one);
    returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return soft if soft != resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("could not raise the open file limit from %d to %d: %s", soft, hard, exc)
        return soft
    return hard


def connection_limit(wanted: int, open_files: int) -> int:
    """At most ``wanted`` connections, leaving descriptors for the database, logs and the
    listening socket."""
    return max(16, min(wanted, open_files - 64))


def bounded_protocol(*, request_timeout_s: float, max_connections: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with the bounds above (one class per server: it keeps the
    server's connections that are outside a request, oldest first)."""
    idle: dict[HttpToolsProtocol, None] = {}  # insertion-ordered: the oldest first
    last_warning = [0.0]

    def warn(message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - last_warning[0] >= _WARN_EVERY_S:
            last_warning[0] = now
            log.warning(message, *args)

    class BoundedHttpProtocol(HttpToolsProtocol):
        _request_timer: Any | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._await_request()
            if len(self.connections) > max_connections:
                self._make_room()

        def connection_lost(self, exc: Exception | None) -> None:
            self._request_arrived()
            idle.pop(self, None)
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope["state"][_RECEIVED_AT] = time.monotonic()
            self._await_request()

        def on_headers_complete(self) -> None:
            idle.pop(self, None)  # inside a request now: not closed to make room
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._request_arrived()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline:
                idle[self] = None  # kept alive, waiting for the next request

        def _await_request(self) -> None:
            """The clock starts when the connection opens (not again when its first request's
            first byte arrives) and when a later request on it begins."""
            idle[self] = None
            if self._request_timer is None:
                self._request_timer = self.loop.call_later(request_timeout_s, self._request_too_slow)

        def _request_arrived(self) -> None:
            if self._request_timer is not None:
                self._request_timer.cancel()
                self._request_timer = None

        def _request_too_slow(self) -> None:
            self._request_timer = None
            if self.transport.is_closing():
                return
            if self in idle:  # its headers are incomplete, so no answer to it has begun
                self.transport.write(_TIMEOUT_ANSWER)
            warn(
                "closed a connection from %s that sent no complete request within %g s "
                "(--request-timeout; this message is shown at most every %g s)",
                self.client[0] if self.client else "?",
                request_timeout_s,
                _WARN_EVERY_S,
            )
            self.transport.close()

        def _make_room(self) -> None:
            victim = next((c for c in idle if c is not self), None)
            if victim is None:
                warn(
                    "refused a connection: %d open, all inside a request (--max-connections %d)",
                    len(self.connections),
                    max_connections,
                )
                self.transport.close()
                return
            idle.pop(victim, None)
            warn(
                "closed the oldest connection outside a request to make room: %d open (--max-connections %d)",
                len(self.connections),
                max_connections,
            )
            victim.transport.close()

    return BoundedHttpProtocol
