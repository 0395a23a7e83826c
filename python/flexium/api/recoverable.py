"""`recoverable`: on a recoverable CUDA error, move the job to another GPU and carry on.

Three forms share one recovery path:

    with recoverable(): ...                       # the operation is lost, training continues
    @recoverable(retries=3)                       # the function is retried on the new GPU
    for attempt in recoverable(retries=3):        # the block is retried on the new GPU
        with attempt: ...

`retries` counts re-runs after the first try: retries=3 allows 4 tries and up to 3 moves.
Errors that are not a `CudaErrorKind` (matched by their message text) are re-raised untouched, never retried.

Torch is never imported here: an exception can only be torch's if torch is already loaded.
"""

from __future__ import annotations

import enum
import functools
import gc
import importlib
import inspect
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from flexium._logging import get_logger
from flexium.errors import (
    ConfigError,
    DriverError,
    FlexiumError,
    OperationFailedError,
    OperationInProgressError,
    RollbackFailedError,
)
from flexium.units import gib

if TYPE_CHECKING:
    from flexium.engine import Engine, GpuIdentity, OperationResult

__all__ = ["recoverable", "Attempt", "CudaErrorKind", "Recovery", "classify_error"]

_log = get_logger("recoverable")

_F = TypeVar("_F", bound=Callable[..., Any])

# A move checkpoints all GPU memory; tens of seconds is normal for a large job.
_LOCK_TIMEOUT_S = 600.0
_SUMMARY_CHARS = 300


class CudaErrorKind(str, enum.Enum):
    """The recoverable CUDA errors; each value is the message text that identifies it."""

    OOM = "out of memory"
    ECC = "uncorrectable ECC error"
    DEVICE_ASSERT = "device-side assert"
    ILLEGAL_ACCESS = "illegal memory access"
    LAUNCH_FAILURE = "launch failure"

    @property
    def label(self) -> str:
        return _LABELS[self]

    @property
    def context_lost(self) -> bool:
        """Every kind but OOM leaves the CUDA context broken ("sticky" errors)."""
        return self is not CudaErrorKind.OOM


_LABELS = {
    CudaErrorKind.OOM: "CUDA out of memory (OOM)",
    CudaErrorKind.ECC: "an uncorrectable ECC error",
    CudaErrorKind.DEVICE_ASSERT: "a device-side assert",
    CudaErrorKind.ILLEGAL_ACCESS: "an illegal memory access",
    CudaErrorKind.LAUNCH_FAILURE: "a kernel launch failure",
}

_ADVICE = {
    CudaErrorKind.OOM: "Reduce the batch size, or free memory on another GPU of the same model "
    "(nvidia-smi shows what uses it).",
    CudaErrorKind.ECC: "The GPU reports uncorrectable memory errors: check it with "
    "`nvidia-smi -q -d ECC` and restart the job from its last checkpoint on a healthy GPU.",
    CudaErrorKind.DEVICE_ASSERT: "A device-side assert is usually a bug in the training code (an index "
    "out of range, for example): rerun with CUDA_LAUNCH_BLOCKING=1 to find the failing kernel, then "
    "restart from the last checkpoint.",
    CudaErrorKind.ILLEGAL_ACCESS: "An illegal memory access is usually a bug in a CUDA kernel, sometimes "
    "failing hardware: rerun with CUDA_LAUNCH_BLOCKING=1, check `nvidia-smi -q -d ECC`, and restart "
    "from the last checkpoint.",
    CudaErrorKind.LAUNCH_FAILURE: "Check the GPU with `nvidia-smi -q -d ECC` and the kernel log (Xid "
    "errors in `dmesg`), then restart the job from its last checkpoint.",
}

# Sticky errors first: a message naming both an ECC error and OOM is about the ECC error.
_MESSAGE_ORDER = (
    CudaErrorKind.ECC,
    CudaErrorKind.DEVICE_ASSERT,
    CudaErrorKind.ILLEGAL_ACCESS,
    CudaErrorKind.LAUNCH_FAILURE,
    CudaErrorKind.OOM,
)


def classify_error(exc: BaseException) -> CudaErrorKind | None:
    """The kind of recoverable CUDA error `exc` is, or None (then it must be re-raised as is)."""
    if not isinstance(exc, Exception):
        return None
    torch = sys.modules.get("torch")
    oom_type = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    if isinstance(oom_type, type) and isinstance(exc, oom_type):
        return CudaErrorKind.OOM
    try:
        message = str(exc)
    except Exception:  # a broken __str__ must not hide the original error
        return None
    for kind in _MESSAGE_ORDER:
        if kind.value in message:
            return kind
    return None


@dataclass(frozen=True)
class Recovery:
    """One handled error: where the job was, where it went, how long it took."""

    kind: CudaErrorKind
    error: str  # "Type: first line of the message"
    logical_device: str  # what the training code keeps using, e.g. "cuda:0"
    source: GpuIdentity
    target: GpuIdentity
    seconds: float  # whole recovery, freeing memory included
    result: OperationResult | None  # None: another thread had just moved the job


# Bumped after every successful move, so that threads failing together move the job once.
_generation = 0
_recovery_lock = threading.Lock()


def _summary(exc: BaseException) -> str:
    try:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    except Exception:
        text = ""
    if len(text) > _SUMMARY_CHARS:
        text = text[: _SUMMARY_CHARS - 1] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _gpu(g: GpuIdentity) -> str:
    return f"GPU {g.ordinal} ({g.name}, {g.uuid})"


def _free_memory(exc: BaseException) -> None:
    """Drop what the failed operation still holds so less memory is moved and more is free.

    The traceback's finished frames keep the failed step's activations alive; clear_frames()
    skips frames still running (the caller's), so the training code's own variables survive.
    """
    traceback.clear_frames(exc.__traceback__)
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception as cache_exc:  # freeing is best effort; the move is what matters
        _log.debug("torch.cuda.empty_cache() failed before recovery: %s", cache_exc)


def _job_bytes(engine: Engine, logical_device: str) -> int | None:
    # The engine counts what the driver would move (NVML); PyTorch's reserved bytes are the
    # fallback and miss the CUDA context itself.
    process_bytes = getattr(engine, "process_bytes", None)
    if callable(process_bytes):
        try:
            return int(process_bytes())
        except Exception as exc:
            _log.debug("engine.process_bytes() failed: %s", exc)
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_available():
            return int(torch.cuda.memory_reserved(logical_device))
    except Exception:
        pass
    return None


def _cannot(kind: CudaErrorKind, exc: BaseException, reason: str, advice: str) -> RuntimeError:
    return RuntimeError(f"cannot recover from {kind.label} ({_summary(exc)}): {reason}. {advice}")


def _engine_for(kind: CudaErrorKind, exc: BaseException) -> Engine:
    try:
        runtime_module = importlib.import_module("flexium.api.runtime")
    except ModuleNotFoundError as missing:
        if missing.name != "flexium.api.runtime":
            raise
        runtime_module = None
    runtime = runtime_module.current() if runtime_module is not None else None
    if runtime is None:
        raise _cannot(
            kind,
            exc,
            "flexium is not initialised in this process",
            "Call flexium.init() at the start of the script, before the model is moved to the GPU.",
        ) from exc
    engine: Engine | None = getattr(runtime, "engine", None)
    if engine is None:
        raise _cannot(
            kind,
            exc,
            "flexium runs without its GPU engine here (flexium.init(disabled=True), no CUDA, or an "
            "unsupported driver; see the warnings flexium logged at start-up), so it cannot move the job",
            "Fix what those warnings name, or restart the job from its last checkpoint.",
        ) from exc
    capabilities = engine.capabilities
    if not capabilities.migration:
        driver = getattr(capabilities, "driver_version", None)
        found = f" (this machine has driver {driver})" if driver else ""
        raise _cannot(
            kind,
            exc,
            f"moving a job to another GPU needs NVIDIA driver 580+{found}; pause/resume alone cannot recover from this",
            "Upgrade the NVIDIA driver, or restart the job from its last checkpoint.",
        ) from exc
    return engine


def _no_candidate(
    kind: CudaErrorKind, exc: BaseException, engine: Engine, logical: str, source: GpuIdentity
) -> RuntimeError:
    needed = _job_bytes(engine, logical)
    room = f"{gib(needed)} free" if needed else "enough free memory for this job"
    reason = (
        f"no other {source.name} GPU has {room} "
        f"(only GPUs of the same model can take the job; it runs on {_gpu(source)})"
    )
    if kind.context_lost:
        return _cannot(
            kind,
            exc,
            reason,
            "The CUDA context is likely unusable after this error. " + _ADVICE[kind],
        )
    return _cannot(kind, exc, reason, _ADVICE[kind])


def _move_failed(
    kind: CudaErrorKind, exc: BaseException, source: GpuIdentity, target: GpuIdentity, move_exc: BaseException
) -> RuntimeError:
    if isinstance(move_exc, DriverError):
        # A driver call the engine makes outside its locked section's own rollback (the process
        # state read after it, the memory pool's calls) failed: nothing says where the job is.
        reason = (
            f"moving to {_gpu(target)} failed inside the driver call {move_exc.call or 'flexium made'} "
            f"({_summary(move_exc)}); the job's state is unknown: it may be on either GPU, or frozen"
        )
        return _cannot(kind, exc, reason, "Restart the job if it does not continue. " + _ADVICE[kind])
    if isinstance(move_exc, RollbackFailedError):
        state = f"the job may be stuck on {_gpu(source)}"
    elif isinstance(move_exc, OperationFailedError):
        state = f"it was rolled back at phase '{move_exc.step}', the job is still on {_gpu(source)}"
    elif isinstance(move_exc, OperationInProgressError):
        state = "another migrate/pause/resume was running (from the dashboard?)"
    else:
        state = f"the job is still on {_gpu(source)}"
    reason = f"moving to {_gpu(target)} failed ({_summary(move_exc)}); {state}"
    if kind.context_lost:
        return _cannot(
            kind,
            exc,
            reason,
            "The CUDA context is likely unusable after this error and the driver refused to move it. " + _ADVICE[kind],
        )
    if isinstance(move_exc, OperationInProgressError):
        return _cannot(kind, exc, reason, "Retry the step once that operation has finished.")
    return _cannot(kind, exc, reason, _ADVICE[kind])


def _timings(result: OperationResult) -> str:
    order: list[str] = []
    totals: dict[str, float] = {}
    for step in result.steps:
        if step.rollback:
            continue
        if step.step not in totals:
            order.append(step.step)
            totals[step.step] = 0.0
        totals[step.step] += step.seconds
    parts = ", ".join(f"{name} {totals[name]:.2f} s" for name in order)
    return f"migration {result.seconds:.2f} s" + (f": {parts}" if parts else "")


def _recover(kind: CudaErrorKind, exc: BaseException, *, seen_generation: int, outcome: str) -> Recovery:
    """Move the job off the GPU that failed; raise RuntimeError (chained) when it cannot."""
    global _generation
    started = time.monotonic()
    engine = _engine_for(kind, exc)
    if kind is CudaErrorKind.OOM:
        _free_memory(exc)
    if not _recovery_lock.acquire(timeout=_LOCK_TIMEOUT_S):
        raise _cannot(
            kind,
            exc,
            f"another thread's recovery did not finish within {_LOCK_TIMEOUT_S:.0f} s",
            "Restart the job from its last checkpoint.",
        ) from exc
    try:
        logical, source = engine.placement()
        if _generation != seen_generation:
            # A thread that failed at the same moment has already moved the job.
            recovery = Recovery(kind, _summary(exc), logical, source, source, time.monotonic() - started, None)
            _log.warning("%s on %s: the job was just moved by another thread; %s", kind.label, logical, outcome)
            return recovery
        candidates = list(engine.candidate_targets())
        if not candidates:
            raise _no_candidate(kind, exc, engine, logical, source) from exc
        # The engine lists the most free memory first; for OOM that is the point, for a faulty
        # GPU any healthy one will do.
        chosen = candidates[0]
        try:
            result = engine.migrate(chosen.gpu)
        except FlexiumError as move_exc:  # refused, failed and rolled back, busy, not capable, or a driver call
            raise _move_failed(kind, exc, source, chosen.gpu, move_exc) from move_exc
        if not result.ok:
            failure = OperationFailedError(
                result.error or "migration reported failure", step=result.failed_step or "?", result=result
            )
            raise _move_failed(kind, exc, source, chosen.gpu, failure) from exc
        _generation += 1
    finally:
        _recovery_lock.release()

    seconds = time.monotonic() - started
    _log.warning(
        "recovered from %s on %s: moved %s -> %s (%s free) in %.2f s (%s); %s",
        kind.label,
        logical,
        _gpu(source),
        _gpu(chosen.gpu),
        gib(chosen.free_bytes),
        seconds,
        _timings(result),
        outcome,
    )
    return Recovery(kind, _summary(exc), logical, source, chosen.gpu, seconds, result)


def _exhausted(kind: CudaErrorKind, exc: BaseException, what: str, attempts: int) -> RuntimeError:
    tries = "the only attempt" if attempts == 1 else f"all {attempts} attempts"
    return RuntimeError(
        f"{what} failed with {kind.label} on {tries} (the job was moved to another GPU after each "
        f"failure but the last); last error: {_summary(exc)}. {_ADVICE[kind]}"
    )


class Attempt:
    """One try of the iterator form; use it as `with attempt:`."""

    def __init__(self, owner: recoverable, number: int, attempts: int) -> None:
        self.number = number  # 1-based
        self.attempts = attempts  # retries + 1
        self._owner = owner
        self._recovered = False

    @property
    def recovered(self) -> bool:
        """True when this try failed with a recoverable error and the job was moved."""
        return self._recovered

    def __enter__(self) -> Attempt:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None:
            return False
        kind = classify_error(exc)
        if kind is None:
            return False
        if self.number >= self.attempts:
            raise _exhausted(kind, exc, "the recoverable block", self.attempts) from exc
        self._owner._handle(
            kind, exc, _generation, f"retrying the block (attempt {self.number + 1} of {self.attempts})"
        )
        self._recovered = True
        return True

    def __repr__(self) -> str:
        return f"Attempt({self.number} of {self.attempts})"


class recoverable:
    """Recover from OOM, ECC errors, device-side asserts, illegal memory accesses and launch
    failures by moving the job to another GPU of the same model (needs migration: driver 580+).

    `retries` applies to the decorator and iterator forms only.
    """

    def __init__(self, retries: int = 3) -> None:
        if callable(retries):
            raise ConfigError(
                "recoverable needs parentheses when used as a decorator: @recoverable() or @recoverable(retries=3)"
            )
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigError(f"recoverable(retries={retries!r}): retries must be a whole number >= 0, e.g. retries=3")
        self.retries = retries
        self.last_recovery: Recovery | None = None

    def _handle(self, kind: CudaErrorKind, exc: BaseException, seen_generation: int, outcome: str) -> Recovery:
        recovery = _recover(kind, exc, seen_generation=seen_generation, outcome=outcome)
        self.last_recovery = recovery
        return recovery

    # Form 1: context manager, the operation is lost.
    def __enter__(self) -> recoverable:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None:
            return False
        kind = classify_error(exc)
        if kind is None:
            return False
        self._handle(
            kind, exc, _generation, "the operation in the `with recoverable()` block was lost; training continues"
        )
        return True

    # Form 2: decorator, the function is retried.
    def __call__(self, func: _F) -> _F:
        if not callable(func):
            raise ConfigError(f"recoverable(...) decorates a function, not {func!r}")
        if inspect.iscoroutinefunction(func):
            raise ConfigError(
                f"recoverable cannot decorate the async function {func.__qualname__}; "
                "wrap the synchronous GPU work instead"
            )
        attempts = self.retries + 1
        name = getattr(func, "__qualname__", repr(func))

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for number in range(1, attempts + 1):
                try:
                    return func(*args, **kwargs)
                except Exception as exc:
                    kind = classify_error(exc)
                    if kind is None:
                        raise
                    if number == attempts:
                        raise _exhausted(kind, exc, name, attempts) from exc
                    self._handle(kind, exc, _generation, f"retrying {name} (attempt {number + 1} of {attempts})")
            raise AssertionError("unreachable: the last attempt returns or raises")

        return wrapper  # type: ignore[return-value]

    # Form 3: iterator, the `with attempt:` block is retried.
    def __iter__(self) -> Iterator[Attempt]:
        attempts = self.retries + 1
        for number in range(1, attempts + 1):
            attempt = Attempt(self, number, attempts)
            yield attempt
            if not attempt.recovered:
                return

    def __repr__(self) -> str:
        return f"recoverable(retries={self.retries})"
