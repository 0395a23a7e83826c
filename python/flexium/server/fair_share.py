"""Requests in progress, shared between clients (the outermost ASGI layer, and the event stream's
dependency), after kube-apiserver's priority and fairness: no one client's requests may take
what the others, and above all the training jobs, need.

- Registered jobs' heartbeats, polls and command reports (a token the cache knows, on a process it
  registered, or an admin's; a report, by a token that registered a process the server knows) may
  use every one of ``max_requests``; every other request only what is left of
  it after ``job_request_share`` of it, kept for them. A flood of logins or reads then leaves the
  jobs' heartbeats and polls room.
- Those other requests are held to ``max_requests_per_client`` in progress per client address
  (behind a trusted proxy, the address it forwards: uvicorn sets it before this layer).
- A token holds at most ``max_streams_per_token`` event streams (a dashboard holds one per tab).
Past the whole bound or the others' share the answer is 503, as for a busy server; past a
client's share, 503 too, since clients back off and retry 503s (a job's registration among
them); past a token's streams, 429. Each carries Retry-After and names the setting that raises
the bound.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from flexium import protocol
from flexium.server.auth import Reader, cached_token, scope_bearer_token
from flexium.server.context import ServerContext
from flexium.server.errors import TooManyRequests
from flexium.server.settings import option_and_env
from flexium.server.storage import AuthInfo

_JOB_REQUEST = re.compile(r"^/api/w/([^/]+)/processes/([^/]+)/(?:heartbeat|commands/next)$")
_JOB_REPORT = re.compile(r"^/api/w/([^/]+)/commands/[0-9]+/report$")
_HOLD = "flexium_fair_share"
RETRY_AFTER_S = 1


def _busy(status: int, code: str, message: str) -> JSONResponse:
    answer = JSONResponse({"error": code, "message": message}, status_code=status)
    answer.headers["Retry-After"] = str(RETRY_AFTER_S)
    return answer


class FairShare:
    def __init__(
        self,
        app: Any,
        *,
        ctx: ServerContext,
        max_requests: int,
        job_request_share: float,
        max_requests_per_client: int,
        max_streams_per_token: int,
    ) -> None:
        self.app = app
        self.ctx = ctx
        self.max_requests = max_requests
        self.max_others = max(1, max_requests - int(max_requests * job_request_share))
        self.max_per_client = max_requests_per_client
        self.max_streams_per_token = max_streams_per_token
        self.in_progress = 0
        self.others = 0
        self.per_client: Counter[str] = Counter()
        self.streams: Counter[int] = Counter()

    async def __call__(self, scope: Any, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client = scope["client"][0] if scope.get("client") else "?"
        job = self._registered_job(scope)
        refusal = self._refusal(job, client)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        hold = _Hold(self)
        scope.setdefault("state", {})[_HOLD] = hold
        self.in_progress += 1
        if not job:
            self.others += 1
            self.per_client[client] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_progress -= 1
            if not job:
                self.others -= 1
                self.per_client[client] -= 1
                if self.per_client[client] <= 0:
                    del self.per_client[client]
            hold.release()

    def _refusal(self, job: bool, client: str) -> JSONResponse | None:
        if self.in_progress >= self.max_requests:
            return _busy(
                503,
                "unavailable",
                f"the server is busy: {self.in_progress} requests in progress, its limit "
                f"({option_and_env('max_requests')} raises it); retry shortly",
            )
        if job:
            return None
        if self.others >= self.max_others:
            return _busy(
                503,
                "unavailable",
                f"the server is busy: {self.others} requests in progress besides training jobs' heartbeats "
                f"and polls, which keep {self.max_requests - self.max_others} of {option_and_env('max_requests')} "
                f"({option_and_env('job_request_share')}); retry shortly",
            )
        if self.per_client[client] >= self.max_per_client:
            return _busy(
                503,
                "unavailable",
                f"{client} has {self.per_client[client]} requests in progress, the limit per client address "
                f"({option_and_env('max_requests_per_client')} raises it); retry when one has ended",
            )
        return None

    def _registered_job(self, scope: Any) -> bool:
        """A heartbeat or poll of a process the server knows, by the token that registered it (or
        an admin's), or a command report by a token that registered one, as far as the token cache
        knows without a lookup. A job's report is what it did: refused with the others' requests,
        it would be retried while a flood of reads lasts."""
        path = scope.get("path", "")
        match = _JOB_REQUEST.match(path) or _JOB_REPORT.match(path)
        if match is None:
            return False
        token = scope_bearer_token(scope)
        if token is None:
            return False
        auth = cached_token(self.ctx, token, time.time())
        if auth is None or auth.workspace != match.group(1):
            return False
        owners = self.ctx.process_owners
        if match.re is _JOB_REPORT:
            return any(  # over a copy: threads write it
                key[0] == auth.workspace_id and owner == auth.token_id for key, owner in list(owners.items())
            )
        key = (auth.workspace_id, match.group(2))
        return key in owners and (auth.role == protocol.ROLE_ADMIN or owners[key] == auth.token_id)


class _Hold:
    """What one request holds beyond its place in the count (its event stream's place in its
    token's), given back when the request ends, however it ends."""

    def __init__(self, share: FairShare) -> None:
        self.share = share
        self.stream_of: int | None = None

    def take_stream(self, auth: AuthInfo) -> None:
        share = self.share
        held = share.streams[auth.token_id]
        if held >= share.max_streams_per_token:
            raise TooManyRequests(
                f"this token ({auth.token_name or 'token ' + str(auth.token_id)}) holds {held} event streams, "
                f"the limit per token ({option_and_env('max_streams_per_token')} raises it): close a dashboard "
                "tab, or retry once one has ended",
                retry_after_s=5 * RETRY_AFTER_S,
            )
        share.streams[auth.token_id] += 1
        self.stream_of = auth.token_id

    def release(self) -> None:
        if self.stream_of is not None:
            self.share.streams[self.stream_of] -= 1
            if self.share.streams[self.stream_of] <= 0:
                del self.share.streams[self.stream_of]
            self.stream_of = None


async def _stream_reader(request: Request, auth: Reader) -> AuthInfo:
    hold = request.scope.get("state", {}).get(_HOLD)
    if isinstance(hold, _Hold):
        hold.take_stream(auth)
    return auth


StreamReader = Annotated[AuthInfo, Depends(_stream_reader)]
"""A reader opening an event stream, within its token's share of them."""
