"""The identity map (flexium.engine.identity): which physical GPU each CUDA ordinal is on, how targets are named, and
the move plans whose pairs are the full GPU permutation a remapped restore needs (facts `restore-pairs-every-gpu` and
`remap-keeps-old-identity`). Pair lists are checked against the fake driver's restore, which enforces fact
`restore-pairs-every-gpu` and tracks where every logical device really is."""

from __future__ import annotations

import random
from typing import Any

import pytest

from flexium.engine.identity import IdentityMap, Move
from flexium.engine.operations import GpuIdentity
from flexium.errors import TargetRefusedError
from support.engine import PID, driver, fake  # noqa: F401  (fixtures)
from support.fake_driver import FakeDriver


def gpu(ordinal: int, uuid: str = "", name: str = "NVIDIA H200") -> GpuIdentity:
    return GpuIdentity(
        ordinal=ordinal,
        uuid=uuid or f"GPU-0000000{ordinal}-0000-0000-0000-000000000000",
        name=name,
        total_memory=143771 << 20,
        pci_bus_id=f"0000:{0x18 + ordinal:02x}:00.0",
        nvml_index=ordinal,
    )


def gpus(n: int) -> list[GpuIdentity]:
    return [gpu(i) for i in range(n)]


def fake_gpus(fake: FakeDriver) -> list[GpuIdentity]:
    from flexium.engine import snapshot_gpus

    return snapshot_gpus()


def placement_of(identity: IdentityMap, n: int) -> list[str]:
    return [identity.physical_of(logical).uuid for logical in range(n)]


# ----------------------------------------------------------------------------- naming targets


def test_a_uuid_or_a_gpu_identity_resolves_to_that_gpu_in_any_case() -> None:
    all_gpus = gpus(3)
    identity = IdentityMap(all_gpus)
    assert identity.resolve(all_gpus[2].uuid) == all_gpus[2]
    assert identity.resolve(all_gpus[2].uuid.lower().replace("gpu-", "GPU-")) == all_gpus[2]
    assert identity.resolve(all_gpus[2].uuid.upper()) == all_gpus[2]
    assert identity.resolve(f" {all_gpus[2].uuid} ") == all_gpus[2]
    assert identity.resolve(all_gpus[1]) == all_gpus[1]


def test_a_uuid_names_the_physical_gpu_not_where_a_logical_device_went() -> None:
    all_gpus = gpus(2)
    identity = IdentityMap(all_gpus)
    identity.apply(identity.plan({0: all_gpus[1]}))
    assert identity.physical_of(0) == all_gpus[1]
    # The GPU that was cuda:0 at init, now holding logical 1.
    assert identity.resolve(all_gpus[0].uuid) == all_gpus[0]
    assert identity.resolve(all_gpus[1]) == all_gpus[1]


@pytest.mark.parametrize("target", ["cuda:1", "CUDA:1", " cuda:1 ", "1", "cuda:01", "gpu1", "cuda:x", "", "MIG-1234"])
def test_device_names_are_refused_the_server_resolves_them(target: str) -> None:
    """The engine parses no device names: "cuda:N" or an nvidia-smi index means something only in
    the numbering the server resolves it in."""
    with pytest.raises(TargetRefusedError) as caught:
        IdentityMap(gpus(2)).resolve(target)
    assert str(caught.value) == (
        f"target '{target}' is not a GPU UUID: the engine takes a UUID ('GPU-...', as nvidia-smi -L prints it) "
        "or a GpuIdentity; names such as 'cuda:N' or an nvidia-smi index are resolved by the server"
    )


@pytest.mark.parametrize("target", [None, 1, 1.0, ["cuda:1"]])
def test_targets_of_another_type_are_refused(target: Any) -> None:
    with pytest.raises(TargetRefusedError) as caught:
        IdentityMap(gpus(2)).resolve(target)
    assert str(caught.value) == f"target must be a GPU UUID or a GpuIdentity, not {type(target).__name__}"


def test_a_uuid_not_on_this_host(fake: FakeDriver) -> None:
    identity = IdentityMap(fake_gpus(fake))
    unknown = "GPU-deadbeef-0000-1111-2222-333344445555"
    with pytest.raises(TargetRefusedError) as caught:
        identity.resolve(unknown)
    assert str(caught.value) == f"no GPU with UUID {unknown} on this host"


def test_a_uuid_on_the_host_but_hidden_from_this_process(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_GPUS", "3")
    fake.reset()
    visible = fake_gpus(fake)[:2]  # as if CUDA_VISIBLE_DEVICES=0,1 on a 3-GPU host
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    identity = IdentityMap(visible)
    hidden = fake.uuid(2)
    with pytest.raises(TargetRefusedError) as caught:
        identity.resolve(hidden)
    assert str(caught.value) == (
        f"GPU {hidden} (nvidia-smi index 2) is not visible to this process (CUDA_VISIBLE_DEVICES=0,1)"
    )


def test_an_empty_gpu_list_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one GPU"):
        IdentityMap([])


# ----------------------------------------------------------------------------- plans, pairs and placement


def test_pairs_name_every_gpu_and_swap_source_with_target() -> None:
    g = gpus(4)
    identity = IdentityMap(g)
    plan = identity.plan({0: g[2]})
    assert plan.move == Move(0, g[0], g[2])
    assert plan.pairs == (
        (g[0].uuid, g[2].uuid),
        (g[1].uuid, g[1].uuid),
        (g[2].uuid, g[0].uuid),
        (g[3].uuid, g[3].uuid),
    )
    assert placement_of(identity, 4) == [x.uuid for x in g]  # planning changes nothing


def test_pairs_are_relative_to_where_each_context_is_now() -> None:
    g = gpus(3)
    identity = IdentityMap(g)
    identity.apply(identity.plan({0: g[1]}))  # logical 0 on GPU 1, logical 1 on GPU 0
    assert placement_of(identity, 3) == [g[1].uuid, g[0].uuid, g[2].uuid]
    back = identity.plan({0: g[0]})
    assert back.move == Move(0, g[1], g[0])
    assert sorted(back.pairs) == sorted([(g[1].uuid, g[0].uuid), (g[0].uuid, g[1].uuid), (g[2].uuid, g[2].uuid)])
    identity.apply(back)
    assert placement_of(identity, 3) == [g[0].uuid, g[1].uuid, g[2].uuid]
    identity.apply(identity.plan({0: g[2]}))
    assert placement_of(identity, 3) == [g[2].uuid, g[1].uuid, g[0].uuid]
    assert identity.logical_on(g[2].uuid) == 0 and identity.logical_on(g[0].uuid) == 2
    assert identity.logical_on("GPU-none") is None


def test_moving_another_logical_device() -> None:
    g = gpus(3)
    identity = IdentityMap(g)
    identity.apply(identity.plan({1: g[2]}))
    assert placement_of(identity, 3) == [g[0].uuid, g[2].uuid, g[1].uuid]


def test_a_plan_that_stays_put_has_no_pairs_a_restore_in_place_takes_no_map() -> None:
    g = gpus(3)
    identity = IdentityMap(g)
    identity.apply(identity.plan({0: g[1]}))
    stay = identity.plan({0: g[1]})
    assert stay.move == Move(0, g[1], g[1]) and stay.pairs == ()
    identity.apply(stay)
    assert placement_of(identity, 3) == [g[1].uuid, g[0].uuid, g[2].uuid]


def test_a_plan_of_several_moves_is_one_full_permutation() -> None:
    """Two logical devices moved at once (no engine operation does so yet): each goes to its
    target, the contexts they displace take the GPUs they leave, in order."""
    g = gpus(4)
    identity = IdentityMap(g)
    plan = identity.plan({0: g[2], 1: g[3]})
    assert plan.pairs == (
        (g[0].uuid, g[2].uuid),
        (g[1].uuid, g[3].uuid),
        (g[2].uuid, g[0].uuid),
        (g[3].uuid, g[1].uuid),
    )
    rotate = identity.plan({0: g[1], 1: g[2]})  # logical 1 leaves for where logical 2 is
    assert rotate.pairs == (
        (g[0].uuid, g[1].uuid),
        (g[1].uuid, g[2].uuid),
        (g[2].uuid, g[0].uuid),
        (g[3].uuid, g[3].uuid),
    )
    with pytest.raises(ValueError, match="no single move"):
        _ = plan.move
    with pytest.raises(ValueError, match="cannot move to the same GPU"):
        identity.plan({0: g[2], 1: g[2]})


def test_pairs_drive_the_driver_to_the_placement_the_map_records(
    fake: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A random walk of plans moving one or two logical devices: every pair list is a full
    permutation the fake driver accepts (fact `restore-pairs-every-gpu`), and after each restore the map and the driver
    agree on where every logical device is."""
    from flexium import _C

    monkeypatch.setenv("FAKE_CUDA_GPUS", "4")
    fake.reset()
    g = fake_gpus(fake)
    uuids = [x.uuid for x in g]
    identity = IdentityMap(g)
    rng = random.Random(1234)
    for walk in range(16):
        movers = rng.sample(range(4), 1 + walk % 2)
        targets: dict[int, GpuIdentity] = {}
        for logical in movers:
            taken = {x.uuid for x in targets.values()} | {identity.physical_of(logical).uuid}
            targets[logical] = rng.choice([x for x in g if x.uuid not in taken])
        plan = identity.plan(targets)
        pairs = plan.pairs
        assert sorted(old for old, _ in pairs) == sorted(uuids)
        assert sorted(new for _, new in pairs) == sorted(uuids)
        outcomes = _C.run_steps(
            PID,
            [
                _C.Step(_C.StepKind.LOCK),
                _C.Step(_C.StepKind.CHECKPOINT),
                _C.Step(_C.StepKind.RESTORE, pairs=[_C.GpuPair(o, n) for o, n in pairs]),
                _C.Step(_C.StepKind.UNLOCK),
            ],
            [],
        )
        assert [o.code for o in outcomes] == [0, 0, 0, 0]
        identity.apply(plan)
        assert all(identity.physical_of(logical) == target for logical, target in targets.items())
        assert [uuids[fake.physical_of(lg)] for lg in range(4)] == placement_of(identity, 4)
