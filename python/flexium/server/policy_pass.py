"""One pass of a server policy (the resume-when-free queue, the placements, the drains) beside the
requests: its decision run in one write transaction over one host or every host, and never raising,
since a failed pass is retried at the next event or sweep."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

from flexium.server.context import ServerContext
from flexium.server.db import DatabaseUnavailable

log = logging.getLogger("flexium.server")

Outcome = TypeVar("Outcome")


async def run_policy_pass(
    ctx: ServerContext,
    decide: Callable[..., Outcome],
    *,
    what: str,
    workspace_id: int | None,
    host: str | None,
) -> Outcome | None:
    """``decide``'s outcome, or None where the pass failed (logged as ``what``'s pass)."""
    now = time.time()
    try:
        outcome: Any = await ctx.db.call(
            decide,
            write=True,
            now=now,
            stale_after=ctx.settings.stale_after_s,
            workspace_id=workspace_id,
            host=host,
        )
    except DatabaseUnavailable as exc:
        ctx.answering_since = math.inf
        log.warning("%s pass failed, retrying at the next event: %s", what, exc)
        return None
    except Exception:
        log.exception("%s pass failed; retrying at the next event", what)
        return None
    if math.isinf(ctx.answering_since):  # the database is back: nobody could be heard until now
        ctx.answering_since = now
    return outcome  # type: ignore[no-any-return]


def answering_since(ctx: ServerContext) -> float:
    """Since when this server has answered without a gap: its start, or the end of the last database
    outage its passes met (now, while one lasts). A client that could not be heard before then, as
    flexium run asking for its placement, is not taken for silent (``policies/placement.py``)."""
    return min(ctx.answering_since, time.time())
