"""What an operation is asked and reports: the path, states, placements, per-step timings.
Frozen, JSON-friendly."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, get_args

# "auto": fast when possible; "fast": refuse otherwise; "driver": the checkpoint carries everything.
PathChoice = Literal["auto", "fast", "driver"]
PATHS: tuple[str, ...] = get_args(PathChoice)


class EngineState(str, enum.Enum):
    RUNNING = "RUNNING"
    MIGRATING = "MIGRATING"
    PAUSING = "PAUSING"
    PAUSED = "PAUSED"
    RESUMING = "RESUMING"
    FAILED = "FAILED"  # a rollback failed: the process may be stuck, a person must look


class OperationKind(str, enum.Enum):
    MIGRATE = "migrate"
    PAUSE = "pause"
    RESUME = "resume"


@dataclass(frozen=True)
class GpuIdentity:
    """One physical GPU as seen at init, before any migration (the driver hides later moves)."""

    ordinal: int  # its CUDA ordinal in this process at init (what `device` shows)
    uuid: str  # "GPU-..." as nvidia-smi prints it
    name: str  # model, e.g. "NVIDIA H200"
    total_memory: int  # bytes
    pci_bus_id: str
    nvml_index: int | None  # nvidia-smi's index, None where NVML is unavailable

    @property
    def device(self) -> str:
        return f"cuda:{self.ordinal}"


@dataclass(frozen=True)
class StepTiming:
    # prepare | copy | release | lock | checkpoint | restore | unlock | map | own | copier_sleep | copy_back
    # | rollback_copy (the native recover step reports its calls as restore / unlock with rollback=True;
    # validate is never a timing). docs/design.md, "The engine's invariants", lists them too.
    step: str
    seconds: float
    ok: bool
    rollback: bool = False  # part of the rollback after a failure
    error: str | None = None


@dataclass(frozen=True)
class OperationResult:
    kind: OperationKind
    # "fast" (we moved the pool's segments; the checkpoint carried the rest) or "driver" (the checkpoint
    # carried everything)
    path: str
    ok: bool
    logical_device: str  # what the training code uses, e.g. "cuda:0"
    source: GpuIdentity
    target: GpuIdentity | None  # None for pause
    steps: tuple[StepTiming, ...] = ()
    bytes_moved: int = 0
    seconds: float = 0.0
    # a StepTiming step, or pin / validate / own / prepare for a refusal before the locked section
    failed_step: str | None = None
    error: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    def step_seconds(self, step: str) -> float:
        return sum(s.seconds for s in self.steps if s.step == step and not s.rollback)

    @property
    def gb_per_second(self) -> float | None:
        return self.bytes_moved / 1e9 / self.seconds if self.seconds > 0 and self.bytes_moved else None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = self.kind.value
        return data
