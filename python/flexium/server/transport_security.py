"""Strict-Transport-Security on every answer sent over HTTPS: a browser that once reached the
server over TLS then refuses plain HTTP to it for a year, so that no one on the network can
strip the TLS off its next visit (and take the dashboard's session cookie). Answers over plain
HTTP never carry it (RFC 6797 forbids it there). Behind a proxy that ends TLS, uvicorn reads the
scheme from the proxy's ``X-Forwarded-Proto``, so those answers carry it too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

HEADER = (b"strict-transport-security", b"max-age=31536000")


class StrictTransportSecurity:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or scope.get("scheme") != "https":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), HEADER]}
            await send(message)

        await self.app(scope, receive, send_with_header)
