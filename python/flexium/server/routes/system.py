"""Operational endpoints: health (no token) and Prometheus metrics (a viewer's or an admin's
token, or none where ``--public-metrics`` allows the totals)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from flexium import protocol, wire
from flexium.server import metrics_scrape
from flexium.server.auth import bearer_token, resolve_token, role_refusal
from flexium.server.context import Ctx, ServerContext
from flexium.server.db import DatabaseUnavailable
from flexium.server.errors import Forbidden, Unauthorized
from flexium.server.metrics import CONTENT_TYPE
from flexium.server.storage import REFUSED_TOKEN, AuthInfo

router = APIRouter()

_METRICS_ROLES = (protocol.ROLE_VIEWER, protocol.ROLE_ADMIN)


@router.get(
    protocol.PATH_HEALTH,
    response_model=wire.HealthInfo,
    responses={503: {"model": wire.HealthInfo}},
    summary="200 when the database answers",
)
async def healthz(ctx: Ctx) -> Any:
    try:
        await ctx.db.ping()
    except DatabaseUnavailable as exc:
        return JSONResponse({"status": "degraded", "database": f"unavailable: {exc}"}, status_code=503)
    return {"status": "ok", "database": ctx.db.dialect}


async def _metrics_reader(request: Request, ctx: ServerContext) -> AuthInfo | None:
    """Who scrapes: a viewer or admin token (its workspace's series), or None (the totals alone,
    only where the server was started with --public-metrics)."""
    token = bearer_token(request)
    if token is None:
        if ctx.settings.public_metrics:
            return None
        raise Unauthorized(
            "missing token: /metrics takes a viewer or admin token ('Authorization: Bearer <token>'; "
            "Prometheus: authorization.credentials_file), or a server started with --public-metrics "
            "serves its totals without one"
        )
    auth = await resolve_token(ctx, token)
    if auth is None:
        raise Unauthorized(REFUSED_TOKEN, error="invalid_token")
    if auth.role not in _METRICS_ROLES:
        raise Forbidden(role_refusal(auth, _METRICS_ROLES, "reading the metrics"))
    return auth


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus text format: the server's totals, and the token's workspace's GPUs and jobs",
    responses={
        200: {"content": {"text/plain": {}}},
        401: {"model": wire.ErrorBody},
        403: {"model": wire.ErrorBody},
    },
)
async def metrics(request: Request, ctx: Ctx) -> Response:
    auth = await _metrics_reader(request, ctx)
    return Response(await metrics_scrape.scrape(ctx, auth), media_type=CONTENT_TYPE)
