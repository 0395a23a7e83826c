"""NCCL communicator discovery (engine/distributed/nccl.communicators) on its real input: torch's
process groups, made by CPU torch's own init_process_group and new_group. A backend registered for
"cuda" stands in for ProcessGroupNCCL (CPU torch has none): a real torch backend (gloo's) with what
nccl.py reads of torch's, ``_comm_ptr()`` (torch up to 2.11) and ``suspend()`` / ``resume()``
(2.12 on). Every other CPU test replaces communicators(), so this is where a discovery that finds
nothing fails."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from flexium.engine.distributed import nccl

BACKEND = "flexium_test_nccl"
_made: list[StandInProcessGroupNCCL] = []  # alive, so that torch hands back these very objects


class StandInProcessGroupNCCL(dist.ProcessGroupGloo):
    """What nccl.py reads of torch's ProcessGroupNCCL: its communicator's address (0 until the
    group's first collective made it) and its own suspend and resume."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(store, rank, size, timeout)
        self.address = 0x7F00_0000_0000 + 0x1000 * len(_made)
        self.calls: list[str] = []

    def _comm_ptr(self) -> int:
        return self.address

    def suspend(self) -> None:
        self.calls.append("suspend")

    def resume(self) -> None:
        self.calls.append("resume")


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> StandInProcessGroupNCCL:
    backend = StandInProcessGroupNCCL(store, rank, size, timeout)
    _made.append(backend)
    return backend


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A job of one rank as torch makes it: the default group (gloo for the CPU, the stand-in NCCL
    for CUDA), a second NCCL group and a gloo-only group, in that order."""
    if not hasattr(dist.Backend, BACKEND.upper()):
        dist.Backend.register_backend(BACKEND, _create, devices=["cuda"])
    monkeypatch.setattr(dist, "ProcessGroupNCCL", StandInProcessGroupNCCL, raising=False)
    _made.clear()
    dist.init_process_group(f"cpu:gloo,cuda:{BACKEND}", store=dist.HashStore(), rank=0, world_size=1)
    try:
        made = {"default": c10d._get_default_group(), "second": dist.new_group([0])}
        made["gloo"] = dist.new_group([0], backend="gloo")
        yield made
    finally:
        dist.destroy_process_group()
        _made.clear()


def _backend(group: Any) -> StandInProcessGroupNCCL:
    backend = group._get_backend(torch.device("cuda"))
    assert isinstance(backend, StandInProcessGroupNCCL)
    return backend


def test_torchs_own_suspend_is_used_for_every_nccl_group(groups: dict[str, Any]) -> None:
    found = nccl.communicators()
    assert [(type(c).__name__, c.name) for c in found] == [
        ("TorchCommunicator", "default group"),
        ("TorchCommunicator", "group 1"),
    ]  # the gloo-only group has no CUDA backend
    for comm in found:
        comm.suspend()
    assert all(comm.is_suspended() for comm in found)
    for comm in found:
        comm.resume()
    assert not any(comm.is_suspended() for comm in found)
    for name in ("default", "second"):
        assert _backend(groups[name]).calls == ["suspend", "resume"], name


class RecordingNccl:
    """The calls nccl.py makes of a libnccl with ncclCommSuspend, each with its communicator's address."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None]] = []
        self.suspended: set[int | None] = set()

    def ncclCommSuspend(self, comm: ctypes.c_void_p, flags: int) -> int:  # noqa: N802  (NCCL's names)
        assert flags == nccl.NCCL_SUSPEND_MEM
        self.calls.append(("suspend", comm.value))
        self.suspended.add(comm.value)
        return 0

    def ncclCommResume(self, comm: ctypes.c_void_p) -> int:  # noqa: N802
        self.calls.append(("resume", comm.value))
        self.suspended.discard(comm.value)
        return 0

    def ncclCommMemStats(self, comm: ctypes.c_void_p, stat: int, value: Any) -> int:  # noqa: N802
        assert stat == nccl.NCCL_STAT_GPU_MEM_SUSPENDED
        value._obj.value = int(comm.value in self.suspended)
        return 0


@pytest.fixture
def torch_without_suspend(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch up to 2.11, whose ProcessGroupNCCL has no suspend (torch 2.13's backend base class gives
    every backend one, so the stand-in cannot lack it)."""
    monkeypatch.setattr(nccl, "_torch_can_suspend", lambda torch: False)


@pytest.mark.usefixtures("torch_without_suspend")
def test_communicators_of_an_older_torch_are_reached_through_their_addresses(
    groups: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    library = RecordingNccl()
    monkeypatch.setattr(nccl, "_library", nccl.NcclLibrary("/opt/nccl/libnccl.so.2", 23007, True, library))
    _backend(groups["second"]).address = 0  # no collective yet: torch has made no communicator
    found = nccl.communicators()
    assert [(type(c).__name__, c.name) for c in found] == [("RawCommunicator", "default group")]
    default = _backend(groups["default"]).address
    (comm,) = found
    comm.suspend()
    assert comm.is_suspended()
    comm.resume()
    assert not comm.is_suspended()
    assert library.calls == [("suspend", default), ("resume", default)]


@pytest.mark.usefixtures("groups", "torch_without_suspend")
def test_communicators_an_nccl_cannot_suspend_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    old = nccl.NcclLibrary("/opt/nccl/libnccl.so.2", 22809, False, None)
    monkeypatch.setattr(nccl, "_library", old)
    with pytest.raises(nccl.NcclError, match=r"this job's NCCL is 2\.28\.9 \(/opt/nccl/libnccl\.so\.2\)"):
        nccl.communicators()


def test_no_process_group_or_no_nccl_in_torch_means_no_communicators(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized() and nccl.communicators() == []
    monkeypatch.delattr(dist, "ProcessGroupNCCL", raising=False)  # CPU torch: no NCCL at all
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert nccl.communicators() == []
    finally:
        dist.destroy_process_group()
