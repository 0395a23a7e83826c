"""A fast migration's failures over the fake driver, each rolled back to the source with every
segment home and intact and nothing leaked, or, when the rollback cannot be, the job FAILED with
its copies still held by fd."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from flexium.engine import EngineState  # noqa: E402
from flexium.errors import (  # noqa: E402
    InvalidStateError,
    RollbackFailedError,
)
from support.engine import (  # noqa: E402,F401  (fixtures)
    H200_BYTES,
    MiB,
    checkpoint_ops,
    driver,
    fake,
    make_engine,
    nvml_in_parent,
    step_summary,
)
from support.fake_driver import ProcessState  # noqa: E402
from support.fast_path import (  # noqa: E402,F401  (fixtures)
    CUDA_ERROR_UNKNOWN,
    FAST_MIGRATION,
    Job,
    failure,
    job,
    open_fds,
    rolled_back,
)


@pytest.fixture(autouse=True)
def nothing_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """No staging kept between pauses: the keeper's host memory, whose fds it adds to this process in the
    background (memfds, or the pieces of driver-made memory), would change the open files these tests count."""
    monkeypatch.setenv("FLEXIUM_PINNED_HOST_MEMORY", "0")


# ----------------------------------------------------------------------------- failures, rolled back


@pytest.mark.parametrize("code", ["CUDA_ERROR_UNKNOWN", "CUDA_ERROR_OUT_OF_MEMORY"])
def test_a_failed_copy_moves_nothing(job: Job, code: str) -> None:
    engine = job.training([2 * MiB, 4 * MiB, 2 * MiB])
    fds = open_fds()
    job.fake.fail("cuMemcpyDtoDAsync", code, nth=2)
    error = failure(lambda: engine.migrate(engine.gpus[1]))
    result = rolled_back(job, engine, error, "copy", fds)
    assert step_summary(result) == [("prepare", True, False), ("checksum", True, False), ("copy", False, False)]
    assert result.error.startswith(f"phase 'copy' failed: DriverError: cuMemcpyDtoDAsync failed: {code}")
    assert result.error.endswith("; nothing moved: the job runs on cuda:0 as before")
    assert checkpoint_ops(job.fake) == []
    assert engine.migrate(engine.gpus[1]).ok  # nothing left behind blocks the next try
    job.assert_home(physical=1)


# The copy unmaps and releases each of its 3 temporary copies first. Unmap #5: the release fails
# at the 2nd segment, the 1st has lost its memory (its data now only in the copy on GPU 1).
# Release #4: the 1st segment is unmapped but keeps its handle.
@pytest.mark.parametrize("call,nth", [("cuMemUnmap", 5), ("cuMemRelease", 4)])
def test_a_failed_release_brings_the_released_segments_home(job: Job, call: str, nth: int) -> None:
    engine = job.training([2 * MiB, 4 * MiB, 2 * MiB])
    fds = open_fds()
    job.fake.fail(call, "CUDA_ERROR_UNKNOWN", nth=nth)
    error = failure(lambda: engine.migrate(engine.gpus[1]))
    result = rolled_back(job, engine, error, "release", fds)
    assert step_summary(result) == [
        ("prepare", True, False),
        ("checksum", True, False),
        ("copy", True, False),
        ("verify", True, False),
        ("release", False, False),
        ("rollback_copy", True, True),
    ]
    assert f"{call} failed: CUDA_ERROR_UNKNOWN" in result.error
    assert checkpoint_ops(job.fake) == []


def test_a_rollback_that_cannot_map_the_copies_fails_the_job(job: Job) -> None:
    fake = job.fake
    job.segments([2 * MiB, 4 * MiB])
    engine = job.engine(lock_timeout_ms=30)
    job.train()
    fds = open_fds()
    fake.set_lock_delay_ms(1000)
    fake.fail("cuMemImportFromShareableHandle", "CUDA_ERROR_UNKNOWN", nth=0)
    error = failure(lambda: engine.migrate(engine.gpus[1]), RollbackFailedError)
    result = error.result
    assert error.step == "lock" and engine.state == EngineState.FAILED
    assert step_summary(result)[-2:] == [("lock", False, False), ("rollback_copy", False, True)]
    rollback = "; ROLLBACK FAILED: phase 'rollback_copy' failed: DriverError: cuMemImportFromShareableHandle"
    assert rollback in result.error
    assert result.error.endswith("; restart the job")
    job.assert_copies_map_back(fds, physical=1)
    assert fake.placement() == [0, 1]


def test_a_lock_timeout_is_rolled_back(job: Job) -> None:
    job.segments([2 * MiB, 4 * MiB])
    engine = job.engine(lock_timeout_ms=30)
    job.train()
    fds = open_fds()
    job.fake.set_lock_delay_ms(1000)
    error = failure(lambda: engine.migrate(engine.gpus[1]))
    result = rolled_back(job, engine, error, "lock", fds)
    assert step_summary(result) == [
        ("prepare", True, False),
        ("checksum", True, False),
        ("copy", True, False),
        ("verify", True, False),
        ("release", True, False),
        ("lock", False, False),
        ("rollback_copy", True, True),
    ]
    assert "cuCheckpointProcessLock returned CUDA_ERROR_TIMEOUT" in result.error
    assert "the process stayed busy in CUDA work past the lock timeout; try again" in result.error


def fail_checkpoint(job: Job, engine: Any) -> None:
    job.fake.fail("cuCheckpointProcessCheckpoint", "CUDA_ERROR_UNKNOWN")


def fail_restore(job: Job, engine: Any) -> None:
    job.fake.fail("cuCheckpointProcessRestore", "CUDA_ERROR_INVALID_VALUE")  # refused for its arguments: restorable


def fill_target_meanwhile(job: Job, engine: Any) -> None:
    """Another process takes GPU 1's memory once the migration has started: the copies (held
    by their fds on GPU 1) still fit, the rest of the process does not."""
    done: list[bool] = []

    def taken(state: EngineState) -> None:
        if state == EngineState.MIGRATING and not done:
            done.append(True)
            job.fake.set_other_memory(1, H200_BYTES - job.total - 2 * MiB)

    engine.add_state_listener(taken)


LOCKED_FAILURES = {
    "checkpoint": (
        fail_checkpoint,
        "cuCheckpointProcessCheckpoint returned CUDA_ERROR_UNKNOWN",
        [("checkpoint", False, False), ("unlock", True, True)],
    ),
    "restore": (
        fail_restore,
        "cuCheckpointProcessRestore returned CUDA_ERROR_INVALID_VALUE",
        [("checkpoint", True, False), ("restore", False, False), ("restore", True, True), ("unlock", True, True)],
    ),
}


@pytest.mark.parametrize("case", LOCKED_FAILURES)
def test_a_failure_in_the_locked_section_recovers_and_brings_the_segments_home(job: Job, case: str) -> None:
    arm, message, summary = LOCKED_FAILURES[case]
    job.segments([2 * MiB, 4 * MiB, 6 * MiB])
    job.fake.set_process_memory(0, 8 * MiB)
    engine = job.engine()
    job.train()
    fds = open_fds()
    arm(job, engine)
    error = failure(lambda: engine.migrate(engine.gpus[1]))
    step = "checkpoint" if case == "checkpoint" else "restore"
    result = rolled_back(job, engine, error, step, fds)
    assert step_summary(result) == [
        ("prepare", True, False),
        ("checksum", True, False),
        ("copy", True, False),
        ("verify", True, False),
        ("release", True, False),
        ("lock", True, False),
        *summary,
        ("rollback_copy", True, True),
    ]
    assert message in result.error
    assert job.fake.process_bytes_on(0) == 8 * MiB + job.total and job.fake.process_bytes_on(1) == 0
    job.fake.set_other_memory(1, 0)
    assert engine.migrate(engine.gpus[1]).ok
    job.assert_home(physical=1)


def test_a_target_filled_during_a_fast_move_loses_the_job_and_says_so(job: Job) -> None:
    """The copies still fit on GPU 1, the rest of the process does not: its restore fails for memory,
    after which the driver refuses every restore (fact `restore-without-room-loses-process`), the rollback's too."""
    job.segments([2 * MiB, 4 * MiB, 6 * MiB])
    job.fake.set_process_memory(0, 8 * MiB)
    engine = job.engine()
    job.train()
    fill_target_meanwhile(job, engine)
    error = failure(lambda: engine.migrate(engine.gpus[1]), RollbackFailedError)
    assert error.step == "restore" and "cuCheckpointProcessRestore returned CUDA_ERROR_OUT_OF_MEMORY" in str(error)
    assert "(fact `restore-without-room-loses-process` in docs/facts.md), so it can never run CUDA again" in str(error)
    assert engine.state == EngineState.FAILED and job.fake.state() == ProcessState.CHECKPOINTED


def test_a_map_failure_after_the_restore_is_retried(job: Job) -> None:
    fake = job.fake
    engine = job.training([2 * MiB, 4 * MiB, 2 * MiB])
    fds = open_fds()
    # Imports happen only when mapping back: the 2nd segment's fails once, the 1st is mapped by then.
    fake.fail("cuMemImportFromShareableHandle", "CUDA_ERROR_UNKNOWN", nth=2)
    result = engine.migrate(engine.gpus[1])
    assert result.ok and result.path == "fast" and result.error is None
    assert step_summary(result) == [(s, True, False) for s in FAST_MIGRATION[:-1]] + [
        ("map", False, False),
        ("map", True, False),
    ]
    assert "cuMemImportFromShareableHandle failed: CUDA_ERROR_UNKNOWN" in (result.steps[-2].error or "")
    assert fake.placement() == [1, 0] and engine.state == EngineState.RUNNING
    job.assert_home(physical=1)
    assert open_fds() == fds


def test_a_map_failure_that_persists_fails_the_job(job: Job) -> None:
    fake = job.fake
    engine = job.training([2 * MiB, 4 * MiB])
    fds = open_fds()
    fake.fail("cuMemImportFromShareableHandle", "CUDA_ERROR_UNKNOWN", nth=0)
    error = failure(lambda: engine.migrate(engine.gpus[1]), RollbackFailedError)
    result = error.result
    assert error.step == "map" and result.failed_step == "map" and not result.ok
    assert [s[:2] for s in step_summary(result)][-2:] == [("map", False), ("map", False)]
    assert result.error.endswith(
        "ROLLBACK FAILED: the job runs on cuda:1 but part of its memory is not mapped back; restart the job"
    )
    assert engine.state == EngineState.FAILED
    assert failure(lambda: engine.migrate(engine.gpus[0]), InvalidStateError).args[0].endswith("restart the job")
    job.assert_copies_map_back(fds, physical=1)
