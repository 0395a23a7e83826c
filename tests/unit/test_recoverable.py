"""flexium.api.recoverable against a stand-in engine (CPU torch has no CUDA to fail).

The stand-in implements the interface recoverable relies on: capabilities.migration,
candidate_targets(), migrate(target), placement(). It is reached the way the real one is,
through flexium.api.runtime.current(), by putting a stand-in session module in sys.modules.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from flexium.api import recoverable as recoverable_module
from flexium.api.recoverable import CudaErrorKind, Recovery, classify_error, recoverable
from flexium.engine.operations import GpuIdentity, OperationKind, OperationResult, StepTiming
from flexium.errors import (
    ConfigError,
    DriverError,
    OperationFailedError,
    OperationInProgressError,
    RollbackFailedError,
    TargetRefusedError,
)

GiB = 2**30


def gpu(ordinal: int, name: str = "NVIDIA H200") -> GpuIdentity:
    return GpuIdentity(
        ordinal=ordinal,
        uuid=f"GPU-{ordinal:04d}",
        name=name,
        total_memory=141 * GiB,
        pci_bus_id=f"00000000:{ordinal:02X}:00.0",
        nvml_index=ordinal,
    )


@dataclass(frozen=True)
class Capabilities:
    migration: bool = True
    driver_version: str = "580.65.06"


@dataclass(frozen=True)
class Candidate:
    gpu: GpuIdentity
    free_bytes: int


class FakeEngine:
    """GPU 0 is where the job starts; free memory per GPU decides the candidate order."""

    def __init__(self, free: dict[int, int], *, migration: bool = True, driver: str = "580.65.06") -> None:
        self.capabilities = Capabilities(migration=migration, driver_version=driver)
        self.gpus = {ordinal: gpu(ordinal) for ordinal in free}
        self.free = dict(free)
        self.current = self.gpus[0]
        self.migrations: list[GpuIdentity] = []
        self.fail_with: BaseException | None = None
        self.report_failure = False
        self.migrate_delay = 0.0
        self.min_free = 1 * GiB

    def candidate_targets(self) -> list[Candidate]:
        found = [
            Candidate(g, self.free[o])
            for o, g in self.gpus.items()
            if g != self.current and g.name == self.current.name and self.free[o] >= self.min_free
        ]
        return sorted(found, key=lambda c: c.free_bytes, reverse=True)

    def migrate(self, target: GpuIdentity) -> OperationResult:
        if self.migrate_delay:
            time.sleep(self.migrate_delay)
        if self.fail_with is not None:
            raise self.fail_with
        source = self.current
        steps = (
            StepTiming("lock", 0.01, True),
            StepTiming("checkpoint", 0.5, True),
            StepTiming("restore", 1.0, True),
            StepTiming("restore", 0.25, True, rollback=True),
        )
        if self.report_failure:
            return OperationResult(
                OperationKind.MIGRATE,
                "driver",
                False,
                "cuda:0",
                source,
                target,
                steps,
                seconds=1.5,
                failed_step="restore",
                error="CUDA_ERROR_INVALID_VALUE",
            )
        self.migrations.append(target)
        self.current = target
        return OperationResult(OperationKind.MIGRATE, "driver", True, "cuda:0", source, target, steps[:3], seconds=1.5)

    def placement(self) -> tuple[str, GpuIdentity]:
        return "cuda:0", self.current


@pytest.fixture
def runtime_module(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], None]:
    """Install a stand-in flexium.api.runtime whose current() returns the given session."""

    def install(session: Any) -> None:
        module = types.ModuleType("flexium.api.runtime")
        module.current = lambda: session  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "flexium.api.runtime", module)

    return install


@pytest.fixture
def engine(runtime_module: Callable[[Any], None]) -> FakeEngine:
    eng = FakeEngine({0: 2 * GiB, 1: 60 * GiB, 2: 120 * GiB, 3: 30 * GiB})
    runtime_module(types.SimpleNamespace(engine=eng))
    return eng


def oom(message: str = "CUDA out of memory. Tried to allocate 20.00 GiB.") -> BaseException:
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.cuda.OutOfMemoryError(message)
    return RuntimeError(message)


ERRORS: dict[CudaErrorKind, str] = {
    CudaErrorKind.OOM: "CUDA error: out of memory",
    CudaErrorKind.ECC: "CUDA error: uncorrectable ECC error encountered",
    CudaErrorKind.DEVICE_ASSERT: "CUDA error: device-side assert triggered",
    CudaErrorKind.ILLEGAL_ACCESS: "CUDA error: an illegal memory access was encountered",
    CudaErrorKind.LAUNCH_FAILURE: "CUDA error: unspecified launch failure",
}


# -- detection ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(CudaErrorKind))
def test_classify_by_message(kind: CudaErrorKind) -> None:
    assert classify_error(RuntimeError(ERRORS[kind])) is kind


def test_classify_torch_oom_type() -> None:
    torch = pytest.importorskip("torch")
    assert classify_error(torch.cuda.OutOfMemoryError("anything at all")) is CudaErrorKind.OOM


def test_classify_any_exception_type_by_message() -> None:
    class AcceleratorError(Exception):
        pass

    assert (
        classify_error(AcceleratorError("CUDA error: an illegal memory access was encountered"))
        is CudaErrorKind.ILLEGAL_ACCESS
    )


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("shapes do not match"),
        RuntimeError("Expected all tensors to be on the same device"),
        MemoryError("DefaultCPUAllocator: can't allocate memory"),
        KeyboardInterrupt(),
        RuntimeError("Out Of Memory"),  # CudaErrorKind's texts are matched exactly, case included
    ],
)
def test_classify_non_cuda_errors(exc: BaseException) -> None:
    assert classify_error(exc) is None


def test_sticky_error_wins_over_oom_in_one_message() -> None:
    assert classify_error(RuntimeError("out of memory after uncorrectable ECC error")) is CudaErrorKind.ECC


def test_broken_str_is_not_classified() -> None:
    class Weird(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    assert classify_error(Weird()) is None


# -- form 1: context manager ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(CudaErrorKind))
def test_context_manager_moves_and_suppresses(engine: FakeEngine, kind: CudaErrorKind) -> None:
    guard = recoverable()
    ran_after = False
    with guard:
        raise RuntimeError(ERRORS[kind])
    ran_after = True
    assert ran_after
    assert engine.migrations == [gpu(2)]  # the most free memory first
    assert guard.last_recovery is not None
    assert guard.last_recovery.kind is kind
    assert guard.last_recovery.source == gpu(0)
    assert guard.last_recovery.target == gpu(2)


def test_context_manager_no_error_does_nothing(engine: FakeEngine) -> None:
    with recoverable():
        value = 1 + 1
    assert value == 2
    assert engine.migrations == []


def test_context_manager_reraises_non_cuda_errors(engine: FakeEngine) -> None:
    with pytest.raises(KeyError):
        with recoverable():
            raise KeyError("batch")
    assert engine.migrations == []


def test_context_manager_torch_oom(engine: FakeEngine) -> None:
    pytest.importorskip("torch")
    with recoverable():
        raise oom("allocation failed")  # no "out of memory" text: detected by type
    assert engine.migrations == [gpu(2)]


def test_recovery_is_logged_with_from_to_and_timings(engine: FakeEngine, capsys: pytest.CaptureFixture[str]) -> None:
    with recoverable():
        raise RuntimeError(ERRORS[CudaErrorKind.OOM])
    err = capsys.readouterr().err
    assert "[flexium] WARNING: recovered from CUDA out of memory (OOM) on cuda:0" in err
    assert "moved GPU 0 (NVIDIA H200, GPU-0000) -> GPU 2 (NVIDIA H200, GPU-0002) (120.0 GiB free)" in err
    assert "migration 1.50 s: lock 0.01 s, checkpoint 0.50 s, restore 1.00 s" in err
    assert "was lost; training continues" in err


# -- form 2: decorator ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(CudaErrorKind))
def test_decorator_retries_on_the_new_gpu(engine: FakeEngine, kind: CudaErrorKind) -> None:
    ran_on: list[GpuIdentity] = []

    @recoverable(retries=3)
    def train_step(x: int, *, scale: int) -> tuple[int, GpuIdentity]:
        ran_on.append(engine.current)
        if engine.current == gpu(0):
            raise RuntimeError(ERRORS[kind])
        return x * scale, engine.current

    assert train_step(2, scale=5) == (10, gpu(2))
    assert ran_on == [gpu(0), gpu(2)]
    assert engine.migrations == [gpu(2)]


def test_decorator_keeps_function_metadata() -> None:
    @recoverable()
    def train_step(model: int) -> int:
        """One step."""
        return model

    assert train_step.__name__ == "train_step"
    assert train_step.__doc__ == "One step."
    assert train_step(3) == 3


def test_decorator_non_cuda_error_is_not_retried(engine: FakeEngine) -> None:
    calls = 0

    @recoverable(retries=3)
    def step() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("bad label")

    with pytest.raises(ValueError, match="bad label"):
        step()
    assert calls == 1
    assert engine.migrations == []


def test_decorator_retries_exhausted(engine: FakeEngine) -> None:
    calls = 0
    errors: list[BaseException] = []

    @recoverable(retries=2)
    def step() -> None:
        nonlocal calls
        calls += 1
        errors.append(RuntimeError(f"CUDA out of memory (try {calls})"))
        raise errors[-1]

    with pytest.raises(RuntimeError) as info:
        step()
    assert calls == 3  # the first try and 2 retries
    assert engine.migrations == [gpu(2), gpu(1)]  # moved after each failure but the last
    message = str(info.value)
    assert "CUDA out of memory (OOM)" in message
    assert "all 3 attempts" in message
    assert "last error: RuntimeError: CUDA out of memory (try 3)" in message
    assert "step" in message
    assert info.value.__cause__ is errors[-1]


def test_decorator_retries_zero_tries_once(engine: FakeEngine) -> None:
    @recoverable(retries=0)
    def step() -> None:
        raise RuntimeError(ERRORS[CudaErrorKind.LAUNCH_FAILURE])

    with pytest.raises(RuntimeError, match="the only attempt"):
        step()
    assert engine.migrations == []


def test_decorator_last_error_kind_is_named(engine: FakeEngine) -> None:
    kinds = iter([CudaErrorKind.OOM, CudaErrorKind.ECC])

    @recoverable(retries=1)
    def step() -> None:
        raise RuntimeError(ERRORS[next(kinds)])

    with pytest.raises(
        RuntimeError, match=r"failed with an uncorrectable ECC error on all 2 attempts.*nvidia-smi -q -d ECC"
    ):
        step()


def test_decorator_non_cuda_error_on_a_retry_is_raised_at_once(engine: FakeEngine) -> None:
    calls = 0

    @recoverable(retries=5)
    def step() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError(ERRORS[CudaErrorKind.OOM])
        raise TypeError("not a tensor")

    with pytest.raises(TypeError):
        step()
    assert calls == 2


# -- form 3: iterator -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(CudaErrorKind))
def test_iterator_retries_on_the_new_gpu(engine: FakeEngine, kind: CudaErrorKind) -> None:
    ran_on: list[GpuIdentity] = []
    for attempt in recoverable(retries=3):
        with attempt:
            ran_on.append(engine.current)
            if len(ran_on) < 3:
                raise RuntimeError(ERRORS[kind])
            output = "done"
    assert output == "done"
    assert ran_on == [gpu(0), gpu(2), gpu(1)]
    assert engine.migrations == [gpu(2), gpu(1)]


def test_iterator_stops_after_success(engine: FakeEngine) -> None:
    attempts = []
    for attempt in recoverable(retries=3):
        with attempt:
            attempts.append(attempt.number)
    assert attempts == [1]


def test_iterator_retries_exhausted(engine: FakeEngine) -> None:
    tries = 0
    with pytest.raises(RuntimeError) as info:
        for attempt in recoverable(retries=1):
            with attempt:
                tries += 1
                raise RuntimeError(ERRORS[CudaErrorKind.ILLEGAL_ACCESS])
    assert tries == 2
    assert engine.migrations == [gpu(2)]
    assert "an illegal memory access on all 2 attempts" in str(info.value)
    assert "illegal memory access was encountered" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_iterator_non_cuda_error_is_not_retried(engine: FakeEngine) -> None:
    tries = 0
    with pytest.raises(ZeroDivisionError):
        for attempt in recoverable(retries=3):
            with attempt:
                tries += 1
                _ = 1 / 0
    assert tries == 1
    assert engine.migrations == []


# -- cannot recover -------------------------------------------------------------------------------


def test_not_initialised(runtime_module: Callable[[Any], None]) -> None:
    runtime_module(None)
    original = RuntimeError(ERRORS[CudaErrorKind.OOM])
    with pytest.raises(RuntimeError) as info:
        with recoverable():
            raise original
    assert "flexium is not initialised" in str(info.value)
    assert "flexium.init()" in str(info.value)
    assert info.value.__cause__ is original


def test_runtime_module_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flexium.api.runtime", None)
    with pytest.raises(RuntimeError, match="flexium is not initialised"):
        with recoverable():
            raise RuntimeError(ERRORS[CudaErrorKind.OOM])


def test_no_engine(runtime_module: Callable[[Any], None]) -> None:
    runtime_module(types.SimpleNamespace(engine=None))
    with pytest.raises(RuntimeError, match=r"cannot recover from CUDA out of memory \(OOM\).*without its GPU engine"):
        with recoverable():
            raise RuntimeError(ERRORS[CudaErrorKind.OOM])


def test_no_migration_capability(runtime_module: Callable[[Any], None]) -> None:
    eng = FakeEngine({0: GiB, 1: 100 * GiB}, migration=False, driver="550.54.15")
    runtime_module(types.SimpleNamespace(engine=eng))

    @recoverable()
    def step() -> None:
        raise RuntimeError(ERRORS[CudaErrorKind.OOM])

    with pytest.raises(RuntimeError) as info:
        step()
    assert "needs NVIDIA driver 580+ (this machine has driver 550.54.15)" in str(info.value)
    assert eng.migrations == []


def test_no_candidate_oom_names_model_and_size(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 40 * GiB)
    engine.min_free = 200 * GiB
    with pytest.raises(RuntimeError) as info:
        with recoverable():
            raise RuntimeError(ERRORS[CudaErrorKind.OOM])
    message = str(info.value)
    assert "no other NVIDIA H200 GPU has 40.0 GiB free" in message
    assert "GPU 0 (NVIDIA H200, GPU-0000)" in message
    assert "Reduce the batch size" in message


def test_no_candidate_size_from_engine_process_bytes(engine: FakeEngine) -> None:
    engine.process_bytes = lambda: 70 * GiB  # type: ignore[attr-defined]
    engine.min_free = 200 * GiB
    with pytest.raises(RuntimeError, match=r"no other NVIDIA H200 GPU has 70.0 GiB free"):
        with recoverable():
            raise RuntimeError(ERRORS[CudaErrorKind.OOM])


def test_no_candidate_without_size(engine: FakeEngine) -> None:
    engine.gpus = {0: engine.gpus[0]}
    with pytest.raises(RuntimeError, match=r"no other NVIDIA H200 GPU has enough free memory for this job"):
        with recoverable():
            raise RuntimeError(ERRORS[CudaErrorKind.OOM])


def test_other_models_are_not_candidates(runtime_module: Callable[[Any], None]) -> None:
    eng = FakeEngine({0: GiB, 1: 100 * GiB})
    eng.gpus[1] = gpu(1, name="NVIDIA A100")
    runtime_module(types.SimpleNamespace(engine=eng))
    with pytest.raises(RuntimeError, match="no other NVIDIA H200 GPU"):
        with recoverable():
            raise RuntimeError(ERRORS[CudaErrorKind.OOM])


def test_no_candidate_after_ecc_says_context_unusable(engine: FakeEngine) -> None:
    engine.gpus = {0: engine.gpus[0]}
    with pytest.raises(RuntimeError) as info:
        with recoverable():
            raise RuntimeError(ERRORS[CudaErrorKind.ECC])
    message = str(info.value)
    assert "CUDA context is likely unusable" in message
    assert "nvidia-smi -q -d ECC" in message
    assert "last checkpoint" in message


@pytest.mark.parametrize(
    "kind", [CudaErrorKind.ECC, CudaErrorKind.DEVICE_ASSERT, CudaErrorKind.ILLEGAL_ACCESS, CudaErrorKind.LAUNCH_FAILURE]
)
def test_driver_refuses_to_move_away_from_faulty_gpu(engine: FakeEngine, kind: CudaErrorKind) -> None:
    refusal = OperationFailedError(
        "cuCheckpointProcessCheckpoint failed: CUDA_ERROR_ECC_UNCORRECTABLE", step="checkpoint"
    )
    engine.fail_with = refusal

    @recoverable(retries=3)
    def step() -> None:
        raise RuntimeError(ERRORS[kind])

    with pytest.raises(RuntimeError) as info:
        step()
    message = str(info.value)
    assert "CUDA context is likely unusable" in message
    assert "driver refused to move it" in message
    assert "rolled back at phase 'checkpoint'" in message
    assert "last checkpoint" in message
    assert info.value.__cause__ is refusal


def test_ecc_advice_names_nvidia_smi(engine: FakeEngine) -> None:
    engine.fail_with = OperationFailedError("restore failed", step="restore")
    with pytest.raises(RuntimeError, match=r"nvidia-smi -q -d ECC"):
        with recoverable():
            raise RuntimeError(ERRORS[CudaErrorKind.ECC])


def test_device_assert_advice_names_launch_blocking(engine: FakeEngine) -> None:
    engine.fail_with = OperationFailedError("checkpoint failed", step="checkpoint")
    with pytest.raises(RuntimeError, match=r"CUDA_LAUNCH_BLOCKING=1"):
        with recoverable():
            raise RuntimeError(ERRORS[CudaErrorKind.DEVICE_ASSERT])


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (TargetRefusedError("GPU 2 has only 1 GiB free"), "the job is still on GPU 0"),
        (OperationFailedError("restore failed", step="restore"), "rolled back at phase 'restore'"),
        (RollbackFailedError("restore and rollback failed", step="restore"), "may be stuck"),
        (OperationInProgressError("a pause is running"), "Retry the step once that operation has finished"),
    ],
)
def test_oom_move_failures(engine: FakeEngine, failure: BaseException, expected: str) -> None:
    engine.fail_with = failure
    with pytest.raises(RuntimeError) as info:
        with recoverable():
            raise RuntimeError(ERRORS[CudaErrorKind.OOM])
    assert expected in str(info.value)
    assert info.value.__cause__ is failure


@pytest.mark.parametrize("kind", [CudaErrorKind.OOM, CudaErrorKind.ECC])
def test_a_driver_error_during_the_move_leaves_the_state_unknown(engine: FakeEngine, kind: CudaErrorKind) -> None:
    """A DriverError out of migrate (e.g. the process state read after the locked section) is
    not a rollback: the job may be anywhere, so the message must not say it is still on GPU 0."""
    failure = DriverError(
        "cuCheckpointProcessGetState failed: CUDA_ERROR_UNKNOWN (unknown error): pid 4242",
        call="cuCheckpointProcessGetState",
        code=999,
        error_name="CUDA_ERROR_UNKNOWN",
    )
    engine.fail_with = failure
    calls: list[int] = []

    @recoverable(retries=3)
    def step() -> None:
        calls.append(1)
        raise RuntimeError(ERRORS[kind])

    with pytest.raises(RuntimeError) as info:
        step()
    message = str(info.value)
    assert message.startswith(f"cannot recover from {kind.label} (")
    assert (
        "moving to GPU 2 (NVIDIA H200, GPU-0002) failed inside the driver call cuCheckpointProcessGetState "
        "(DriverError: cuCheckpointProcessGetState failed: CUDA_ERROR_UNKNOWN (unknown error): pid 4242); "
        "the job's state is unknown: it may be on either GPU, or frozen. Restart the job if it does not continue."
    ) in message
    assert "still on" not in message and "rolled back" not in message
    assert info.value.__cause__ is failure
    assert calls == [1] and engine.migrations == [] and engine.current == engine.gpus[0]


def test_migrate_reporting_failure_is_not_success(engine: FakeEngine) -> None:
    engine.report_failure = True
    with pytest.raises(
        RuntimeError,
        match=r"failed \(OperationFailedError: CUDA_ERROR_INVALID_VALUE\); it was rolled back at phase 'restore'",
    ):
        with recoverable():
            raise RuntimeError(ERRORS[CudaErrorKind.OOM])


# -- memory is dropped before an OOM move -----------------------------------------------------------


class Activation:
    pass


def test_oom_drops_failed_frames_and_empties_cache(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    refs: list[weakref.ref[Activation]] = []
    alive_at_move: list[bool] = []
    real_migrate = engine.migrate

    def migrate(target: GpuIdentity) -> OperationResult:
        gc.collect()
        alive_at_move.append(refs[0]() is not None)
        return real_migrate(target)

    engine.migrate = migrate  # type: ignore[method-assign]

    def forward() -> None:
        activation = Activation()  # stands for tensors the failed step still holds
        refs.append(weakref.ref(activation))
        raise oom()

    kept = Activation()
    with recoverable():
        forward()
    assert alive_at_move == [False]
    assert emptied == [True]
    assert isinstance(kept, Activation)  # the caller's own frame is untouched


def test_non_oom_does_not_touch_frames(engine: FakeEngine) -> None:
    holder: list[weakref.ref[Activation]] = []

    def forward() -> None:
        activation = Activation()
        holder.append(weakref.ref(activation))
        raise RuntimeError(ERRORS[CudaErrorKind.ECC])

    try:
        forward()
    except RuntimeError as exc:
        caught = exc
    guard = recoverable()
    assert guard.__exit__(type(caught), caught, caught.__traceback__) is True
    assert holder[0]() is not None
    del caught


# -- threads and arguments ------------------------------------------------------------------------


def test_simultaneous_failures_move_once(engine: FakeEngine) -> None:
    engine.migrate_delay = 0.3
    barrier = threading.Barrier(2)
    problems: list[BaseException] = []

    def worker() -> None:
        try:
            with recoverable():
                barrier.wait(timeout=10)
                raise RuntimeError(ERRORS[CudaErrorKind.OOM])
        except BaseException as exc:  # pragma: no cover - reported below
            problems.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not problems
    assert engine.migrations == [gpu(2)]


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", None])
def test_retries_must_be_a_whole_number(bad: Any) -> None:
    with pytest.raises(ConfigError, match="retries must be a whole number >= 0"):
        recoverable(retries=bad)


def test_bare_decorator_says_to_add_parentheses() -> None:
    with pytest.raises(ConfigError, match=r"@recoverable\(\)"):

        @recoverable  # type: ignore[arg-type]
        def step() -> None:
            pass


def test_async_functions_are_refused() -> None:
    with pytest.raises(ConfigError, match="async"):

        @recoverable()
        async def step() -> None:
            pass


def test_keyboard_interrupt_passes_through(engine: FakeEngine) -> None:
    with pytest.raises(KeyboardInterrupt):
        with recoverable():
            raise KeyboardInterrupt
    assert engine.migrations == []


def test_public_names() -> None:
    assert set(recoverable_module.__all__) == {"recoverable", "Attempt", "CudaErrorKind", "Recovery", "classify_error"}
    assert repr(recoverable(retries=2)) == "recoverable(retries=2)"
    assert Recovery.__dataclass_params__.frozen  # type: ignore[attr-defined]
