"""A migration on the fast path over the fake driver: the memory pool's segments moved by the
engine itself at a safe point (flexium.engine.fast.path, transactions/fast_migrate.py), only their
live ranges copied; memory moved in by fds kept out of a driver checkpoint until it is the job's
own."""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from flexium import _C  # noqa: E402
from flexium.engine import EngineState  # noqa: E402
from flexium.engine.operations import GpuIdentity  # noqa: E402
from flexium.errors import (  # noqa: E402
    OperationFailedError,
)
from support.engine import (  # noqa: E402,F401  (fixtures)
    PID,
    GiB,
    MiB,
    checkpoint_ops,
    driver,
    fake,
    make_engine,
    nvml_in_parent,
    step_summary,
    wait_until,
)
from support.fake_driver import ProcessState  # noqa: E402
from support.fast_path import (  # noqa: E402,F401  (fixtures)
    FAST_MIGRATION,
    OWNING_NOTE,
    Job,
    failure,
    job,
    locking_threads,
    names,
    open_fds,
    rolled_back,
)

# ----------------------------------------------------------------------------- migrate


def test_fast_migration_there_and_back(job: Job) -> None:
    fake = job.fake
    job.segments([2 * MiB, 4 * MiB, 6 * MiB])
    fake.set_process_memory(0, GiB)  # the rest of the process (context...), carried by the checkpoint
    engine = job.engine()
    trainer = job.train()
    fds = open_fds()
    fake.clear_log()

    result = engine.migrate(engine.gpus[1])

    assert result.ok and result.path == "fast" and result.failed_step is None
    assert step_summary(result) == [(s, True, False) for s in FAST_MIGRATION]
    assert result.notes == ("fast path: copied 0.01 GiB in use of 0.01 GiB in 3 pool segments", OWNING_NOTE)
    assert job.fast is not None and job.fast.staged[0].copied_bytes == job.total
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint", "Restore", "Unlock"]
    # The copies, mapped, become the job's own at the next optimizer steps, outside the downtime.
    wait_until(lambda: _C.vmm_imported_count() == 0, what="the moved memory to become the job's own")
    assert job.pool.asked[:2] == [0, 0]  # the copy and the own slices copy live ranges only
    assert locking_threads(fake) == {trainer.tid}  # at the end of an optimizer step
    assert fake.blocked_calls() == 0 and fake.deadlocks() == 0
    assert engine.state == EngineState.RUNNING and fake.state() == ProcessState.RUNNING
    assert fake.placement() == [1, 0] and engine.placement()[1].device == "cuda:1"
    job.assert_home(physical=1)  # registry: still logical device 0; memory: GPU 1
    assert fake.process_bytes_on(1) == GiB + job.total and fake.process_bytes_on(0) == 0
    assert open_fds() == fds  # every staged fd was closed when its copy was mapped

    back = engine.migrate(engine.gpus[0])
    assert back.ok and back.path == "fast" and names(back) == FAST_MIGRATION
    assert fake.placement() == [0, 1] and engine.placement()[1].device == "cuda:0"
    job.assert_home(physical=0)
    assert open_fds() == fds
    wait_until(lambda: _C.vmm_imported_count() == 0, what="the moved memory to become the job's own")

    # Nothing imported is left for a driver checkpoint to trip over.
    driver = engine.migrate(engine.gpus[1], path="driver")
    assert driver.ok and driver.path == "driver" and fake.placement() == [1, 0]
    assert names(driver) == ["prepare", "lock", "checkpoint", "room", "restore", "unlock"]
    job.assert_home(physical=1)


def fast_move_left_imported(engine: Any, job: Job, target: GpuIdentity) -> None:
    """A fast move whose first own slice fails (no memory for the job's own copies): the move
    stands and the job goes on running on the imported copies."""
    # The copy makes one allocation per segment, then the first own slice's first one fails.
    job.fake.fail("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", nth=len(_C.vmm_segments()) + 1)
    result = engine.migrate(target)
    assert result.ok and result.path == "fast" and result.notes[-1] == OWNING_NOTE
    wait_until(lambda: job.fake.pending_failures() == 0, what="the first own slice")
    assert _C.vmm_imported_count() == len(_C.vmm_segments())


def test_imported_memory_keeps_a_driver_checkpoint_out_until_it_is_our_own(job: Job) -> None:
    fake = job.fake
    job.segments([2 * MiB, 4 * MiB])
    engine = job.engine(safe_point_wait_seconds=0.3)
    trainer = job.train()
    fast_move_left_imported(engine, job, engine.gpus[1])

    # No optimizer step: the driver path would have to carry imported memory; refused untouched.
    trainer.stopping.set()
    trainer.join(5)
    fake.clear_log()
    with pytest.raises(OperationFailedError, match=r"no optimizer step \(safe point\) came within 0.3 s") as refused:
        engine.migrate(engine.gpus[0])
    assert refused.value.step == "validate" and checkpoint_ops(fake) == []
    assert engine.state == EngineState.RUNNING and _C.vmm_imported_count() == 2
    job.assert_home(physical=1)

    # At a safe point, making it our own fails (no memory left): still refused untouched.
    job.train()
    fake.fail("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", nth=1)
    with pytest.raises(OperationFailedError, match="failed at phase 'own' before anything was locked") as failed:
        engine.migrate(engine.gpus[0], path="driver")
    assert failed.value.step == "own" and checkpoint_ops(fake) == []
    assert engine.state == EngineState.RUNNING
    job.assert_home(physical=1)

    # The fast path needs no own memory: it moves the imported segments like any other.
    back = engine.migrate(engine.gpus[0])
    assert back.ok and back.path == "fast" and fake.placement() == [0, 1]
    job.assert_home(physical=0)


def test_on_the_training_thread_the_driver_path_makes_the_memory_its_own_first(job: Job) -> None:
    """recoverable() moves the job from the training thread, outside an optimizer step: nothing else
    launches work meanwhile, so imported memory can be made the job's own there too."""
    fake = job.fake
    job.segments([2 * MiB, 4 * MiB])
    engine = job.engine()
    trainer = job.train()
    fast_move_left_imported(engine, job, engine.gpus[1])
    trainer.stopping.set()
    trainer.join(5)

    outcome: dict[str, Any] = {}

    def training_thread() -> None:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()  # this thread is now the training thread
        try:
            outcome["result"] = engine.migrate(engine.gpus[0])
        except Exception as exc:  # reported to the test
            outcome["error"] = exc

    thread = threading.Thread(target=training_thread)
    thread.start()
    thread.join(30)
    assert "error" not in outcome, outcome
    result = outcome["result"]
    assert result.ok and result.path == "driver" and names(result)[:2] == ["own", "prepare"]
    assert result.notes == ("driver path: called on the training thread outside an optimizer step",)
    assert _C.vmm_imported_count() == 0 and fake.placement() == [0, 1]
    job.assert_home(physical=0)


def test_the_fake_driver_cannot_restore_imported_memory_either(job: Job) -> None:
    """What the H200s showed (docs/fast-path.md), kept by the fake so the engine's guard is tested."""
    fake = job.fake
    engine = job.training([2 * MiB])
    fast_move_left_imported(engine, job, engine.gpus[1])
    outcomes = _C.run_steps(
        PID,
        [_C.Step(_C.StepKind.LOCK, timeout_ms=1000), _C.Step(_C.StepKind.CHECKPOINT), _C.Step(_C.StepKind.RESTORE)],
        [[], [], [_C.Step(_C.StepKind.RECOVER)]],
    )
    assert [(o.step, o.rollback, o.error_name) for o in outcomes] == [
        ("lock", False, ""),
        ("checkpoint", False, ""),
        ("restore", False, "CUDA_ERROR_NOT_SUPPORTED"),
        ("restore", True, "CUDA_ERROR_NOT_SUPPORTED"),
        ("unlock", True, "CUDA_ERROR_ILLEGAL_STATE"),
    ]
    assert fake.state() == ProcessState.CHECKPOINTED  # stuck, as on the real driver
    fake.reset()  # the fixture's cleanup needs a running process


def test_only_the_live_ranges_are_copied(job: Job) -> None:
    partial, whole, idle = job.segments([64 * MiB, 2 * MiB, 4 * MiB])
    live = [(0, 16 * MiB), (40 * MiB, 8 * MiB + 4096)]
    engine = job.engine(ranges={partial: live, idle: []})
    job.train()

    result = engine.migrate(engine.gpus[1])

    assert result.ok and result.path == "fast"
    copied = 24 * MiB + 4096 + 2 * MiB  # the live ranges, the unlisted segment whole, nothing of idle
    assert job.fast is not None and job.fast.staged[0].copied_bytes == copied
    assert result.notes == (
        f"fast path: copied {copied / GiB:.2f} GiB in use of {job.total / GiB:.2f} GiB in 3 pool segments",
        OWNING_NOTE,
    )
    wait_until(lambda: _C.vmm_imported_count() == 0, what="the moved memory to become the job's own")
    assert ctypes.string_at(whole, 2 * MiB) == job.contents[whole]
    data = job.contents[partial]
    for offset, length in live:
        assert ctypes.string_at(partial + offset, length) == data[offset : offset + length]
    # Fresh memory of the fake is zeroed: what lay outside the live ranges did not come along.
    assert ctypes.string_at(partial + 16 * MiB, 24 * MiB) == bytes(24 * MiB)
    assert ctypes.string_at(partial + 48 * MiB + 4096, 16 * MiB - 4096) == bytes(16 * MiB - 4096)
    assert ctypes.string_at(idle, 4 * MiB) == bytes(4 * MiB)
    assert job.fake.vmm_bytes_on(1) == job.total and job.fake.vmm_bytes_on(0) == 0


def test_a_live_range_outside_its_segment_fails_the_copy(job: Job) -> None:
    first, second = job.segments([2 * MiB, 2 * MiB])
    engine = job.engine(ranges={second: [(MiB, 2 * MiB)]})
    job.train()
    fds = open_fds()
    error = failure(lambda: engine.migrate(engine.gpus[1]))
    result = rolled_back(job, engine, error, "copy", fds)
    assert result.error == (
        f"phase 'copy' failed: ValueError: live range ({MiB}, {2 * MiB}) lies outside segment {second:#x} "
        f"({2 * MiB} bytes, device 0); nothing moved: the job runs on cuda:0 as before"
    )
    assert checkpoint_ops(job.fake) == []
