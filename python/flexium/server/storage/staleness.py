"""Whether a process is STALE: it sent no heartbeat for ``stale_after`` seconds. The one rule, as a
query's condition and read on a row. ``silent`` is the rule on a time alone, for what else is heard
from with the same patience: a process's last beat held in memory, a host's GPU report (its GPUs are
refused as targets), flexium run's asking for its placement (which ends)."""

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


def silent(last_heard: float, *, now: float, stale_after: float) -> bool:
    """Nothing heard since ``last_heard`` for longer than ``stale_after`` at ``now``."""
    return last_heard < now - stale_after
