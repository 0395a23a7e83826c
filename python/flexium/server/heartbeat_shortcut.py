"""A shortcut in front of FastAPI for the one request that dominates traffic: the plain
heartbeat (valid body, cached token, known process, nothing changed but the time).

At thousands of jobs, heartbeats are most requests, and FastAPI's routing, dependency
solving and response validation cost several times the work such a heartbeat needs. This
pure ASGI layer answers it from memory with the same model (``wire.HeartbeatRequest``), the
same token cache and the same ``services.heartbeat_from_memory``; anything else — an unknown token, a change to
store, a body it cannot validate, a stale or unknown process — goes to the FastAPI route
untouched (the body is replayed), which gives the full answer or error. Tests run every
heartbeat case through both.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from flexium import protocol, wire
from flexium.server import services
from flexium.server.auth import cached_token, may_beat_from_memory, scope_bearer_token
from flexium.server.context import ServerContext

_HEARTBEAT = re.compile(r"^/api/w/([^/]+)/processes/([^/]+)/heartbeat$")


class HeartbeatShortcut:
    def __init__(self, app: Any, ctx: ServerContext) -> None:
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Any, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        match = _HEARTBEAT.match(scope["path"])
        if match is None:
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        answer = self._answer(scope, match.group(1), match.group(2), body)
        if answer is not None:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": answer})
            return
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _answer(self, scope: Any, workspace: str, process_id: str, body_bytes: bytes) -> bytes | None:
        ctx = self.ctx
        token = scope_bearer_token(scope)
        if token is None or not protocol.PROCESS_ID_RE.fullmatch(process_id):
            return None
        now = time.time()
        auth = cached_token(ctx, token, now)
        if auth is None or auth.workspace != workspace or not may_beat_from_memory(ctx, auth, process_id):
            return None
        try:
            body = wire.HeartbeatRequest.model_validate_json(body_bytes or b"{}")
        except ValidationError:
            return None
        answer = services.heartbeat_from_memory(
            ctx, workspace_id=auth.workspace_id, process_id=process_id, body=body, now=now
        )
        if answer is not None:
            ctx.token_used(auth.token_id, now)
        return None if answer is None else answer.model_dump_json().encode()
