"""The engine: migrate, pause and resume of this process through the CUDA driver."""

from flexium.engine.engine import Engine
from flexium.engine.identity import Move, MovePlan, Target, snapshot_gpus
from flexium.engine.operations import EngineState, GpuIdentity, OperationKind, OperationResult, PathChoice, StepTiming
from flexium.engine.target_rules import TargetCandidate

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
