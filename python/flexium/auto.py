"""flexium.auto: explicit scope control, device queries and error recovery (docs/guide/api.md)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from flexium.api import runtime as _runtime
from flexium.api.progress import PROGRESS as _PROGRESS
from flexium.api.recoverable import recoverable
from flexium.config import validate_device

log = logging.getLogger("flexium")

__all__ = [
    "run",
    "recoverable",
    "get_device",
    "get_physical_device",
    "is_active",
    "is_migration_in_progress",
    "get_process_id",
    "is_migration_enabled",
    "report",
]


@contextlib.contextmanager
def run(orchestrator: str | None = None, device: str | None = None, disabled: bool = False) -> Iterator[None]:
    """Flexium is active inside the block; a session this block started ends with it. Inside a
    running session (flexium.init()), the session's settings stay: a warning names any argument
    that asked for others."""
    started_here = not _runtime.is_initialized()
    if started_here:
        _runtime.start(orchestrator, device, disabled, server_parameter="orchestrator")
    current = _runtime.current()
    assert current is not None
    if not started_here:
        _warn_ignored(current, orchestrator=orchestrator, device=device, disabled=disabled)
    current.scopes += 1
    try:
        yield
    finally:
        current.scopes -= 1
        if started_here:
            _runtime.shutdown()


def _warn_ignored(current: _runtime.Runtime, *, orchestrator: str | None, device: str | None, disabled: bool) -> None:
    ignored = []
    server = current.config.orchestrator if current.config is not None else None
    if orchestrator is not None and orchestrator.strip() != server:
        ignored.append(f"orchestrator={orchestrator!r} (the session's server: {server or 'none, local mode'})")
    if device is not None and validate_device(device) != current.logical_device:
        ignored.append(f"device={device!r} (the session's device: {current.logical_device})")
    if disabled != current.disabled:
        ignored.append(f"disabled={disabled} (the session's: disabled={current.disabled})")
    if ignored:
        log.warning(
            "flexium.auto.run() inside the session flexium.init() started keeps that session's settings; "
            "ignored: %s. Call flexium.shutdown() first to start one with these.",
            "; ".join(ignored),
        )


def get_device() -> str:
    """The device the training code uses, e.g. "cuda:0" (unchanged by migrations), or "cpu"."""
    current = _runtime.current()
    if current is not None:
        return current.logical_device
    from flexium.config import load_config

    return load_config().device


def get_physical_device() -> str:
    """The GPU the process really runs on now, named as at init ("cuda:N")."""
    current = _runtime.current()
    if current is not None and current.engine is not None:
        return current.engine.placement()[1].device
    return get_device()


def is_active() -> bool:
    """True inside a flexium.auto.run() block (not disabled)."""
    current = _runtime.current()
    return current is not None and current.scopes > 0 and not current.disabled


def is_migration_in_progress() -> bool:
    current = _runtime.current()
    return bool(current is not None and current.engine is not None and current.engine.is_busy())


def get_process_id() -> str:
    """This process's flexium id, "gpu-" and 8 hex digits."""
    return _runtime.process_id()


def is_migration_enabled() -> bool:
    """True when CUDA works through PyTorch and the driver allows migration and pause."""
    current = _runtime.current()
    return bool(
        current is not None
        and not current.disabled
        and current.engine is not None
        and current.capabilities is not None
        and current.capabilities.migration
    )


def report(*, loss: float | None = None, step: int | None = None) -> None:
    """Tell the dashboard how training goes: ``loss`` (a number; its last value is shown) and,
    for a loop without torch.optim steps, ``step`` (otherwise flexium counts optimizer steps).
    It only records the values: the next heartbeat carries them, so it never waits for the
    server, and it works (and costs nothing more) without one. Pass a Python number:
    ``loss.item()`` synchronizes the GPU, which is the job's choice of when."""
    _PROGRESS.record(loss=loss, step=step)
