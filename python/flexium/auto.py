"""flexium.auto: explicit scope control, device queries and error recovery (spec sections 3-7)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from flexium.api import session as _session
from flexium.api.recoverable import recoverable

__all__ = [
    "run",
    "recoverable",
    "get_device",
    "get_physical_device",
    "is_active",
    "is_migration_in_progress",
    "get_process_id",
    "is_migration_enabled",
]


@contextlib.contextmanager
def run(orchestrator: Optional[str] = None, device: Optional[str] = None, disabled: bool = False) -> Iterator[None]:
    """Flexium is active inside the block; a session this block started ends with it."""
    started_here = not _session.is_initialized()
    if started_here:
        _session.init(server=orchestrator, device=device, disabled=disabled)
    current = _session.current()
    assert current is not None
    current.scopes += 1
    try:
        yield
    finally:
        current.scopes -= 1
        if started_here:
            _session.shutdown()


def get_device() -> str:
    """The device the training code uses, e.g. "cuda:0" (unchanged by migrations), or "cpu"."""
    current = _session.current()
    if current is not None:
        return current.logical_device
    from flexium.config import load_config

    return load_config().device


def get_physical_device() -> str:
    """The GPU the process really runs on now, named as at init ("cuda:N")."""
    current = _session.current()
    if current is not None and current.engine is not None:
        return str(current.engine.placement()[1].device)
    return get_device()


def is_active() -> bool:
    current = _session.current()
    return current is not None and not current.disabled


def is_migration_in_progress() -> bool:
    current = _session.current()
    return bool(current is not None and current.engine is not None and current.engine.is_busy())


def get_process_id() -> str:
    """This process's flexium id, "gpu-" and 8 hex digits."""
    return _session.process_id()


def is_migration_enabled() -> bool:
    """True when CUDA works through PyTorch and the driver allows migration and pause."""
    current = _session.current()
    return bool(
        current is not None
        and not current.disabled
        and current.engine is not None
        and current.capabilities is not None
        and current.capabilities.migration
    )
