"""The engine: migrate, pause and resume of this process through the CUDA driver."""

from flexium.engine.engine import Engine, PathChoice, TargetCandidate, snapshot_gpus
from flexium.engine.identity import Move, MovePlan, Target
from flexium.engine.operations import EngineState, GpuIdentity, OperationKind, OperationResult, StepTiming

__all__ = [
    "Engine",
    "EngineState",
    "GpuIdentity",
    "Move",
    "MovePlan",
    "OperationKind",
    "OperationResult",
    "PathChoice",
    "StepTiming",
    "Target",
    "TargetCandidate",
    "snapshot_gpus",
]
