"""Refused writes and logins in the audit log. A request refused 401 or 403 (no token, a wrong
one, or a role that may not) changes nothing, yet who tried is worth keeping; anyone can send
them by the thousand, so each is counted here, in memory, by (workspace, token, address, action,
and the request's method and route),
and the counts are written together every ``FLUSH_S``: an access entry per key, its repeats
counted in the entry before within the hour (``storage.audit``). A flood costs the database a
write every few seconds and the log a row per sender an hour.

A refusal that names no workspace of this server (a login with an unknown token) has no log to
go to: the server's own log says it, counted the same way."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from flexium.server import storage
from flexium.server.errors import ApiError
from flexium.server.storage import AuthInfo

if TYPE_CHECKING:  # context imports this module
    from flexium.server.context import ServerContext

log = logging.getLogger("flexium.server")

FLUSH_S = 2.0
_READS = ("GET", "HEAD", "OPTIONS")
MAX_KEYS = 1000  # senders held between two writes; past it, more are counted as one


@dataclass(frozen=True)
class RefusalKey:
    workspace: str | None  # its name, as the request's path gave it; None: none named
    token_id: int | None
    address: str
    action: str  # "request.refused", "login.refused"
    what: str = ""  # the request's method and route ("POST /api/w/{workspace}/tokens"): refusals of one kind


@dataclass
class _Counted:
    auth: AuthInfo | None
    times: int
    detail: str  # the last one's


def request_refused(request: Request, exc: ApiError) -> None:
    """A write refused 401 or 403 is noted (a read changes nothing, and a dashboard left open
    after its logout asks again every few seconds)."""
    if exc.status not in (401, 403) or request.method in _READS:
        return
    ctx: ServerContext = request.app.state.ctx
    route = getattr(request.scope.get("route"), "path", request.url.path)  # the route: ids do not split the count
    ctx.refusals.note(
        ctx,
        workspace=request.scope.get("path_params", {}).get("workspace"),
        auth=getattr(request.state, "auth", None),
        address=request.client.host if request.client else "an unknown address",
        action="request.refused",
        detail=f"{exc.status} {request.method} {request.url.path}: {exc.message}",
        what=f"{request.method} {route}",
    )


class RefusalBook:
    def __init__(self) -> None:
        self._counted: dict[RefusalKey, _Counted] = {}
        self._writing: asyncio.TimerHandle | None = None
        self._writes: set[asyncio.Future[None]] = set()  # held: the loop keeps only weak references

    def note(
        self,
        ctx: ServerContext,
        *,
        workspace: str | None,
        auth: AuthInfo | None,
        address: str,
        action: str,
        detail: str,
        what: str = "",
    ) -> None:
        key = RefusalKey(workspace, auth.token_id if auth else None, address, action, what)
        if key not in self._counted and len(self._counted) >= MAX_KEYS:
            key = RefusalKey(workspace, None, "many addresses", action)
        counted = self._counted.setdefault(key, _Counted(auth, 0, detail))
        counted.times += 1
        counted.detail = detail
        if self._writing is None:
            loop = asyncio.get_running_loop()
            self._writing = loop.call_later(FLUSH_S, self._start_write, ctx)

    def _start_write(self, ctx: ServerContext) -> None:
        write = asyncio.ensure_future(self.write(ctx))
        self._writes.add(write)
        write.add_done_callback(self._writes.discard)

    async def write(self, ctx: ServerContext) -> None:
        self._writing = None
        counted, self._counted = self._counted, {}
        refusals = []
        for key, c in counted.items():
            if key.workspace is None:
                log.warning("refused %d times from %s: %s", c.times, key.address, c.detail)
                continue
            refusals.append(
                storage.Refusal(
                    workspace=key.workspace,
                    auth=c.auth,
                    address=key.address,
                    action=key.action,
                    times=c.times,
                    detail=c.detail,
                    what=key.what,
                )
            )
        if not refusals:
            return
        try:
            await ctx.db.call(storage.record_refusals, write=True, refusals=refusals, now=time.time())
        except Exception:  # a refusal's trace is not worth a failed request or a crash
            log.exception("writing %d refusals to the audit log failed", len(refusals))
