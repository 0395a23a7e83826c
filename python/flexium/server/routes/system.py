"""Unauthenticated operational endpoints: health and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from flexium import protocol, wire
from flexium.server import services
from flexium.server.context import Ctx
from flexium.server.db import DatabaseUnavailable
from flexium.server.metrics import CONTENT_TYPE

router = APIRouter()


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


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus text format",
    responses={200: {"content": {"text/plain": {}}}},
)
async def metrics(ctx: Ctx) -> Response:
    return Response(await services.metrics_text(ctx), media_type=CONTENT_TYPE)
