"""The gate that keeps DataLoader pin-memory threads out of CUDA while the process is locked or
checkpointed (flexium.engine.guards.pinning_gate; fact `pinning-while-paused-kills`): on its own with threads, and
closed by the engine over the fake driver from a pause until the resume. tests/gpu/
test_paused_dataloader.py checks on a GPU that a job pinning batches while paused survives."""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from flexium.engine import EngineState
from flexium.engine.guards.pinning_gate import PinningGate
from flexium.errors import OperationFailedError
from support.engine import (  # noqa: F401  (fixtures)
    Background,
    driver,
    fake,
    make_engine,
    nvml_in_parent,
)
from support.fake_driver import FakeDriver

PIN_MODULE = "torch.utils.data._utils.pin_memory"


def still_running(thread: threading.Thread, seconds: float = 0.3) -> bool:
    thread.join(seconds)
    return thread.is_alive()


def test_a_closed_gate_holds_new_pins_and_waits_for_the_one_under_way() -> None:
    gate = PinningGate()
    release = threading.Event()
    guarded = gate.guard(lambda batch: release.wait(10) and batch)

    first = Background(lambda: guarded("first"))
    first.start()
    time.sleep(0.05)
    assert gate.close(0.1) is False  # "first" is still being pinned
    second = Background(lambda: guarded("second"))
    second.start()
    release.set()
    assert first.join_result() == "first"
    assert gate.close(5) is True
    assert still_running(second), "a pin started while the gate was closed"
    gate.open()
    assert second.join_result() == "second"


def test_a_pin_recursing_into_a_batch_is_not_held_by_its_own_gate() -> None:
    """torch's pin function calls itself for each element of a batch: once a thread is in, its
    inner calls pass even if the gate closes meanwhile."""
    gate = PinningGate()
    inside = threading.Event()
    go_on = threading.Event()

    def pin(batch: Any) -> Any:
        if isinstance(batch, list):
            inside.set()
            go_on.wait(10)
            return [guarded(item) for item in batch]
        return batch * 2

    guarded = gate.guard(pin)
    worker = Background(lambda: guarded([1, 2, 3]))
    worker.start()
    assert inside.wait(5)
    closing = Background(lambda: gate.close(5))
    closing.start()
    time.sleep(0.05)
    go_on.set()
    assert worker.join_result() == [2, 4, 6]
    assert closing.join_result() is True
    assert not gate.is_open


@pytest.mark.usefixtures("nvml_in_parent")
def test_the_engine_holds_dataloader_pins_from_a_pause_until_the_resume(
    fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    pin_module = importlib.import_module(PIN_MODULE)
    original = pin_module.pin_memory
    engine = make_engine()
    assert pin_module.pin_memory is not original and pin_module.pin_memory.__wrapped_by_flexium__ is original
    assert pin_module.pin_memory("batch") == "batch"  # a string is returned as it is: no CUDA

    assert engine.pause().ok
    pinning = Background(lambda: pin_module.pin_memory("batch"))
    pinning.start()
    assert still_running(pinning), "a batch was pinned while the job was paused"
    assert engine.resume().ok
    assert pinning.join_result() == "batch"

    assert engine.migrate(engine.gpus[1]).ok
    assert pin_module.pin_memory("after a migration") == "after a migration"

    engine.stop()
    assert pin_module.pin_memory is original


@pytest.mark.usefixtures("nvml_in_parent")
def test_a_pause_rolled_back_leaves_the_gate_open(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    pin_module = importlib.import_module(PIN_MODULE)
    engine = make_engine()
    fake.fail("cuCheckpointProcessCheckpoint", "CUDA_ERROR_UNKNOWN")
    with pytest.raises(OperationFailedError):
        engine.pause()
    assert engine.state == EngineState.RUNNING
    done = Background(lambda: pin_module.pin_memory("batch"))
    done.start()
    assert done.join_result(5) == "batch"
