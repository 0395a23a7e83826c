"""Every failure path of the engine's operations over the fake driver, and where it leaves the job:
a migration's failure rolled back to the source (or FAILED, said loudly, when the rollback fails
or the target filled while the job was checkpointed), a pause's rolled back, a resume that fails
and stays paused, or says the job is lost."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from flexium.engine import EngineState, nvml
from flexium.errors import (
    InvalidStateError,
    OperationFailedError,
    RollbackFailedError,
)
from support.engine import (  # noqa: F401  (fixtures)
    H200_BYTES,
    GiB,
    MiB,
    checkpoint_ops,
    driver,
    fake,
    make_engine,
    nvml_in_parent,
    on_gpu,
    reader_in_parent,
    step_summary,
)
from support.fake_driver import FakeDriver, ProcessState

pytestmark = pytest.mark.usefixtures("nvml_in_parent")


# ----------------------------------------------------------------------------- migrate: failures


def test_lock_timeout_touches_nothing_else(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, GiB)
    fake.set_lock_delay_ms(2000)  # the process's CUDA work takes 2 s to drain
    engine = make_engine(lock_timeout_ms=50)
    started = time.perf_counter()
    with pytest.raises(OperationFailedError) as caught:
        engine.migrate(engine.gpus[1])
    assert time.perf_counter() - started < 1.0
    err = caught.value
    assert not isinstance(err, RollbackFailedError)
    assert err.step == "lock"
    message = str(err)
    assert "cuCheckpointProcessLock returned CUDA_ERROR_TIMEOUT" in message
    assert "try again" in message and "rolled back: the job runs on cuda:0" in message
    assert checkpoint_ops(fake) == ["Lock"]
    assert engine.state == EngineState.RUNNING
    on_gpu(fake, engine, 0)
    assert step_summary(err.result) == [("prepare", True, False), ("lock", False, False)]
    assert err.result.steps[1].seconds >= 0.045
    assert "CUDA_ERROR_TIMEOUT" in err.result.steps[1].error
    assert engine.last_result is err.result and not err.result.ok
    assert not nvml._frozen.is_set()
    # The job carries on and can be moved once it is less busy.
    fake.set_lock_delay_ms(0)
    assert engine.migrate(engine.gpus[1]).ok


def test_checkpoint_failure_is_rolled_back(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, GiB)
    engine = make_engine()
    fake.fail("cuCheckpointProcessCheckpoint", "CUDA_ERROR_UNKNOWN")
    with pytest.raises(OperationFailedError) as caught:
        engine.migrate(engine.gpus[1])
    err = caught.value
    assert not isinstance(err, RollbackFailedError)
    assert err.step == "checkpoint"
    assert "phase 'checkpoint' failed: cuCheckpointProcessCheckpoint returned CUDA_ERROR_UNKNOWN" in str(err)
    assert f"rolled back: the job runs on cuda:0 ({fake.uuid(0)}) as before" in str(err)
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint", "Unlock"]
    assert step_summary(err.result)[-1] == ("unlock", True, True)
    assert engine.state == EngineState.RUNNING
    on_gpu(fake, engine, 0)
    assert fake.process_bytes_on(0) == GiB


def test_failed_remapped_restore_is_recovered_in_place(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    """fact `failed-restore-stays-checkpointed`: the failed restore leaves the process CHECKPOINTED; the engine's
    recover step restores it in place (no pairs) and unlocks."""
    fake.set_process_memory(0, 5 * GiB)
    engine = make_engine()
    fake.fail("cuCheckpointProcessRestore", "CUDA_ERROR_INVALID_VALUE")
    with pytest.raises(OperationFailedError) as caught:
        engine.migrate(engine.gpus[1])
    err = caught.value
    assert not isinstance(err, RollbackFailedError)
    assert err.step == "restore"
    assert "phase 'restore' failed: cuCheckpointProcessRestore returned CUDA_ERROR_INVALID_VALUE" in str(err)
    assert "rolled back" in str(err)
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint", "Restore", "Restore", "Unlock"]
    restores = [c for c in fake.calls("cuCheckpointProcessRestore")]
    assert [c.pairs for c in restores] == [2, 0]  # remapped, then in place
    assert step_summary(err.result) == [
        ("prepare", True, False),
        ("lock", True, False),
        ("checkpoint", True, False),
        ("room", True, False),
        ("restore", False, False),
        ("restore", True, True),
        ("unlock", True, True),
    ]
    assert engine.state == EngineState.RUNNING
    on_gpu(fake, engine, 0)
    assert fake.process_bytes_on(0) == 5 * GiB and fake.process_bytes_on(1) == 0
    assert not nvml._frozen.is_set()
    # Nothing was left behind: the next migration works.
    assert engine.migrate(engine.gpus[1]).ok
    on_gpu(fake, engine, 1)


LOST_FOR_MEMORY = (
    "ROLLBACK FAILED: the process is CHECKPOINTED: the GPU had too little free memory for the restore, and after a "
    "restore failed the driver refuses every later one (fact `restore-without-room-loses-process` in docs/facts.md), "
    "so it can never run CUDA again; end the job and start it again from its last checkpoint"
)


def test_a_target_filled_while_the_job_is_checkpointed_is_caught_before_the_restore(
    fake: FakeDriver, make_engine: Callable[..., Any], reader_in_parent: list[str]
) -> None:
    """Another job takes the target's memory after the target check: the room check inside the locked
    section (the NVML reader asked over its pipes, csrc/room_check.h) sees it before the restore is
    tried, and the job is restored where it was. A restore without room would have lost it
    (fact `restore-without-room-loses-process`)."""
    fake.set_process_memory(0, 40 * GiB)
    engine = make_engine()

    filled: list[bool] = []

    def someone_fills_gpu1(state: EngineState) -> None:  # once, after the target check
        if state == EngineState.MIGRATING and not filled:
            filled.append(True)
            fake.set_other_memory(1, H200_BYTES - 10 * GiB)

    engine.add_state_listener(someone_fills_gpu1)
    with pytest.raises(OperationFailedError) as caught:
        engine.migrate(engine.gpus[1], path="driver")
    error = caught.value
    assert not isinstance(error, RollbackFailedError) and error.step == "room"
    gpu1 = engine.gpus[1].uuid
    assert reader_in_parent == [f"free {gpu1}"]
    assert str(error) == (
        f"migrate failed: phase 'room' failed: {gpu1} has 10240 MiB free, the restore needs {40 * 1024 + 512} MiB: "
        "another process took memory there while the job was checkpointed, so the restore was not tried (it would have "
        "lost the job, fact `restore-without-room-loses-process` in docs/facts.md); rolled back: the job runs on "
        f"cuda:0 ({engine.gpus[0].uuid}) as before"
    )
    assert step_summary(error.result)[-5:] == [
        ("lock", True, False),
        ("checkpoint", True, False),
        ("room", False, False),
        ("restore", True, True),
        ("unlock", True, True),
    ]
    assert engine.state == EngineState.RUNNING
    on_gpu(fake, engine, 0)
    fake.set_other_memory(1, 0)
    assert engine.migrate(engine.gpus[1], path="driver").ok  # with room again the move runs
    on_gpu(fake, engine, 1)


def test_a_target_filled_after_the_last_room_check_loses_the_job_and_says_so(
    fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    """The target fills between the last room check and the restore (here: the NVML reader, a child process with a fake
    of its own, sees room that this process's fake does not): the restore fails for memory, and the in-place restore
    that would roll back is refused for good, as on driver 580 (fact `restore-without-room-loses-process`, which the
    fake models). The error says the job is lost and what to do."""
    fake.set_process_memory(0, 40 * GiB)
    engine = make_engine()

    def someone_fills_gpu1(state: EngineState) -> None:
        if state == EngineState.MIGRATING:
            fake.set_other_memory(1, H200_BYTES - 10 * GiB)

    engine.add_state_listener(someone_fills_gpu1)
    with pytest.raises(RollbackFailedError) as caught:
        engine.migrate(engine.gpus[1], path="driver")
    steps = caught.value.result.steps
    failed = [s for s in steps if not s.ok]
    assert [(s.step, s.rollback) for s in failed] == [("restore", False), ("restore", True), ("unlock", True)]
    assert "CUDA_ERROR_OUT_OF_MEMORY" in str(failed[0].error) and "CUDA_ERROR_OPERATING_SYSTEM" in str(failed[1].error)
    assert ("room", True) in [(s.step, s.ok) for s in steps]  # the reader saw room
    assert caught.value.step == "restore" and str(caught.value).endswith(LOST_FOR_MEMORY)
    assert engine.state == EngineState.FAILED and fake.state() == ProcessState.CHECKPOINTED


def test_rollback_failure_is_loud_and_the_engine_refuses_everything_after(
    fake: FakeDriver, make_engine: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    fake.set_process_memory(0, GiB)
    engine = make_engine()
    fake.fail("cuCheckpointProcessRestore", "CUDA_ERROR_UNKNOWN", nth=0)  # every restore fails
    with pytest.raises(RollbackFailedError) as caught:
        engine.migrate(engine.gpus[1])
    err = caught.value
    assert isinstance(err, OperationFailedError)
    assert err.step == "restore"
    assert "ROLLBACK FAILED: the process is CHECKPOINTED, not RUNNING" in str(err)
    assert step_summary(err.result)[-2:] == [("restore", False, True), ("unlock", False, True)]
    assert engine.state == EngineState.FAILED
    assert fake.state() == ProcessState.CHECKPOINTED
    assert "CRITICAL: migrate failed and could not be rolled back" in capsys.readouterr().err
    fake.clear_log()
    for attempt in (lambda: engine.migrate(engine.gpus[1]), engine.pause, engine.resume):
        with pytest.raises(InvalidStateError) as refused_:
            attempt()
        assert "an earlier rollback failed and the process may be stuck; restart the job" in str(refused_.value)
    assert fake.calls("cu") == []


def test_unlock_failure_after_a_successful_restore_is_retried(
    fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    fake.set_process_memory(0, GiB)
    engine = make_engine()
    fake.fail("cuCheckpointProcessUnlock", "CUDA_ERROR_UNKNOWN")
    result = engine.migrate(engine.gpus[1])
    # The process was restored on the target and is running there: the move happened.
    assert result.ok
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint", "Restore", "Unlock", "Unlock"]
    assert step_summary(result)[-2:] == [("unlock", False, False), ("unlock", True, True)]
    assert engine.state == EngineState.RUNNING
    on_gpu(fake, engine, 1)


def test_unlock_failing_for_good_is_a_failed_rollback(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    engine = make_engine()
    fake.fail("cuCheckpointProcessUnlock", "CUDA_ERROR_UNKNOWN", nth=0)
    with pytest.raises(RollbackFailedError) as caught:
        engine.migrate(engine.gpus[1])
    assert caught.value.step == "unlock"
    assert "the process is LOCKED" in str(caught.value)
    assert engine.state == EngineState.FAILED and fake.state() == ProcessState.LOCKED


@pytest.mark.parametrize("operation,busy", [("migrate", EngineState.MIGRATING), ("pause", EngineState.PAUSING)])
def test_an_error_in_prepare_leaves_the_engine_usable(
    fake: FakeDriver, make_engine: Callable[..., Any], operation: str, busy: EngineState
) -> None:
    fake.set_process_memory(0, GiB)
    engine = make_engine()
    armed = [True]

    def nvml_breaks(state: EngineState) -> None:
        if state == busy and armed[0]:  # validation is over; prepare reads NVML next
            armed[0] = False
            fake.fail("nvmlDeviceGetCount_v2", "NVML_ERROR_UNKNOWN")

    engine.add_state_listener(nvml_breaks)
    run = (lambda: engine.migrate(engine.gpus[1])) if operation == "migrate" else engine.pause
    with pytest.raises(OperationFailedError, match="at phase 'prepare'"):
        run()
    assert checkpoint_ops(fake) == []
    on_gpu(fake, engine, 0)
    # The process runs where it was: the engine must say so and take the next operation.
    assert engine.state == EngineState.RUNNING, f"engine stuck in {engine.state.value}"
    assert not engine.is_busy()
    assert run().ok


def test_a_failing_state_listener_does_not_break_an_operation(
    fake: FakeDriver, make_engine: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    engine = make_engine()

    def broken(state: EngineState) -> None:
        raise RuntimeError("listener bug")

    engine.add_state_listener(broken)
    assert engine.migrate(engine.gpus[1]).ok
    on_gpu(fake, engine, 1)
    assert "state listener failed" in capsys.readouterr().err


def test_failed_resume_stays_paused_and_can_be_retried(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    """A restore refused for its arguments leaves the process restorable (fact `failed-restore-stays-checkpointed`)."""
    fake.set_process_memory(0, 2 * GiB)
    engine = make_engine()
    engine.pause()
    fake.fail("cuCheckpointProcessRestore", "CUDA_ERROR_INVALID_VALUE")
    with pytest.raises(OperationFailedError) as caught:
        engine.resume(engine.gpus[1])
    err = caught.value
    assert not isinstance(err, RollbackFailedError)
    assert err.step == "restore"
    # An import of another process's CUDA memory outside PyTorch, which flexium cannot see, fails
    # the restore with the same error and loses the job (fact `ipc-import-unrestorable`): the error says so.
    assert str(err).endswith(
        "; the job is still paused and can be resumed again, unless this process holds CUDA memory imported from "
        "another process outside PyTorch (CuPy, cuIpcOpenMemHandle): the driver cannot restore such a process (fact "
        "`ipc-import-unrestorable` in docs/facts.md), the next resume then fails with CUDA_ERROR_OPERATING_SYSTEM, and "
        "the job must be started again from its last checkpoint"
    )
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED
    assert nvml._frozen.is_set()
    assert engine.resume(engine.gpus[1]).ok
    on_gpu(fake, engine, 1)


def test_a_resume_that_found_too_little_room_says_the_job_is_lost(
    fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    """The target fills up after the engine's room check: the restore fails for memory, after which
    the driver refuses every restore of the process (fact `restore-without-room-loses-process`). The job is not "still
    paused and can be resumed again" but lost, and the engine says so at once."""
    fake.set_process_memory(0, 30 * GiB)
    engine = make_engine()
    engine.pause()

    def fill_target(state: EngineState) -> None:  # GPU 1 fills up after the engine's own check
        if state == EngineState.RESUMING:
            fake.set_other_memory(1, H200_BYTES - GiB)

    engine.add_state_listener(fill_target)
    with pytest.raises(RollbackFailedError) as caught:
        engine.resume(engine.gpus[1])
    message = str(caught.value)
    assert "cuCheckpointProcessRestore returned CUDA_ERROR_OUT_OF_MEMORY" in message
    assert message.endswith(LOST_FOR_MEMORY)
    assert engine.state == EngineState.FAILED and fake.state() == ProcessState.CHECKPOINTED
    with pytest.raises(InvalidStateError, match="restart the job"):
        engine.resume()


def test_resume_unlock_failing_once_still_resumes(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    engine = make_engine()
    engine.pause()
    fake.fail("cuCheckpointProcessUnlock", "CUDA_ERROR_UNKNOWN")
    assert engine.resume().ok
    assert engine.state == EngineState.RUNNING and fake.state() == ProcessState.RUNNING


@pytest.mark.parametrize(
    "function,code,step,ops",
    [
        ("cuCheckpointProcessLock", "CUDA_ERROR_NOT_PERMITTED", "lock", ["Lock"]),
        ("cuCheckpointProcessCheckpoint", "CUDA_ERROR_OUT_OF_MEMORY", "checkpoint", ["Lock", "Checkpoint", "Unlock"]),
    ],
)
def test_failed_pause_is_rolled_back(
    fake: FakeDriver, make_engine: Callable[..., Any], function: str, code: str, step: str, ops: list[str]
) -> None:
    fake.set_process_memory(0, GiB)
    engine = make_engine()
    fake.fail(function, code)
    with pytest.raises(OperationFailedError) as caught:
        engine.pause()
    assert not isinstance(caught.value, RollbackFailedError)
    assert caught.value.step == step and code in str(caught.value)
    assert "rolled back: the job runs on cuda:0 as before" in str(caught.value)
    assert checkpoint_ops(fake) == ops
    assert engine.state == EngineState.RUNNING
    on_gpu(fake, engine, 0)
    assert fake.process_bytes_on(0) == GiB
    assert not nvml._frozen.is_set()


def test_pause_whose_rollback_fails(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    engine = make_engine()
    fake.fail("cuCheckpointProcessCheckpoint", "CUDA_ERROR_UNKNOWN")
    fake.fail("cuCheckpointProcessUnlock", "CUDA_ERROR_UNKNOWN", nth=0)
    with pytest.raises(RollbackFailedError, match="ROLLBACK FAILED: the process is LOCKED"):
        engine.pause()
    assert engine.state == EngineState.FAILED
