"""The engine: migrate, pause and resume of this process through the CUDA driver."""

from flexium.engine.engine import Engine, TargetCandidate, snapshot_gpus
from flexium.engine.operations import EngineState, GpuIdentity, OperationKind, OperationResult, StepTiming

__all__ = [
    "Engine",
    "EngineState",
    "GpuIdentity",
    "OperationKind",
    "OperationResult",
    "StepTiming",
    "TargetCandidate",
    "snapshot_gpus",
]
