"""Keeps DataLoader pin-memory threads out of CUDA while the process is locked or checkpointed.

A kernel launch from another thread then simply waits for the unlock, but allocating pinned
host memory kills the process (fact `pinning-while-paused-kills`), and a DataLoader with workers and
``pin_memory=True`` pins every batch its workers deliver from a thread of its own, paused job or
not. The gate wraps the function that thread calls; the locked section closes it (waiting for a
batch being pinned to finish) and opens it once the process runs again.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

_PIN_MODULE = "torch.utils.data._utils.pin_memory"


class PinningGate:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._open = True
        self._pinning = 0  # threads inside a guarded call
        self._depth = threading.local()  # the pin function recurses into containers

    @property
    def is_open(self) -> bool:
        with self._changed:
            return self._open

    def guard(self, pin: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(pin)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._depth, "value", 0):
                return pin(*args, **kwargs)
            with self._changed:
                self._changed.wait_for(lambda: self._open)
                self._pinning += 1
            self._depth.value = 1
            try:
                return pin(*args, **kwargs)
            finally:
                self._depth.value = 0
                with self._changed:
                    self._pinning -= 1
                    self._changed.notify_all()

        guarded.__wrapped_by_flexium__ = pin  # type: ignore[attr-defined]
        return guarded

    def close(self, timeout_s: float) -> bool:
        """Holds new pins back; True once none is under way, False if one still is after
        ``timeout_s`` (the gate stays closed either way)."""
        with self._changed:
            self._open = False
            return self._changed.wait_for(lambda: self._pinning == 0, timeout_s)

    def open(self) -> None:
        with self._changed:
            self._open = True
            self._changed.notify_all()


GATE = PinningGate()


def install() -> None:
    """Wraps torch's DataLoader pin function (looked up by name at every call) once torch's
    data module is imported; without torch there is nothing to guard."""
    module = _pin_module()
    if module is not None and not hasattr(module.pin_memory, "__wrapped_by_flexium__"):
        module.pin_memory = GATE.guard(module.pin_memory)


def uninstall() -> None:
    module = _pin_module()
    original = getattr(module.pin_memory, "__wrapped_by_flexium__", None) if module is not None else None
    if module is not None and original is not None:
        module.pin_memory = original
    GATE.open()


def _pin_module() -> Any | None:
    module = sys.modules.get(_PIN_MODULE)
    if module is None:
        try:
            import torch.utils.data  # noqa: F401  (imports the pin module)
        except ImportError:
            return None
        module = sys.modules.get(_PIN_MODULE)
    return module
