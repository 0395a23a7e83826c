"""Every error flexium raises on purpose. Each message says what was wrong and what to do next."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flexium.engine.operations import OperationResult


class FlexiumError(RuntimeError):
    """Base class of flexium's own errors."""


class DriverError(FlexiumError):
    """A CUDA driver call failed, or the driver lacks a function it needs; flexium._C raises it.
    `call` names the function ("cuMemMap", "dlopen" when there is no driver), `code` is its
    CUresult and `error_name` that code's name ("CUDA_ERROR_OUT_OF_MEMORY")."""

    def __init__(self, message: str, *, call: str = "", code: int = 0, error_name: str = "") -> None:
        super().__init__(message)
        self.call = call
        self.code = code
        self.error_name = error_name


class ConfigError(FlexiumError, ValueError):
    """A parameter, environment variable or config file value is malformed."""


class CapabilityError(FlexiumError):
    """This machine (driver, torch build, GPU count) cannot do what was asked."""


class TargetRefusedError(FlexiumError, ValueError):
    """The requested GPU was refused before anything was touched (unknown, invisible,
    another model, not enough free memory, or the one already in use)."""


class InvalidStateError(FlexiumError):
    """The operation does not fit the process's state (pause a paused job, resume a running one)."""


class OperationInProgressError(FlexiumError):
    """Another migrate / pause / resume is running; one operation at a time."""


class OperationFailedError(FlexiumError):
    """A step failed and was rolled back: the process runs on its source GPU (or, for a failed
    resume, stays paused) exactly as before. `step` names the failing step: a StepTiming step, or
    pin / validate / own / prepare for a refusal before the locked section; `result` has timings."""

    def __init__(self, message: str, *, step: str, result: OperationResult | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.result = result


class RollbackFailedError(OperationFailedError):
    """A step failed and so did the rollback: the process may be stuck. Never silent."""
