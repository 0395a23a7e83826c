"""Whether a process is STALE: it sent no heartbeat for ``stale_after`` seconds. The one rule, as a
query's condition and read on a row; ``silent`` is the rule on the time it was last heard alone
(a snapshot in memory). A STALE process is shown so, its commands refused, its room counted free."""

from __future__ import annotations

from sqlalchemy import ColumnElement

from flexium.server.models import Process


def process_stale(*, now: float, stale_after: float) -> ColumnElement[bool]:
    """The processes STALE at ``now`` (``is_stale`` as a query's condition)."""
    return Process.last_seen < now - stale_after


def process_heard(*, now: float, stale_after: float) -> ColumnElement[bool]:
    """The processes heard from within ``stale_after`` of ``now``: those not STALE then."""
    return Process.last_seen >= now - stale_after


def is_stale(row: Process, *, now: float, stale_after: float) -> bool:
    return silent(row.last_seen, now=now, stale_after=stale_after)


def silent(last_seen: float, *, now: float, stale_after: float) -> bool:
    """Nothing heard since ``last_seen`` for longer than ``stale_after`` at ``now``."""
    return last_seen < now - stale_after
