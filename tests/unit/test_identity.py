"""The identity map (flexium.engine.identity): which physical GPU each CUDA ordinal is on, how
targets are named, and the full GPU permutation a remapped restore needs (DESIGN.md facts 2, 5).
Pair lists are checked against the fake driver's restore, which enforces fact 2 and tracks where
every logical device really is."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine_fixtures import PID, driver, fake  # noqa: F401  (fixtures)
from fake_driver import FakeDriver
from flexium.engine.identity import IdentityMap
from flexium.engine.operations import GpuIdentity
from flexium.errors import TargetRefusedError


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


@pytest.mark.parametrize("target", ["cuda:1", "CUDA:1", " cuda:1 ", "1", 1, "cuda:01"])
def test_targets_naming_ordinal_1(target: Any) -> None:
    identity = IdentityMap(gpus(3))
    assert identity.resolve(target) == gpus(3)[1]


def test_a_uuid_or_a_gpu_identity_resolves_to_that_gpu_in_any_case() -> None:
    all_gpus = gpus(3)
    identity = IdentityMap(all_gpus)
    assert identity.resolve(all_gpus[2].uuid) == all_gpus[2]
    assert identity.resolve(all_gpus[2].uuid.lower().replace("gpu-", "GPU-")) == all_gpus[2]
    assert identity.resolve(all_gpus[2].uuid.upper()) == all_gpus[2]
    assert identity.resolve(all_gpus[1]) == all_gpus[1]


def test_cuda_n_names_the_gpu_as_it_was_at_init_not_where_logical_n_went() -> None:
    all_gpus = gpus(2)
    identity = IdentityMap(all_gpus)
    identity.apply(identity.pairs_to_move(0, all_gpus[1]))
    assert identity.physical_of(0) == all_gpus[1]
    # "cuda:0" still means the GPU that was cuda:0 at init, now holding logical 1.
    assert identity.resolve("cuda:0") == all_gpus[0]
    assert identity.resolve(1) == all_gpus[1]


@pytest.mark.parametrize("target", ["gpu1", "cuda:", "cuda:x", "cuda:-1", "cuda:1.0", "", "cuda 1", "MIG-1234"])
def test_malformed_targets_are_refused_with_the_expected_form(target: str) -> None:
    with pytest.raises(TargetRefusedError) as caught:
        IdentityMap(gpus(2)).resolve(target)
    message = str(caught.value)
    assert f"'{target}'" in message
    assert "cuda:N" in message and "e.g. 'cuda:1'" in message


@pytest.mark.parametrize("target", [None, 1.0, ["cuda:1"]])
def test_targets_of_another_type_are_refused(target: Any) -> None:
    with pytest.raises(TargetRefusedError, match=f"not {type(target).__name__}"):
        IdentityMap(gpus(2)).resolve(target)


@pytest.mark.parametrize("target,shown", [("cuda:7", "cuda:7"), (7, "7"), ("2", "2"), (-1, "-1")])
def test_an_ordinal_out_of_range_names_the_visible_range(target: Any, shown: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(TargetRefusedError) as caught:
        IdentityMap(gpus(2)).resolve(target)
    assert str(caught.value) == f"device {shown} does not exist: this process sees 2 GPU(s) (cuda:0..cuda:1)"


def test_out_of_range_on_one_gpu_and_with_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(TargetRefusedError) as caught:
        IdentityMap(gpus(1)).resolve("cuda:1")
    assert str(caught.value) == (
        "device cuda:1 does not exist: this process sees 1 GPU(s) (cuda:0) (CUDA_VISIBLE_DEVICES=3)"
    )


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


# ----------------------------------------------------------------------------- pairs and placement


def test_pairs_name_every_gpu_and_swap_source_with_target() -> None:
    g = gpus(4)
    identity = IdentityMap(g)
    assert identity.pairs_to_move(0, g[2]) == [
        (g[0].uuid, g[2].uuid),
        (g[1].uuid, g[1].uuid),
        (g[2].uuid, g[0].uuid),
        (g[3].uuid, g[3].uuid),
    ]
    assert placement_of(identity, 4) == [x.uuid for x in g]  # asking changes nothing


def test_pairs_are_relative_to_where_each_context_is_now() -> None:
    g = gpus(3)
    identity = IdentityMap(g)
    identity.apply(identity.pairs_to_move(0, g[1]))  # logical 0 on GPU 1, logical 1 on GPU 0
    assert placement_of(identity, 3) == [g[1].uuid, g[0].uuid, g[2].uuid]
    back = identity.pairs_to_move(0, g[0])
    assert sorted(back) == sorted([(g[1].uuid, g[0].uuid), (g[0].uuid, g[1].uuid), (g[2].uuid, g[2].uuid)])
    identity.apply(back)
    assert placement_of(identity, 3) == [g[0].uuid, g[1].uuid, g[2].uuid]
    identity.apply(identity.pairs_to_move(0, g[2]))
    assert placement_of(identity, 3) == [g[2].uuid, g[1].uuid, g[0].uuid]
    assert identity.logical_on(g[2].uuid) == 0 and identity.logical_on(g[0].uuid) == 2
    assert identity.logical_on("GPU-none") is None


def test_moving_another_logical_device() -> None:
    g = gpus(3)
    identity = IdentityMap(g)
    identity.apply(identity.pairs_to_move(1, g[2]))
    assert placement_of(identity, 3) == [g[0].uuid, g[2].uuid, g[1].uuid]


def test_pairs_drive_the_driver_to_the_placement_the_map_records(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    """A random walk of moves: every pair list is a full permutation the fake driver accepts
    (fact 2), and after each restore the map and the driver agree on where every logical
    device is."""
    from flexium import _C

    monkeypatch.setenv("FAKE_CUDA_GPUS", "4")
    fake.reset()
    g = fake_gpus(fake)
    uuids = [x.uuid for x in g]
    identity = IdentityMap(g)
    rng = random.Random(1234)
    for _ in range(12):
        logical = rng.randrange(4)
        target = rng.choice([x for x in g if x.uuid != identity.physical_of(logical).uuid])
        pairs = identity.pairs_to_move(logical, target)
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
        identity.apply(pairs)
        assert identity.physical_of(logical) == target
        assert [uuids[fake.physical_of(lg)] for lg in range(4)] == placement_of(identity, 4)
