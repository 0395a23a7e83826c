"""Which physical GPU each CUDA ordinal of this process is on now.

After a remapped restore the driver still reports the pre-migration UUIDs and ordinals
(DESIGN.md fact 5), so this map is the only record of where the process really is. Targets
name GPUs as they were at init: "cuda:N" is the N-th GPU this process saw before any move.
"""

from __future__ import annotations

import os
import threading
from typing import Optional, Sequence, Union

from flexium.engine import nvml
from flexium.engine.operations import GpuIdentity
from flexium.errors import TargetRefusedError

Target = Union[str, int, GpuIdentity]


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

    def logical_on(self, uuid: str) -> Optional[int]:
        with self._lock:
            for logical, gpu in self._physical.items():
                if gpu.uuid == uuid:
                    return logical
        return None

    def resolve(self, target: Target) -> GpuIdentity:
        """The GPU a target names; TargetRefusedError when it names none this process can use."""
        if isinstance(target, GpuIdentity):
            target = target.uuid
        if isinstance(target, int) or (isinstance(target, str) and target.strip().isdigit()):
            return self._by_ordinal(int(target), str(target))
        if not isinstance(target, str):
            raise TargetRefusedError(f"target must be 'cuda:N', an ordinal or a GPU UUID, not {type(target).__name__}")
        text = target.strip()
        if text.lower().startswith("cuda:"):
            number = text[5:]
            if not number.isdigit():
                raise TargetRefusedError(f"invalid device '{target}': expected 'cuda:N' with N a GPU index, e.g. 'cuda:1'")
            return self._by_ordinal(int(number), text)
        if text.upper().startswith("GPU-"):
            for gpu in self._gpus:
                if gpu.uuid.lower() == text.lower():
                    return gpu
            on_host = nvml.gpu_by_uuid(text)
            if on_host is not None:
                raise TargetRefusedError(
                    f"GPU {text} (nvidia-smi index {on_host.index}) is not visible to this process{_visible_hint()}"
                )
            raise TargetRefusedError(f"no GPU with UUID {text} on this host")
        raise TargetRefusedError(f"invalid device '{target}': expected 'cuda:N' (e.g. 'cuda:1') or a GPU UUID 'GPU-...'")

    def _by_ordinal(self, ordinal: int, shown: str) -> GpuIdentity:
        if 0 <= ordinal < len(self._gpus):
            return self._gpus[ordinal]
        span = f"cuda:0..cuda:{len(self._gpus) - 1}" if len(self._gpus) > 1 else "cuda:0"
        raise TargetRefusedError(
            f"device {shown} does not exist: this process sees {len(self._gpus)} GPU(s) ({span}){_visible_hint()}"
        )

    def pairs_to_move(self, logical: int, target: GpuIdentity) -> list[tuple[str, str]]:
        """The full permutation that puts `logical` on `target`: its GPU and the target swap
        places and every other visible GPU maps to itself (the driver wants all of them,
        DESIGN.md fact 2). Pairs name where each context is now, not where it began."""
        with self._lock:
            source = self._physical[logical]
            pairs = []
            for gpu in self._physical.values():
                if gpu.uuid == source.uuid:
                    pairs.append((gpu.uuid, target.uuid))
                elif gpu.uuid == target.uuid:
                    pairs.append((gpu.uuid, source.uuid))
                else:
                    pairs.append((gpu.uuid, gpu.uuid))
            return pairs

    def apply(self, pairs: Sequence[tuple[str, str]]) -> None:
        by_uuid = {gpu.uuid: gpu for gpu in self._gpus}
        moves = dict(pairs)
        with self._lock:
            self._physical = {logical: by_uuid[moves.get(gpu.uuid, gpu.uuid)] for logical, gpu in self._physical.items()}


def _visible_hint() -> str:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
