"""Which physical GPU each CUDA ordinal of this process is on now, and the plans that move them.

After a remapped restore the driver still reports the pre-migration UUIDs and ordinals
(fact `remap-keeps-old-identity`), so this map is the only record of where the process really is. A target
is a GPU UUID or a GpuIdentity: the server turns what a person typed into a UUID, so the engine
parses no device names.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flexium import _C
from flexium.engine import nvml
from flexium.engine.operations import GpuIdentity
from flexium.errors import TargetRefusedError

# A GPU UUID ("GPU-...", as nvidia-smi -L prints it) or a GpuIdentity of this process's snapshot.
Target = str | GpuIdentity


@dataclass(frozen=True)
class Move:
    logical: int  # the CUDA ordinal the training code uses
    source: GpuIdentity  # where its context is now
    target: GpuIdentity


@dataclass(frozen=True)
class MovePlan:
    """Where a migrate or resume puts this process's logical devices, planned from where every
    one of them is now (the driver remaps all visible GPUs at once, fact `restore-pairs-every-gpu`)."""

    moves: tuple[Move, ...]
    placement: tuple[tuple[int, GpuIdentity], ...]  # every logical ordinal's GPU when planned

    @property
    def move(self) -> Move:
        """The plan's one move: an operation's result names one source and one target."""
        if len(self.moves) != 1:
            raise ValueError(f"a plan of {len(self.moves)} moves has no single move")
        return self.moves[0]

    def of(self, logical: int) -> Move:
        """Where the plan takes logical device `logical`: named in it, displaced by a move onto
        its GPU, or staying (source and target the same)."""
        gpus = {gpu.uuid: gpu for _, gpu in self.placement}
        source = dict(self.placement)[logical]
        return Move(logical, source, gpus[dict(self.pairs).get(source.uuid, source.uuid)])

    @property
    def pairs(self) -> tuple[tuple[str, str], ...]:
        """The restore's GPU map, (where a context is now, where it goes) for every visible GPU:
        each move's source goes to its target, each context a move displaces goes to a GPU a
        move leaves, and every other GPU maps to itself. Empty when nothing changes GPU: a
        restore in place takes no map."""
        moving = {m.source.uuid: m.target.uuid for m in self.moves if m.source.uuid != m.target.uuid}
        if not moving:
            return ()
        taken = set(moving.values())
        left = [uuid for uuid in moving if uuid not in taken]
        displaced = [gpu.uuid for _, gpu in self.placement if gpu.uuid in taken and gpu.uuid not in moving]
        goes_to = {**moving, **dict(zip(displaced, left, strict=True))}
        return tuple((gpu.uuid, goes_to.get(gpu.uuid, gpu.uuid)) for _, gpu in self.placement)


def snapshot_gpus() -> list[GpuIdentity]:
    """The visible GPUs as the driver reports them now: call before any migration."""
    nvml_index = {gpu.uuid: gpu.index for gpu in nvml.host_gpus()}
    return [
        GpuIdentity(
            ordinal=d.ordinal,
            uuid=d.uuid,
            name=d.name,
            total_memory=int(d.total_memory),
            pci_bus_id=d.pci_bus_id,
            nvml_index=nvml_index.get(d.uuid),
        )
        for d in _C.list_devices()
    ]


class IdentityMap:
    def __init__(self, gpus: Sequence[GpuIdentity]) -> None:
        if not gpus:
            raise ValueError("IdentityMap needs at least one GPU")
        self._gpus = tuple(gpus)
        self._lock = threading.Lock()
        self._physical: dict[int, GpuIdentity] = {gpu.ordinal: gpu for gpu in self._gpus}

    @property
    def gpus(self) -> tuple[GpuIdentity, ...]:
        return self._gpus

    def physical_of(self, logical: int) -> GpuIdentity:
        with self._lock:
            return self._physical[logical]

    def logical_on(self, uuid: str) -> int | None:
        with self._lock:
            for logical, gpu in self._physical.items():
                if gpu.uuid == uuid:
                    return logical
        return None

    def resolve(self, target: Target) -> GpuIdentity:
        """The visible GPU a target names; TargetRefusedError when it names none this process can use."""
        if isinstance(target, GpuIdentity):
            uuid = target.uuid
        elif isinstance(target, str):
            uuid = target.strip()
        else:
            raise TargetRefusedError(f"target must be a GPU UUID or a GpuIdentity, not {type(target).__name__}")
        for gpu in self._gpus:
            if gpu.uuid.lower() == uuid.lower():
                return gpu
        if not uuid.upper().startswith("GPU-"):
            raise TargetRefusedError(
                f"target '{target}' is not a GPU UUID: the engine takes a UUID ('GPU-...', as nvidia-smi -L prints it) "
                "or a GpuIdentity; names such as 'cuda:N' or an nvidia-smi index are resolved by the server"
            )
        on_host = nvml.gpu_by_uuid(uuid)
        if on_host is not None:
            raise TargetRefusedError(
                f"GPU {uuid} (nvidia-smi index {on_host.index}) is not visible to this process{_visible_hint()}"
            )
        raise TargetRefusedError(f"no GPU with UUID {uuid} on this host")

    def plan(self, targets: Mapping[int, GpuIdentity]) -> MovePlan:
        """A plan putting each logical ordinal in `targets` on its GPU, from where all are now."""
        if len({gpu.uuid for gpu in targets.values()}) != len(targets):
            raise ValueError("two logical devices cannot move to the same GPU")
        with self._lock:
            placement = tuple(self._physical.items())
            moves = tuple(Move(logical, self._physical[logical], gpu) for logical, gpu in targets.items())
        return MovePlan(moves=moves, placement=placement)

    def apply(self, plan: MovePlan) -> None:
        """Records that the plan's restore succeeded: its pairs name where each context was."""
        by_uuid = {gpu.uuid: gpu for gpu in self._gpus}
        moves = dict(plan.pairs)
        with self._lock:
            self._physical = {
                logical: by_uuid[moves.get(gpu.uuid, gpu.uuid)] for logical, gpu in self._physical.items()
            }


def _visible_hint() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
