"""What the locked section's step outcomes (csrc/checkpoint.cpp run_steps) say: each step's
timing for the result, whether the operation's own restore succeeded, and its first failure in
words that name the driver call."""

from __future__ import annotations

from collections.abc import Sequence

from flexium import _C
from flexium.engine.operations import StepTiming


def timing_of(outcome: _C.StepOutcome) -> StepTiming:
    error = None if outcome.code == 0 else f"{outcome.error_name} ({outcome.error_text})"
    return StepTiming(
        step=outcome.step, seconds=float(outcome.seconds), ok=outcome.code == 0, rollback=outcome.rollback, error=error
    )


# A restore that failed with one of these leaves the process checkpointed for good: the driver
# refuses every later restore (CUDA_ERROR_OPERATING_SYSTEM) and the unlock, and a CUDA call of the
# process never returns. Each was measured on driver 580; a restore refused for its arguments (e.g.
# a GPU pair, CUDA_ERROR_INVALID_VALUE) leaves it restorable (fact `failed-restore-stays-checkpointed`).
_LOSING_RESTORE_FAILURES = {
    "CUDA_ERROR_OUT_OF_MEMORY": "the GPU had too little free memory for the restore, and after a restore "
    "failed the driver refuses every later one (fact `restore-without-room-loses-process` in docs/facts.md)",
    "CUDA_ERROR_OPERATING_SYSTEM": "the driver refuses every restore of a process after one failed "
    "(fact `cumem-host-memory-unrestorable` in docs/facts.md)",
}


def process_lost(outcomes: Sequence[_C.StepOutcome]) -> str | None:
    """Why a failed restore among the outcomes left the process unable ever to run CUDA again, with
    what to do; None when none did."""
    for outcome in outcomes:
        why = _LOSING_RESTORE_FAILURES.get(outcome.error_name) if outcome.step == "restore" else None
        if why is not None:
            return f"{why}, so it can never run CUDA again; end the job and start it again from its last checkpoint"
    return None


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
    if step == "room":
        return (
            f"phase 'room' failed: {outcome.error_text}: another process took memory there while the job was "
            "checkpointed, so the restore was not tried (it would have lost the job, fact "
            "`restore-without-room-loses-process` in docs/facts.md)"
        )
    text = f"phase '{step}' failed: {_STEP_CALLS.get(step, step)} returned {name} ({outcome.error_text})"
    if step == "lock" and name == "CUDA_ERROR_TIMEOUT":
        text += " (the process stayed busy in CUDA work past the lock timeout; try again)"
    return text
