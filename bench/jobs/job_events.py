"""What the jobs print: one JSON line per event on stdout, and the readings events carry."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

_emit_lock = threading.Lock()


def emit(event: str, **data: Any) -> None:
    """One write per line: the training and control threads both report, and a rank job's ranks
    share torchrun's stdout (a line written at once, under PIPE_BUF, is never split by another's)."""
    line = json.dumps({"event": event, **data}) + "\n"
    with _emit_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


def placement_snapshot() -> dict[str, dict[str, int]]:
    """By NVML, per GPU (UUID): its index, what this process holds there and what all hold."""
    from flexium.engine import nvml

    pid = os.getpid()
    return {
        gpu.uuid: {"index": gpu.index, "ours": gpu.used_by(pid) or 0, "used": gpu.memory_used}
        for gpu in nvml.host_gpus()
    }


def physical_device() -> str | None:
    """Where the job is now (None: flexium cannot say, disabled)."""
    try:
        import flexium

        return str(flexium.auto.get_physical_device())
    except Exception:  # reported as unknown, never fatal
        return None


def pool_status() -> dict[str, object]:
    """Whether the memory pool is on, why not, and why a move now would take the driver path."""
    from flexium.api import runtime

    session = runtime.current()
    pool = getattr(session, "memory_pool", None) if session is not None else None
    engine = getattr(session, "engine", None) if session is not None else None
    blocker_of: Callable[[], str | None] | None = getattr(engine, "fast_path_blocker", None)
    try:
        blocker = blocker_of() if blocker_of is not None else "no flexium engine in this process"
    except Exception as exc:  # reported, not fatal
        blocker = f"fast_path_blocker raised {type(exc).__name__}: {exc}"
    return {
        "pool_active": bool(getattr(pool, "active", False)) if pool is not None else False,
        "pool_reason": getattr(pool, "reason_off", None) if pool is not None else "no memory pool in the session",
        "fast_path_blocker": blocker,
    }
