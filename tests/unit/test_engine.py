"""The engine's state machine and every failure path: flexium.engine.Engine over the fake driver
(tests/fake_driver), in this process. Each operation is checked through what the fake saw (the
checkpoint calls, the pairs, where each logical device is, what NVML reports) and what the engine
says (state, placement, result, error). Subprocess variants (other GPU counts, other drivers) are
in test_capabilities.py; operations at optimizer safe points in test_engine_safe_points.py."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import Any, Callable

import pytest

from engine_fixtures import (  # noqa: F401  (fixtures)
    H200_BYTES,
    MARGIN,
    PID,
    Background,
    ChildReads,
    GiB,
    HostMemory,
    MiB,
    checkpoint_ops,
    driver,
    fake,
    host_memory,
    make_engine,
    nvml_in_parent,
    reader_in_parent,
    step_summary,
    wait_until,
)
from fake_driver import FakeDriver, ProcessState
from flexium import _C
from flexium.engine import EngineState, OperationKind, nvml
from flexium.engine import engine as engine_module
from flexium.errors import (
    CapabilityError,
    FlexiumError,
    InvalidStateError,
    OperationFailedError,
    OperationInProgressError,
    RollbackFailedError,
    TargetRefusedError,
)

pytestmark = pytest.mark.usefixtures("nvml_in_parent")

# The room check before the restore asks the NVML reader (csrc/room_check.h).
MIGRATION_STEPS = [
    ("prepare", True, False),
    ("lock", True, False),
    ("checkpoint", True, False),
    ("room", True, False),
    ("restore", True, False),
    ("unlock", True, False),
]


def on_gpu(fake: FakeDriver, engine: Any, physical: int) -> None:
    """The engine and the driver agree that the job (its logical device) is on `physical`."""
    logical_device, where = engine.placement()
    assert where.uuid == fake.uuid(physical)
    assert where.device == f"cuda:{physical}"
    assert fake.physical_of(int(logical_device.split(":")[1])) == physical
    assert fake.state() == ProcessState.RUNNING


def assert_untouched(fake: FakeDriver, engine: Any, physical: int = 0) -> None:
    """Refused before anything was touched: no CUDA call at all, state and placement as before."""
    assert fake.calls("cu") == []
    assert engine.state == EngineState.RUNNING
    on_gpu(fake, engine, physical)


# ----------------------------------------------------------------------------- construction


def test_a_new_engine_runs_on_its_device(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    engine = make_engine(1)
    assert engine.state == EngineState.RUNNING
    assert engine.logical_device == "cuda:1"
    assert [g.uuid for g in engine.gpus] == fake.uuids()
    assert [g.nvml_index for g in engine.gpus] == [0, 1]
    assert [g.name for g in engine.gpus] == ["NVIDIA H200"] * 2
    assert engine.gpus[0].total_memory == H200_BYTES
    on_gpu(fake, engine, 1)
    assert not engine.is_busy()
    assert engine.last_result is None
    assert engine.capabilities.migration and engine.capabilities.pause_resume


def test_a_device_outside_the_visible_gpus_is_refused(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    with pytest.raises(ValueError, match=r"cuda:2 is not among the 2 visible GPU\(s\)"):
        make_engine(2)


# ----------------------------------------------------------------------------- migrate: success


def test_migrate_moves_the_job_and_reports_it(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, 3 * GiB)
    fake.set_other_memory(1, 10 * GiB)
    engine = make_engine()
    seen: list[EngineState] = []
    engine.add_state_listener(seen.append)
    fake.set_delay_ms("cuCheckpointProcessCheckpoint", 30)
    fake.set_delay_ms("cuCheckpointProcessRestore", 20)

    result = engine.migrate(engine.gpus[1])

    assert result.ok and result.error is None and result.failed_step is None
    assert result.kind == OperationKind.MIGRATE and result.path == "driver"
    assert result.logical_device == "cuda:0"
    assert result.source.uuid == fake.uuid(0) and result.target.uuid == fake.uuid(1)
    on_gpu(fake, engine, 1)
    assert engine.state == EngineState.RUNNING
    assert seen == [EngineState.MIGRATING, EngineState.RUNNING]
    # The driver saw one transaction with every GPU paired (docs/facts.md fact 2).
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint", "Restore", "Unlock"]
    assert fake.last_pairs() == [(0, 1), (1, 0)]
    assert fake.blocked_calls() == 0 and fake.deadlocks() == 0  # docs/facts.md fact 4: no other CUDA call while locked
    # Bytes from NVML; zero residue on the source (docs/facts.md fact 6).
    assert result.bytes_moved == 3 * GiB
    assert fake.process_bytes_on(1) == 3 * GiB and fake.process_bytes_on(0) == 0
    assert fake.used_bytes(0) == 0 and fake.used_bytes(1) == 13 * GiB
    # Per-step timings: prepare, lock, checkpoint, restore, unlock, each measured.
    assert step_summary(result) == MIGRATION_STEPS
    assert result.step_seconds("checkpoint") >= 0.03
    assert result.step_seconds("restore") >= 0.02
    assert all(s.seconds >= 0 and s.error is None for s in result.steps)
    assert result.seconds >= result.step_seconds("checkpoint") + result.step_seconds("restore")
    assert result.gb_per_second == pytest.approx(3 * GiB / 1e9 / result.seconds)
    assert engine.last_result is result
    # The process still sees its old identity (docs/facts.md fact 5); the engine knows better.
    assert [d.uuid for d in _C.list_devices()] == fake.uuids()
    assert nvml.gpu_by_uuid(fake.uuid(1)).used_by(PID) == 3 * GiB


def test_the_result_is_json_friendly(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, GiB)
    result = make_engine().migrate(fake.uuid(1))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["kind"] == "migrate" and data["ok"] is True
    assert data["source"]["uuid"] == fake.uuid(0) and data["target"]["uuid"] == fake.uuid(1)
    assert [s["step"] for s in data["steps"]] == ["prepare", "lock", "checkpoint", "room", "restore", "unlock"]
    assert data["bytes_moved"] == GiB


def test_every_visible_gpu_is_paired_on_a_four_gpu_machine(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_GPUS", "4")
    fake.reset()
    fake.set_process_memory(0, 2 * GiB)
    fake.set_process_memory(3, 1 * GiB)  # another device of this process, untouched by the swap
    engine = make_engine()
    result = engine.migrate(engine.gpus[2])
    assert result.ok
    assert fake.last_pairs() == [(0, 2), (1, 1), (2, 0), (3, 3)]
    assert fake.placement() == [2, 1, 0, 3]
    on_gpu(fake, engine, 2)
    assert result.bytes_moved == 3 * GiB  # the checkpoint moves all of the process's memory


def test_a_process_on_two_gpus_moves_gpu_by_gpu(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process on cuda:0 and cuda:1 (DataParallel, a split model) moved to GPUs 2 and 3: moves
    name where each of its GPUs goes, and the restore's map covers every visible GPU."""
    monkeypatch.setenv("FAKE_CUDA_GPUS", "4")
    fake.reset()
    fake.set_process_memory(0, 2 * GiB)
    fake.set_process_memory(1, 1 * GiB)
    engine = make_engine()
    result = engine.migrate(moves={fake.uuid(0): fake.uuid(2), fake.uuid(1): engine.gpus[3]})
    assert result.ok and result.path == "driver"
    assert fake.last_pairs() == [(0, 2), (1, 3), (2, 0), (3, 1)]
    assert fake.placement() == [2, 3, 0, 1]
    on_gpu(fake, engine, 2)  # the job's device, which the result names
    assert result.source.uuid == fake.uuid(0) and result.target.uuid == fake.uuid(2)
    assert result.notes[-1] == "moved GPU by GPU: cuda:0 -> cuda:2, cuda:1 -> cuda:3"
    assert fake.process_bytes_on(2) == 2 * GiB and fake.process_bytes_on(3) == GiB
    assert fake.process_bytes_on(0) == fake.process_bytes_on(1) == 0

    # Now on GPUs 2 and 3, the moves name them as they are now: cuda:1's memory (on GPU 3) goes
    # back to GPU 1, the job's device stays on GPU 2.
    back = engine.migrate(moves={fake.uuid(3): fake.uuid(1)})
    assert back.ok and fake.placement() == [2, 1, 0, 3]
    assert back.source.uuid == back.target.uuid == fake.uuid(2)
    assert fake.process_bytes_on(2) == 2 * GiB and fake.process_bytes_on(1) == GiB


def test_moves_that_cannot_be_carried_out_are_refused_before_anything_is_touched(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_GPUS", "4")
    fake.reset()
    fake.set_process_memory(0, 2 * GiB)
    fake.set_process_memory(1, 1 * GiB)
    engine = make_engine()
    fake.clear_log()
    cases = {
        "holds nothing of this process: moves name the GPUs it uses": {fake.uuid(2): fake.uuid(3)},
        "two devices of the process cannot both go to cuda:2": {fake.uuid(0): fake.uuid(2), fake.uuid(1): fake.uuid(2)},
        "the job is already on cuda:1": {fake.uuid(1): fake.uuid(1)},
        "moves names no GPU": {},
        "not a GPU UUID": {"cuda:0": fake.uuid(2)},
        "migrate takes a target GPU, or moves": None,
    }
    for message, moves in cases.items():
        with pytest.raises(TargetRefusedError, match=re.escape(message)):
            if moves is None:
                engine.migrate(fake.uuid(2), moves={fake.uuid(0): fake.uuid(2)})
            else:
                engine.migrate(moves=moves)
    fake.set_other_memory(3, H200_BYTES - GiB // 2)
    with pytest.raises(TargetRefusedError, match=r"^cuda:3 \(.*\) has 0\.50 GiB free; the job needs 1\.00 GiB"):
        engine.migrate(moves={fake.uuid(0): fake.uuid(2), fake.uuid(1): fake.uuid(3)})
    assert_untouched(fake, engine)
    assert fake.placement() == [0, 1, 2, 3]


def test_repeated_migrations_keep_the_identity_right(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_GPUS", "3")
    fake.reset()
    fake.set_process_memory(0, 4 * GiB)
    engine = make_engine()
    expected = [
        # target, pairs as physical (old, new) relative to where the contexts are now, placement
        (fake.uuid(1), [(0, 1), (1, 0), (2, 2)], [1, 0, 2]),
        (engine.gpus[0], [(1, 0), (0, 1), (2, 2)], [0, 1, 2]),
        (fake.uuid(2), [(0, 2), (1, 1), (2, 0)], [2, 1, 0]),
        (fake.uuid(1), [(2, 1), (1, 2), (0, 0)], [1, 2, 0]),
    ]
    where = 0
    for target, pairs, placement in expected:
        result = engine.migrate(target)
        assert result.ok
        assert result.source.uuid == fake.uuid(where) and result.target.uuid == fake.uuid(placement[0])
        assert sorted(fake.last_pairs()) == sorted(pairs), target
        assert fake.placement() == placement, target
        on_gpu(fake, engine, placement[0])
        assert fake.process_bytes_on(placement[0]) == 4 * GiB and fake.process_bytes_on(where) == 0
        assert result.bytes_moved == 4 * GiB
        where = placement[0]
    # The driver still reports the identities of init (docs/facts.md fact 5).
    assert [d.uuid for d in _C.list_devices()] == fake.uuids()


def test_a_job_on_cuda_1_migrates_to_cuda_0(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(1, 2 * GiB)
    engine = make_engine(1)
    result = engine.migrate(engine.gpus[0])
    assert result.ok and result.logical_device == "cuda:1"
    on_gpu(fake, engine, 0)
    assert fake.process_bytes_on(0) == 2 * GiB and fake.process_bytes_on(1) == 0


def test_a_transaction_runs_over_its_context_and_plan_alone(fake: FakeDriver) -> None:
    """No Engine is needed to run a transaction: an OperationContext and a MovePlan are all a
    driver migration takes, and it reports through the context's state and identity map."""
    from flexium.engine import snapshot_gpus
    from flexium.engine.identity import IdentityMap
    from flexium.engine.safe_point import SafePoints
    from flexium.engine.transactions.context import OperationContext
    from flexium.engine.transactions.driver_migrate import migrate_by_driver

    fake.set_process_memory(0, 2 * GiB)
    identity = IdentityMap(snapshot_gpus())
    ctx = OperationContext(
        pid=PID, logical=0, identity=identity, safe_points=SafePoints(0.1), fast=None, lock_timeout_ms=5000
    )
    seen: list[EngineState] = []
    ctx.add_state_listener(seen.append)
    fake.clear_log()
    result = migrate_by_driver(ctx, identity.plan({0: identity.gpus[1]}), ("a note",), at_safe_point=False, headroom=0)
    assert result.ok and result.path == "driver" and result.notes == ("a note",)
    assert result.source == identity.gpus[0] and result.target == identity.gpus[1]
    # No engine started an NVML reader: no room check before the restore.
    assert [(s.step, s.ok) for s in result.steps] == [(step, ok) for step, ok, _ in MIGRATION_STEPS if step != "room"]
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint", "Restore", "Unlock"] and fake.placement() == [1, 0]
    assert identity.physical_of(0) == identity.gpus[1] and result.bytes_moved == 2 * GiB
    assert seen == [EngineState.MIGRATING, EngineState.RUNNING] and ctx.state == EngineState.RUNNING


# ----------------------------------------------------------------------------- target validation


def refused(engine: Any, target: Any) -> str:
    with pytest.raises(TargetRefusedError) as caught:
        engine.migrate(target)
    assert isinstance(caught.value, FlexiumError) and isinstance(caught.value, ValueError)
    return str(caught.value)


@pytest.mark.parametrize("target", ["cuda:1", "1", "gpu1"])
def test_a_device_name_is_refused_before_anything_is_touched(
    target: str, fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    """The server resolves device names to a UUID; the engine takes a UUID or a GpuIdentity."""
    engine = make_engine()
    assert refused(engine, target) == (
        f"target '{target}' is not a GPU UUID: the engine takes a UUID ('GPU-...', as nvidia-smi -L prints it) "
        "or a GpuIdentity; names such as 'cuda:N' or an nvidia-smi index are resolved by the server"
    )
    assert_untouched(fake, engine)
    assert engine.last_result is None


def test_uuid_not_on_this_host_is_refused(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    engine = make_engine()
    assert refused(engine, "GPU-00000000-1111-2222-3333-444444444444") == (
        "no GPU with UUID GPU-00000000-1111-2222-3333-444444444444 on this host"
    )
    assert_untouched(fake, engine)


def test_the_current_gpu_is_refused(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, GiB)
    engine = make_engine()
    assert refused(engine, engine.gpus[0]) == f"the job is already on cuda:0 ({fake.uuid(0)})"
    assert_untouched(fake, engine)
    assert engine.migrate(engine.gpus[1]).ok
    fake.clear_log()
    # After the move the job is on the GPU that was cuda:1 at init.
    assert refused(engine, fake.uuid(1)) == f"the job is already on cuda:1 ({fake.uuid(1)})"
    assert_untouched(fake, engine, physical=1)


def test_another_gpu_model_is_refused(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_MODELS", "NVIDIA H200,NVIDIA H100 80GB HBM3")
    fake.reset()
    engine = make_engine()
    assert refused(engine, engine.gpus[1]) == (
        "cuda:1 is a NVIDIA H100 80GB HBM3, the job runs on a NVIDIA H200: migration needs the same GPU model"
    )
    assert_untouched(fake, engine)
    assert engine.candidate_targets() == []


def test_a_target_without_room_is_refused(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, 20 * GiB)
    fake.set_other_memory(1, H200_BYTES - 15 * GiB)
    engine = make_engine()
    message = refused(engine, engine.gpus[1])
    assert re.fullmatch(
        r"cuda:1 \(NVIDIA H200, nvidia-smi index 1\) has 15\.00 GiB free; the job needs 20\.00 GiB plus 0\.50 GiB "
        r"headroom: free memory there or choose another GPU",
        message,
    ), message
    assert_untouched(fake, engine)


def test_room_for_the_job_plus_headroom_is_the_limit(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, 20 * GiB)
    fake.set_other_memory(1, H200_BYTES - 20 * GiB - MARGIN + 1)  # one byte short
    engine = make_engine()
    assert "the job needs 20.00 GiB plus 0.50 GiB headroom" in refused(engine, engine.gpus[1])
    assert_untouched(fake, engine)
    fake.set_other_memory(1, H200_BYTES - 20 * GiB - MARGIN)  # exactly enough
    assert engine.migrate(engine.gpus[1]).ok
    on_gpu(fake, engine, 1)


def test_our_own_memory_on_the_target_counts_as_room(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    """In the swap, what this process holds on the target moves to the source."""
    fake.set_process_memory(0, 30 * GiB)
    fake.set_process_memory(1, 30 * GiB)
    fake.set_other_memory(1, H200_BYTES - 31 * GiB)  # 1 GiB free, but 30 GiB of it are ours
    engine = make_engine()
    assert engine.migrate(engine.gpus[1]).ok
    assert fake.placement() == [1, 0]


def test_the_headroom_is_configurable(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, 10 * GiB)
    fake.set_other_memory(1, H200_BYTES - 12 * GiB)
    engine = make_engine(memory_margin_bytes=3 * GiB)
    assert "plus 3.00 GiB headroom" in refused(engine, engine.gpus[1])
    assert_untouched(fake, engine)


def test_candidate_targets_most_free_memory_first(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_GPUS", "4")
    fake.reset()
    fake.set_process_memory(0, 10 * GiB)
    fake.set_other_memory(1, 100 * GiB)
    fake.set_other_memory(2, 20 * GiB)
    fake.set_other_memory(3, H200_BYTES - 10 * GiB)  # no room
    engine = make_engine()
    candidates = engine.candidate_targets()
    assert [c.gpu.device for c in candidates] == ["cuda:2", "cuda:1"]
    assert [c.free_bytes for c in candidates] == [H200_BYTES - 20 * GiB, H200_BYTES - 100 * GiB]


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
    assert "step 'checkpoint' failed: cuCheckpointProcessCheckpoint returned CUDA_ERROR_UNKNOWN" in str(err)
    assert f"rolled back: the job runs on cuda:0 ({fake.uuid(0)}) as before" in str(err)
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint", "Unlock"]
    assert step_summary(err.result)[-1] == ("unlock", True, True)
    assert engine.state == EngineState.RUNNING
    on_gpu(fake, engine, 0)
    assert fake.process_bytes_on(0) == GiB


def test_failed_remapped_restore_is_recovered_in_place(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    """docs/facts.md fact 3: the failed restore leaves the process CHECKPOINTED; the engine's recover step
    restores it in place (no pairs) and unlocks."""
    fake.set_process_memory(0, 5 * GiB)
    engine = make_engine()
    fake.fail("cuCheckpointProcessRestore", "CUDA_ERROR_INVALID_VALUE")
    with pytest.raises(OperationFailedError) as caught:
        engine.migrate(engine.gpus[1])
    err = caught.value
    assert not isinstance(err, RollbackFailedError)
    assert err.step == "restore"
    assert "step 'restore' failed: cuCheckpointProcessRestore returned CUDA_ERROR_INVALID_VALUE" in str(err)
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
    "restore failed the driver refuses every later one (docs/facts.md fact 28), so it can never run CUDA again; end "
    "the job and start it again from its last checkpoint"
)


def test_a_target_filled_while_the_job_is_checkpointed_is_caught_before_the_restore(
    fake: FakeDriver, make_engine: Callable[..., Any], reader_in_parent: list[str]
) -> None:
    """Another job takes the target's memory after the target check: the room check inside the locked
    section (the NVML reader asked over its pipes, csrc/room_check.h) sees it before the restore is
    tried, and the job is restored where it was. A restore without room would have lost it
    (docs/facts.md fact 28)."""
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
        f"migrate failed: step 'room' failed: {gpu1} has 10240 MiB free, the restore needs {40 * 1024 + 512} MiB: "
        "another process took memory there while the job was checkpointed, so the restore was not tried (it "
        f"would have lost the job, docs/facts.md fact 28); rolled back: the job runs on cuda:0 ({engine.gpus[0].uuid}) "
        "as before"
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
    """The target fills between the last room check and the restore (here: the NVML reader, a child
    process with a fake of its own, sees room that this process's fake does not): the restore fails
    for memory, and the in-place restore that would roll back is refused for good, as on driver 580
    (docs/facts.md fact 28, which the fake models). The error says the job is lost and what to do."""
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
    with pytest.raises(OperationFailedError, match="at step 'prepare'"):
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


# ----------------------------------------------------------------------------- pause and resume


def test_pause_frees_every_gpu_and_resume_in_place(
    fake: FakeDriver, make_engine: Callable[..., Any], nvml_in_parent: ChildReads
) -> None:
    fake.set_process_memory(0, 6 * GiB)
    engine = make_engine()
    seen: list[EngineState] = []
    engine.add_state_listener(seen.append)

    paused = engine.pause()
    assert paused.ok and paused.kind == OperationKind.PAUSE and paused.target is None
    assert step_summary(paused) == [("prepare", True, False), ("lock", True, False), ("checkpoint", True, False)]
    assert paused.bytes_moved == 6 * GiB
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED
    assert fake.used_bytes(0) == 0 and fake.used_bytes(1) == 0  # docs/facts.md fact 6: nothing left anywhere
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint"]
    # While frozen the job holds nothing anywhere: answered without any NVML query (or torch call).
    assert nvml._frozen.is_set()
    reads_before = nvml_in_parent.count
    assert engine.process_bytes() == 0
    assert nvml_in_parent.count == reads_before
    assert engine.footprint_bytes() == 6 * GiB

    fake.clear_log()
    resumed = engine.resume()
    assert resumed.ok and resumed.kind == OperationKind.RESUME
    assert resumed.target.uuid == resumed.source.uuid == fake.uuid(0)
    assert step_summary(resumed) == [("restore", True, False), ("unlock", True, False)]
    assert resumed.bytes_moved == 6 * GiB
    assert checkpoint_ops(fake) == ["Restore", "Unlock"] and fake.last_pairs_count() == 0
    assert engine.state == EngineState.RUNNING
    on_gpu(fake, engine, 0)
    assert fake.process_bytes_on(0) == 6 * GiB
    assert not nvml._frozen.is_set()
    assert seen == [EngineState.PAUSING, EngineState.PAUSED, EngineState.RESUMING, EngineState.RUNNING]


def test_resume_on_another_gpu(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, 6 * GiB)
    engine = make_engine()
    engine.pause()
    fake.clear_log()
    result = engine.resume(engine.gpus[1])
    assert result.ok and result.target.device == "cuda:1"
    assert fake.last_pairs() == [(0, 1), (1, 0)]
    on_gpu(fake, engine, 1)
    assert fake.process_bytes_on(1) == 6 * GiB and fake.used_bytes(0) == 0
    # And back through a migration, relative to the new place.
    assert engine.migrate(engine.gpus[0]).ok
    on_gpu(fake, engine, 0)


IN_PLACE_ADVICE = (
    "free memory there, or resume it with a target, e.g. from the dashboard or `flexium resume JOB cuda:N`"
)


def test_resume_without_a_target_stays_on_its_gpu_when_that_filled_up(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server chooses the GPU (it always sends one when it has device reports); the engine
    only rules on its own, and never moves a resume elsewhere by itself."""
    monkeypatch.setenv("FAKE_CUDA_GPUS", "3")
    fake.reset()
    fake.set_process_memory(0, 30 * GiB)
    engine = make_engine()
    assert engine.pause().ok
    fake.set_other_memory(0, H200_BYTES - 10 * GiB)  # someone took GPU 0 meanwhile
    fake.set_other_memory(1, 50 * GiB)
    fake.set_other_memory(2, 20 * GiB)
    assert [c.gpu.device for c in engine.candidate_targets()] == ["cuda:2", "cuda:1"]
    fake.clear_log()
    with pytest.raises(TargetRefusedError) as caught:
        engine.resume()
    assert str(caught.value) == (
        "cuda:0 has 10.00 GiB free; the paused job needs 30.00 GiB plus 0.50 GiB headroom: it stays paused; "
        + IN_PLACE_ADVICE
    )
    assert fake.calls("cu") == []
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED
    result = engine.resume(engine.gpus[2])
    assert result.ok and result.target.device == "cuda:2"
    assert sorted(fake.last_pairs()) == [(0, 2), (1, 1), (2, 0)]
    on_gpu(fake, engine, 2)


def test_pause_refused_when_the_host_cannot_hold_the_memory(
    fake: FakeDriver, make_engine: Callable[..., Any], host_memory: HostMemory
) -> None:
    fake.set_process_memory(0, 6 * GiB)
    host_memory.available = 4 * GiB
    engine = make_engine()
    with pytest.raises(TargetRefusedError, match=r"pausing needs 7\.00 GiB of host memory .* has 4\.00 GiB available"):
        engine.pause()
    assert engine.state == EngineState.RUNNING and checkpoint_ops(fake) == []
    host_memory.available = 8 * GiB
    assert engine.pause().ok


def test_resume_without_room_anywhere_stays_paused(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, 30 * GiB)
    engine = make_engine()
    engine.pause()
    fake.set_other_memory(0, H200_BYTES - 10 * GiB)
    fake.set_other_memory(1, H200_BYTES - 10 * GiB)
    fake.clear_log()
    with pytest.raises(TargetRefusedError) as caught:
        engine.resume()
    assert str(caught.value) == (
        "cuda:0 has 10.00 GiB free; the paused job needs 30.00 GiB plus 0.50 GiB headroom: it stays paused; "
        + IN_PLACE_ADVICE
    )
    with pytest.raises(TargetRefusedError) as caught:
        engine.resume(engine.gpus[1])
    assert str(caught.value) == (
        "cuda:1 has 10.00 GiB free; the paused job needs 30.00 GiB plus 0.50 GiB headroom: it stays paused; "
        "free memory there or choose another GPU"
    )
    assert fake.calls("cu") == []
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED
    fake.set_other_memory(1, 0)
    with pytest.raises(TargetRefusedError, match="it stays paused"):
        engine.resume()  # room elsewhere is the server's to find: in place is still refused
    assert fake.calls("cu") == [] and engine.state == EngineState.PAUSED
    # Back where it was beside another process, what the driver restores needs headroom: that process
    # may take more before the restore, and a restore without room loses the job (docs/facts.md fact 28).
    fake.set_other_memory(0, H200_BYTES - 30 * GiB)
    with pytest.raises(TargetRefusedError, match="needs 30.00 GiB plus 0.50 GiB headroom: it stays paused"):
        engine.resume()
    assert fake.calls("cu") == [] and engine.state == EngineState.PAUSED
    fake.set_other_memory(0, H200_BYTES - 30 * GiB - 512 * MiB)
    assert engine.resume().target.device == "cuda:0"
    on_gpu(fake, engine, 0)


def test_a_job_that_filled_its_gpu_resumes_back_on_it_alone(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    """Back where it was, on a GPU no other process uses, a job needs only what it held there: no
    headroom, or a job that filled its GPU could never come back to it."""
    engine = make_engine()
    fake.set_process_memory(0, H200_BYTES - 100 * MiB)
    assert engine.pause().ok
    assert engine.resume().target.device == "cuda:0"
    on_gpu(fake, engine, 0)


def test_resume_on_another_model_is_refused(
    fake: FakeDriver, make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_CUDA_MODELS", "NVIDIA H200,NVIDIA H100 80GB HBM3")
    fake.reset()
    engine = make_engine()
    engine.pause()
    fake.clear_log()
    with pytest.raises(TargetRefusedError, match="the job was paused on a NVIDIA H200: resume needs the same model"):
        engine.resume(engine.gpus[1])
    assert fake.calls("cu") == [] and engine.state == EngineState.PAUSED


def test_resume_on_a_device_name_is_refused_and_the_job_stays_paused(
    fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    engine = make_engine()
    engine.pause()
    fake.clear_log()
    with pytest.raises(TargetRefusedError, match=r"^target 'cuda:1' is not a GPU UUID: "):
        engine.resume("cuda:1")
    assert fake.calls("cu") == [] and engine.state == EngineState.PAUSED
    assert engine.resume(fake.uuid(1)).ok
    on_gpu(fake, engine, 1)


def test_failed_resume_stays_paused_and_can_be_retried(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    """A restore refused for its arguments leaves the process restorable (docs/facts.md fact 3)."""
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
    # the restore with the same error and loses the job (docs/facts.md fact 29): the error says so.
    assert str(err).endswith(
        "; the job is still paused and can be resumed again, unless this process holds CUDA memory imported from "
        "another process outside PyTorch (CuPy, cuIpcOpenMemHandle): the driver cannot restore such a process "
        "(docs/facts.md fact 29), the next resume then fails with CUDA_ERROR_OPERATING_SYSTEM, and the job must be "
        "started again from its last checkpoint"
    )
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED
    assert nvml._frozen.is_set()
    assert engine.resume(engine.gpus[1]).ok
    on_gpu(fake, engine, 1)


def test_a_resume_that_found_too_little_room_says_the_job_is_lost(
    fake: FakeDriver, make_engine: Callable[..., Any]
) -> None:
    """The target fills up after the engine's room check: the restore fails for memory, after which
    the driver refuses every restore of the process (docs/facts.md fact 28). The job is not "still
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


def test_stop_resumes_a_paused_job(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    fake.set_process_memory(0, GiB)
    engine = make_engine()
    engine.pause()
    engine.stop()
    assert engine.state == EngineState.RUNNING and fake.state() == ProcessState.RUNNING
    on_gpu(fake, engine, 0)
    assert not nvml._frozen.is_set()


def test_stop_says_why_a_paused_job_it_cannot_resume_in_place_exits_paused(
    fake: FakeDriver, make_engine: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    fake.set_process_memory(0, 30 * GiB)
    engine = make_engine()
    engine.pause()
    fake.set_other_memory(0, H200_BYTES - 10 * GiB)  # GPU 1 has room: stop() does not move the job there
    fake.clear_log()
    engine.stop()
    assert (
        "could not resume the paused job in place at shutdown, so it exits paused: "
        "cuda:0 has 10.00 GiB free; the paused job needs 30.00 GiB" in capsys.readouterr().err
    )
    assert fake.calls("cu") == []
    assert engine.state == EngineState.PAUSED and fake.state() == ProcessState.CHECKPOINTED


def test_default_settings() -> None:
    assert engine_module.DEFAULT_MEMORY_MARGIN_BYTES == MARGIN
    assert engine_module.DEFAULT_LOCK_TIMEOUT_MS > 0
    assert engine_module.DEFAULT_SAFE_POINT_WAIT_SECONDS > 0


# ----------------------------------------------------------------------------- in fresh processes

FOUR_GPUS_SCRIPT = """
import fake_driver
from flexium.engine import Engine, snapshot_gpus
from flexium.engine.capabilities import detect

fake = fake_driver.FakeDriver(os.environ["FLEXIUM_LIBCUDA"])
fake.set_process_memory(0, 3 << 30)
engine = Engine(logical_ordinal=0, gpus=snapshot_gpus(), capabilities=detect(check_torch=False))
engine.start()
moves = []
for target in [1, 0, 2, 3, 1]:
    result = engine.migrate(engine.gpus[target])
    moves.append([f"cuda:{target}", result.ok, fake.last_pairs(), fake.placement(), engine.placement()[1].device,
                  result.bytes_moved])
paused = engine.pause()
resumed = engine.resume(fake.uuid(3))  # room on cuda:3 checked by NVML in a child process: 4 GPUs there too
out(gpus=len(engine.gpus), moves=moves, paused=paused.ok,
    resumed=[resumed.ok, resumed.target.device, fake.last_pairs(), fake.placement(), engine.state.value])
engine.stop()
"""

NO_NVML_SCRIPT = """
import fake_driver
from flexium.engine import Engine, snapshot_gpus
from flexium.engine.capabilities import detect

fake = fake_driver.FakeDriver(os.environ["FLEXIUM_LIBCUDA"])
fake.set_process_memory(0, 3 << 30)
caps = detect(check_torch=False)
engine = Engine(logical_ordinal=0, gpus=snapshot_gpus(), capabilities=caps)
migrated = engine.migrate(engine.gpus[1])
candidates = engine.candidate_targets()
engine.pause()
resumed = engine.resume()
out(caps=caps.to_dict(), nvml_index=[g.nvml_index for g in engine.gpus], ok=migrated.ok, notes=list(migrated.notes),
    bytes=migrated.bytes_moved, placement=fake.placement(), candidates=len(candidates),
    resumed=[resumed.ok, resumed.target.device, engine.state.value])
"""


@pytest.fixture(scope="module")
def fresh_processes() -> Any:
    from engine_fixtures import Script, script_env

    started = {
        "four_gpus": Script(FOUR_GPUS_SCRIPT, script_env(FAKE_CUDA_GPUS=4)),
        "no_nvml": Script(NO_NVML_SCRIPT, script_env(libnvml="/nonexistent/libnvidia-ml.so.1")),
    }
    yield started
    for script in started.values():
        script.kill()


def test_four_gpus_in_a_fresh_process(fresh_processes: Any) -> None:
    out = fresh_processes["four_gpus"].wait().result
    assert out["gpus"] == 4
    expected = [
        ("cuda:1", [(0, 1), (1, 0), (2, 2), (3, 3)], [1, 0, 2, 3]),
        ("cuda:0", [(1, 0), (0, 1), (2, 2), (3, 3)], [0, 1, 2, 3]),
        ("cuda:2", [(0, 2), (1, 1), (2, 0), (3, 3)], [2, 1, 0, 3]),
        ("cuda:3", [(2, 3), (1, 1), (0, 0), (3, 2)], [3, 1, 0, 2]),
        ("cuda:1", [(3, 1), (1, 3), (0, 0), (2, 2)], [1, 3, 0, 2]),
    ]
    for move, (target, pairs, placement) in zip(out["moves"], expected, strict=True):
        assert move[0] == target and move[1] is True
        assert sorted(map(tuple, move[2])) == sorted(pairs), target
        assert move[3] == placement, target
        assert move[4] == f"cuda:{placement[0]}" and move[5] == 3 << 30
    assert out["paused"] is True
    ok, target, pairs, placement, state = out["resumed"]
    assert ok and target == "cuda:3" and state == "RUNNING"
    assert sorted(map(tuple, pairs)) == [(0, 0), (1, 3), (2, 2), (3, 1)]
    assert placement == [3, 1, 0, 2]


def test_without_nvml_the_engine_still_migrates_and_says_what_it_could_not_check(fresh_processes: Any) -> None:
    out = fresh_processes["no_nvml"].wait().result
    assert out["caps"]["driver_version"] is None and out["caps"]["migration"] is True
    assert out["nvml_index"] == [None, None]
    assert out["ok"] is True and out["placement"] == [1, 0]
    assert out["notes"] == ["free memory on the target not checked: NVML unavailable"]
    assert out["bytes"] == 0  # neither NVML nor torch can tell here
    assert out["candidates"] == 0
    assert out["resumed"] == [True, "cuda:1", "RUNNING"]


def test_an_unknown_path_is_refused_before_anything_happens(fake: FakeDriver, make_engine: Callable[..., Any]) -> None:
    engine = make_engine()
    for call in (lambda: engine.migrate(engine.gpus[1], path="quick"), lambda: engine.pause(path="")):
        with pytest.raises(ValueError, match=r"path must be one of auto, fast, driver, not '(quick)?'"):
            call()
    assert engine.state == EngineState.RUNNING and checkpoint_ops(fake) == []
