"""A migration that succeeds: flexium.engine.Engine over the fake driver (tests/support/fake_driver.py), in
this process, checked through what the fake saw (the checkpoint calls, the pairs, where each
logical device is, what NVML reports) and what the engine says (state, placement, result); other
GPU counts and a machine without NVML in fresh processes. The refusals of a target are in
test_target_rules.py, the failures in test_engine_failures.py, other drivers in
test_capabilities.py, operations at optimizer safe points in test_engine_safe_points.py."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from flexium import _C
from flexium.engine import EngineState, OperationKind, nvml
from flexium.errors import (
    TargetRefusedError,
)
from support.engine import (  # noqa: F401  (fixtures)
    H200_BYTES,
    PID,
    GiB,
    assert_untouched,
    checkpoint_ops,
    driver,
    fake,
    make_engine,
    nvml_in_parent,
    on_gpu,
    step_summary,
)
from support.fake_driver import FakeDriver

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
    # The driver saw one transaction with every GPU paired (fact `restore-pairs-every-gpu`).
    assert checkpoint_ops(fake) == ["Lock", "Checkpoint", "Restore", "Unlock"]
    assert fake.last_pairs() == [(0, 1), (1, 0)]
    # No other CUDA call while locked (fact `locked-process-blocks-cuda`).
    assert fake.blocked_calls() == 0 and fake.deadlocks() == 0
    # Bytes from NVML; zero residue on the source (fact `zero-residue`).
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
    # The driver names each device's GPU now, its PCI bus id the one of init (fact `remap-keeps-old-identity`); the
    # engine tracks the GPU itself and reads neither.
    devices = _C.list_devices()
    assert [d.uuid for d in devices] == [fake.uuid(physical) for physical in fake.placement()]
    assert [d.pci_bus_id for d in devices] == [gpu.pci_bus_id for gpu in engine.gpus]
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
    # The driver names the GPU each device is on now, whatever the identities of init (fact `remap-keeps-old-identity`).
    assert [d.uuid for d in _C.list_devices()] == [fake.uuid(physical) for physical in placement]
    assert [gpu.uuid for gpu in engine.gpus] == fake.uuids()


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


# ----------------------------------------------------------------------------- in fresh processes

FOUR_GPUS_SCRIPT = """
from support import fake_driver
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
from support import fake_driver
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
    from support.engine import Script, script_env

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
