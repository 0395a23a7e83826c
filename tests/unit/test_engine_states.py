"""The engine's states over the fake driver: an operation that does not fit the state is refused,
one operation runs at a time, NVML is read elsewhere while the process is locked, what a machine
without migration or without the checkpoint API allows, and the default settings."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from flexium.engine import EngineState, nvml, target_rules
from flexium.engine import engine as engine_module
from flexium.errors import (
    CapabilityError,
    InvalidStateError,
    OperationInProgressError,
    TargetRefusedError,
)
from support.engine import (  # noqa: F401  (fixtures)
    H200_BYTES,
    MARGIN,
    Background,
    ChildReads,
    GiB,
    assert_untouched,
    checkpoint_ops,
    driver,
    fake,
    make_engine,
    nvml_in_parent,
    on_gpu,
    wait_until,
)
from support.fake_driver import FakeDriver, ProcessState

pytestmark = pytest.mark.usefixtures("nvml_in_parent")


# ----------------------------------------------------------------------------- states and concurrency


def test_operations_that_do_not_fit_the_state_are_refused(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    engine = make_engine()
    with pytest.raises(InvalidStateError) as caught:
        engine.resume()
    assert str(caught.value) == "cannot resume: the job is running, not paused"
    assert fake.calls("cu") == []
    engine.pause()
    fake.clear_log()
    with pytest.raises(InvalidStateError) as caught:
        engine.pause()
    assert str(caught.value) == "cannot pause: the job is paused; resume it first (resume can take a target GPU)"
    with pytest.raises(InvalidStateError) as caught:
        engine.migrate(engine.gpus[1])
    assert str(caught.value) == "cannot migrate: the job is paused; resume it first (resume can take a target GPU)"
    assert fake.calls("cu") == []
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED


def test_one_operation_at_a_time(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, GiB)
    engine = make_engine()
    fake.set_delay_ms("cuCheckpointProcessCheckpoint", 400)
    running = Background(lambda: engine.migrate(engine.gpus[1]))
    running.start()
    wait_until(lambda: fake.state() == ProcessState.LOCKED, what="the migration to take the lock")
    assert engine.state == EngineState.MIGRATING and engine.is_busy()
    for second in (engine.pause, lambda: engine.migrate(engine.gpus[1]), engine.resume):
        with pytest.raises(OperationInProgressError) as caught:
            second()
        assert str(caught.value).endswith("another operation is in progress (MIGRATING); wait for it to finish")
    assert running.join_result().ok
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint", "Restore", "Unlock"]
    on_gpu(fake, engine, 1)
    assert not engine.is_busy()


def test_nvml_is_read_elsewhere_while_the_process_is_locked(
    fake: FakeDriver, make_engine: Callable[..., Any], nvml_in_parent: ChildReads
) -> None:
    engine = make_engine()
    fake.set_delay_ms("cuCheckpointProcessCheckpoint", 300)
    running = Background(lambda: engine.migrate(engine.gpus[1]))
    running.start()
    wait_until(lambda: fake.state() == ProcessState.LOCKED, what="the lock")
    before = nvml_in_parent.count
    assert len(nvml.host_gpus()) == 2  # e.g. the control thread reporting GPU state
    assert nvml_in_parent.count == before + 1
    assert running.join_result().ok
    before = nvml_in_parent.count
    nvml.host_gpus()
    assert nvml_in_parent.count == before  # running again: read here


# ----------------------------------------------------------------------------- capabilities, stop


def test_without_migration_capability_only_pause_and_resume_in_place(
    fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    from flexium.engine.capabilities import detect

    caps = dataclasses.replace(
        detect(check_torch=False),
        migration=False,
        problems=("NVIDIA driver 570.86.10: pause/resume only; migration to another GPU needs 580+",),
    )
    engine = make_engine(capabilities=caps)
    with pytest.raises(CapabilityError) as caught:
        engine.migrate(engine.gpus[1])
    assert str(caught.value) == (
        "migration to another GPU is not available on this machine: "
        "NVIDIA driver 570.86.10: pause/resume only; migration to another GPU needs 580+"
    )
    assert_untouched(fake, engine)
    fake.set_process_memory(0, 2 * GiB)
    engine.pause()
    with pytest.raises(CapabilityError, match="resuming on another GPU is not available"):
        engine.resume(engine.gpus[1])
    fake.set_other_memory(0, H200_BYTES)  # GPU 0 full, and no other GPU to point to
    with pytest.raises(TargetRefusedError) as refusal:
        engine.resume()
    assert str(refusal.value).endswith(
        "it stays paused; free memory there (this machine cannot resume it on another GPU)"
    )
    assert engine.state == EngineState.PAUSED
    fake.set_other_memory(0, 0)
    assert engine.resume().ok
    on_gpu(fake, engine, 0)


def test_without_the_checkpoint_api_nothing_is_attempted(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    from flexium.engine.capabilities import detect

    caps = dataclasses.replace(
        detect(check_torch=False), checkpoint_api=False, pause_resume=False, migration=False, problems=()
    )
    engine = make_engine(capabilities=caps)
    with pytest.raises(
        CapabilityError, match="^pause is not available on this machine: the driver does not support it$"
    ):
        engine.pause()
    with pytest.raises(CapabilityError):
        engine.migrate(engine.gpus[1])
    assert_untouched(fake, engine)


def test_default_settings() -> None:
    assert target_rules.DEFAULT_MEMORY_MARGIN_BYTES == MARGIN
    assert engine_module.DEFAULT_LOCK_TIMEOUT_MS > 0
    assert engine_module.DEFAULT_SAFE_POINT_WAIT_SECONDS > 0
