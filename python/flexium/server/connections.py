"""Bounds on the server's connections, below the ASGI app (uvicorn's HTTP protocol, subclassed,
under a TLS layer of our own when the server serves HTTPS).

uvicorn closes a keep-alive connection that stays idle between requests, but nothing closes one
that sends nothing, half of its headers, or no TLS handshake: each holds a file descriptor, and
about a thousand of them used to leave none for the jobs' heartbeats and polls. Here, as Go's
net/http and nginx do, a connection is counted and timed from the moment it is accepted:
- it must finish its TLS handshake and deliver a whole request within ``request_timeout_s`` of
  being accepted (a later request on a kept-alive connection: of its first byte), and its body
  within ``body_timeout_s`` of its headers; else it is answered 408 (when its headers are
  incomplete, so no answer is under way) and closed. Long-polls and event streams are not
  affected: their request is complete at once, only the answer takes long.
- past ``max_connections`` open connections, or a client address's bound, one that owes no
  answer makes room (``connection_book.py``), a handshake before an idle one.
Each request is stamped with the time it began to arrive (``received_at``).

HTTPS is done by ``TlsAccepted``, asyncio's TLS protocol (``asyncio.sslproto``, which the event
loops' own ``create_server(ssl=...)`` use) wrapped around the HTTP protocol: handed to the event
loop as a plain TCP protocol, it sees each connection at accept, where the loop's own TLS would
show the HTTP protocol a connection only once its handshake is done (and keep a stalled
handshake 60 s; uvicorn does not let that be set).
"""

from __future__ import annotations

import asyncio
import logging
import math
import resource
import ssl
import time
from asyncio.sslproto import SSLProtocol
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from flexium.server.connection_book import Connection, ConnectionBook, Phase

log = logging.getLogger("flexium.server")

_TIMEOUT_ANSWER = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 46\r\nconnection: close\r\n\r\nthe request did not arrive in time; reconnect\n"
)
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


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """The server's side of TLS (``tls_certificate.check_certificate`` has read both files at start)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certfile, keyfile)
    return context


def bounded_protocol(
    *, request_timeout_s: float, body_timeout_s: float, book: ConnectionBook, tls: ssl.SSLContext | None
) -> type[asyncio.Protocol]:
    """The protocol uvicorn makes for each accepted connection (its ``http`` class): uvicorn's
    httptools protocol with the bounds above, under ``TlsAccepted`` when ``tls`` is given."""

    class BoundedHttpProtocol(HttpToolsProtocol):
        connection: Connection | None = None  # set by TlsAccepted before its handshake
        _request_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if self.connection is None:  # plain HTTP: accepted just now
                self.connection = Connection(address=_address(transport), close=transport.close)
                book.accepted(self.connection)
            else:
                book.enter(self.connection, Phase.IDLE)
            since_accept = time.monotonic() - self.connection.accepted_at
            self._start_timer(request_timeout_s - since_accept)

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_timer()
            if self.connection is not None and not tls:
                book.closed(self.connection)
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope["state"][_RECEIVED_AT] = time.monotonic()
            if self._request_timer is None:  # a later request on a kept-alive connection
                self._start_timer(request_timeout_s)

        def on_headers_complete(self) -> None:
            assert self.connection is not None
            book.enter(self.connection, Phase.BUSY)  # owed an answer: not closed to make room
            if self._request_timer is not None:
                left = self._request_timer.when() - self.loop.time()
                if left > body_timeout_s:
                    self._stop_timer()
                    self._start_timer(body_timeout_s)
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._stop_timer()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.connection is not None and not self.transport.is_closing() and not self.pipeline:
                book.enter(self.connection, Phase.IDLE)  # kept alive, waiting for the next request

        def _start_timer(self, seconds: float) -> None:
            self._request_timer = self.loop.call_later(max(seconds, 0.0), self._request_too_slow)

        def _stop_timer(self) -> None:
            if self._request_timer is not None:
                self._request_timer.cancel()
                self._request_timer = None

        def _request_too_slow(self) -> None:
            self._request_timer = None
            if self.transport.is_closing() or self.connection is None:
                return
            if self.connection.phase is not Phase.BUSY:  # headers incomplete: no answer has begun
                self.transport.write(_TIMEOUT_ANSWER)
            book.warn(
                "closed a connection from %s that sent no complete request within %g s of its start, "
                "or no body within %g s of its headers (--request-timeout, --body-timeout)",
                self.connection.address,
                request_timeout_s,
                body_timeout_s,
            )
            self.connection.close()

    if tls is None:
        return BoundedHttpProtocol
    context = tls

    class TlsAccepted(SSLProtocol):
        """TLS over an accepted socket, the HTTP protocol above inside it; the connection is in
        the book from accept, its handshake bounded by the request timeout."""

        def __init__(self, **uvicorn_arguments: Any) -> None:
            self.http = BoundedHttpProtocol(**uvicorn_arguments)
            super().__init__(
                self.http.loop,
                self.http,
                context,
                None,  # type: ignore[arg-type]  # no one awaits the handshake: asyncio takes None
                server_side=True,
                ssl_handshake_timeout=math.ceil(request_timeout_s),
            )

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.http.connection = Connection(address=_address(transport), close=transport.close, phase=Phase.HANDSHAKE)
            book.accepted(self.http.connection)

        def connection_lost(self, exc: BaseException | None) -> None:
            if self.http.connection is not None:
                book.closed(self.http.connection)
            super().connection_lost(exc)

    return TlsAccepted


def _address(transport: Any) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"
