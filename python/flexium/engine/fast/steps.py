"""A fast-path step: timed, and named when it fails, so that the engine can say which step failed
and decide what that means (the transactions in engine/transactions/)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from flexium.engine.operations import StepTiming

T = TypeVar("T")


class RelocationError(Exception):
    def __init__(self, step: str, message: str, timing: StepTiming) -> None:
        super().__init__(message)
        self.step = step
        self.timing = timing


def timed(step: str, work: Callable[[], T]) -> tuple[T, StepTiming]:
    started = time.perf_counter()
    try:
        value = work()
    except Exception as exc:
        timing = StepTiming(step, time.perf_counter() - started, ok=False, error=f"{type(exc).__name__}: {exc}")
        raise RelocationError(step, f"phase '{step}' failed: {type(exc).__name__}: {exc}", timing) from exc
    return value, StepTiming(step, time.perf_counter() - started, ok=True)
