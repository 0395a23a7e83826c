"""What the locked section's step outcomes (csrc/checkpoint.cpp run_steps) say: each step's
timing for the result, whether the operation's own restore succeeded, and its first failure in
words that name the driver call."""

from __future__ import annotations

from typing import Sequence

from flexium import _C
from flexium.engine.operations import StepTiming


def timing_of(outcome: _C.StepOutcome) -> StepTiming:
    error = None if outcome.code == 0 else f"{outcome.error_name} ({outcome.error_text})"
    return StepTiming(
        step=outcome.step, seconds=float(outcome.seconds), ok=outcome.code == 0, rollback=outcome.rollback, error=error
    )


# After a restore failed, the driver answers every later restore of the process with this: it stays
# checkpointed and never runs CUDA again (docs/facts.md fact 26; NVIDIA/cuda-checkpoint issue 44
# after a restore that failed for memory).
RESTORE_REFUSED_FOR_GOOD = "CUDA_ERROR_OPERATING_SYSTEM"


def restore_refused_for_good(outcomes: Sequence[_C.StepOutcome]) -> bool:
    """Whether a restore among the outcomes was refused in the way that leaves no way back."""
    return any(o.step == "restore" and o.error_name == RESTORE_REFUSED_FOR_GOOD for o in outcomes)


def own_restore_succeeded(outcomes: Sequence[_C.StepOutcome]) -> bool:
    """Whether the operation's own restore (not a rollback's) succeeded."""
    return any(o.step == "restore" and not o.rollback and o.code == 0 for o in outcomes)


def first_failure(outcomes: Sequence[_C.StepOutcome]) -> _C.StepOutcome:
    for outcome in outcomes:
        if outcome.code != 0:
            return outcome
    raise AssertionError("no failed step among the outcomes")


_STEP_CALLS = {
    "lock": "cuCheckpointProcessLock",
    "checkpoint": "cuCheckpointProcessCheckpoint",
    "restore": "cuCheckpointProcessRestore",
    "unlock": "cuCheckpointProcessUnlock",
}


def describe_failure(outcome: _C.StepOutcome) -> str:
    step, name = outcome.step, outcome.error_name
    text = f"step '{step}' failed: {_STEP_CALLS.get(step, step)} returned {name} ({outcome.error_text})"
    if step == "lock" and name == "CUDA_ERROR_TIMEOUT":
        text += " (the process stayed busy in CUDA work past the lock timeout; try again)"
    return text
