"""The GPU of a job's host with the most room it can use: the migrate target rules (drains included)
on every GPU but its own, then room as the policies count it (``HostRoom``: the last report less
the moves under way and the room held for others, with the headroom the job's room check asks).
``flexium migrate JOB auto`` and a drain pick targets by it; when none will do, it says why, GPU by
GPU."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from flexium.server.models import Process
from flexium.server.policies.room import HostRoom
from flexium.server.storage.targets import target_refusal
from flexium.units import gib


@dataclass(frozen=True)
class GpuChoice:
    uuid: str | None  # None: no GPU will do
    free: int  # what the chosen GPU has for it
    refusals: tuple[str, ...]  # "GPU 2: why not", for each GPU passed over

    def why_none(self) -> str:
        return "; ".join(self.refusals) or "its host reported no other GPU"


def gpu_label(room: HostRoom, uuid: str) -> str:
    index = room.gpus[uuid].device.index
    return f"GPU {uuid if index is None else index}"


def choose_gpu(
    *, proc: Process, need: int, room: HostRoom, avoid: Collection[str] = (), now: float, stale_after: float
) -> GpuChoice:
    """The GPU with the most room for ``need`` bytes of ``proc`` moving off its own GPU; ``avoid``:
    GPUs it must not go to (another rank of its job is there)."""
    fitting: list[tuple[int, int, str]] = []
    refusals: list[str] = []
    for uuid, gpu in sorted(room.gpus.items(), key=lambda item: (item[1].device.index or 0, item[0])):
        if uuid == proc.gpu_uuid:
            continue
        label = gpu_label(room, uuid)
        if uuid in avoid:
            refusals.append(f"{label}: another rank of its job is there")
            continue
        refusal = target_refusal(
            proc=proc, dev=gpu.device, kind="migrate", now=now, stale_after=stale_after, room=False
        )
        if refusal is not None:
            refusals.append(f"{label}: {refusal}")
            continue
        required = room.required(uuid, need, home=proc.gpu_uuid)
        free = room.unheld(uuid)
        if free < required:
            refusals.append(f"{label}: {gib(free)} free of the {gib(required)} it needs")
            continue
        fitting.append((free, -(gpu.device.index or 0), uuid))
    if not fitting:
        return GpuChoice(uuid=None, free=0, refusals=tuple(refusals))
    free, _, uuid = max(fitting)
    return GpuChoice(uuid=uuid, free=free, refusals=tuple(refusals))
