"""One pass of a server policy (the resume-when-free queue, the drains) beside the requests: its
decision run in one write transaction over one host or every host, and never raising, since a
failed pass is retried at the next event or sweep."""

from __future__ import annotations

import logging
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
    try:
        outcome: Any = await ctx.db.call(
            decide,
            write=True,
            now=time.time(),
            stale_after=ctx.settings.stale_after_s,
            workspace_id=workspace_id,
            host=host,
        )
    except DatabaseUnavailable as exc:
        log.warning("%s pass failed, retrying at the next event: %s", what, exc)
        return None
    except Exception:
        log.exception("%s pass failed; retrying at the next event", what)
        return None
    return outcome  # type: ignore[no-any-return]
