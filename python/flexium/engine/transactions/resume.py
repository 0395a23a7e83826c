"""A resume: the restore brings the job back, on its GPU or another of the same model; after a
fast pause the pool's segments then come back from host staging, which is kept for the next pause
when the pinned host memory budget allows (fast/path.py done_with_host), else given back."""

from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

from flexium import _C
from flexium.engine.fast import checksum
from flexium.engine.fast.path import FastPath
from flexium.engine.fast.steps import RelocationError
from flexium.engine.identity import MovePlan
from flexium.engine.operations import EngineState, OperationKind, OperationResult
from flexium.engine.step_outcomes import describe_failure, first_failure, own_restore_succeeded, timing_of
from flexium.engine.transactions import locked_section
from flexium.engine.transactions.context import OperationContext
from flexium.engine.transactions.fast_pause import checkpoint_the_rest
from flexium.engine.transactions.results import ResultDraft, copier_notes, overlap_notes, settle
from flexium.errors import DriverError
from flexium.units import gib

STILL_PAUSED = "the job is still paused and can be resumed again"
# A restore that failed otherwise: every such failure measured left the process unrestorable, which
# only the next restore shows (CUDA_ERROR_OPERATING_SYSTEM: step_outcomes.process_lost).
MAYBE_LOST = (
    "the job is still paused, but every restore failure measured other than a refused argument left the "
    "process unable to restore again (fact `restore-without-room-loses-process` in docs/facts.md): resume it "
    "once more; if that fails with CUDA_ERROR_OPERATING_SYSTEM, the job is lost and must be started again from "
    "its last checkpoint"
)
# The one case a restore refused for its arguments does not cover: memory imported from another
# process that flexium cannot see (uncheckpointable_memory.py finds PyTorch's imports only).
UNLESS_IMPORTED = (
    ", unless this process holds CUDA memory imported from another process outside PyTorch (CuPy, cuIpcOpenMemHandle): "
    "the driver cannot restore such a process (fact `ipc-import-unrestorable` in docs/facts.md), the next resume then "
    "fails with CUDA_ERROR_OPERATING_SYSTEM, and the job must be started again from its last checkpoint"
)


def resume(ctx: OperationContext, plan: MovePlan) -> OperationResult:
    started = time.perf_counter()
    source, dest = plan.move.source, plan.move.target
    ctx.set_state(EngineState.RESUMING)
    # Paused by the fast path: the pool's segments wait in pinned host memory, and no other
    # thread may touch them before they are back.
    fast = ctx.fast if ctx.fast is not None and ctx.fast.host_waiting() > 0 else None
    if fast is not None:  # pins, and makes the pool's memory, while the restore runs
        fast.wake_for_restore(dest.uuid, coming=ctx.paused_bytes, fill_for=ctx.logical)
    try:
        outcomes = locked_section.run(ctx, locked_section.resume_steps(plan), hold_gil=fast is not None)
    except BaseException:
        if fast is not None:  # the copier's memory goes with the fill's fds, and the copier lets go of the GPU
            fast.call_off_fill()
        raise
    final = locked_section.process_state(ctx)
    succeeded = final == _C.ProcessState.RUNNING and own_restore_succeeded(outcomes)
    if fast is not None and not succeeded:
        fast.call_off_fill()
    if succeeded:
        ctx.identity.apply(plan)
    draft = ResultDraft(
        OperationKind.RESUME,
        "fast" if fast is not None else "driver",
        ctx.logical_device,
        source,
        dest,
        ctx.paused_bytes,
        started,
        steps=list(map(timing_of, outcomes)),
    )
    if succeeded and fast is not None:
        return _bring_back_from_host(ctx, fast, draft)
    # A restore that failed for its arguments leaves the job paused; one the driver will never redo
    # leaves it lost, which settle() says (step_outcomes.process_lost).
    return settle(
        ctx,
        draft,
        outcomes,
        final,
        succeeded=succeeded,
        on_success=EngineState.RUNNING,
        rolled_back={_C.ProcessState.CHECKPOINTED: (EngineState.PAUSED, _still_paused(outcomes))},
    )


def _still_paused(outcomes: list[_C.StepOutcome]) -> str:
    """What a failed restore that left the process checkpointed means for the job."""
    refused = [o for o in outcomes if o.step == "restore" and not o.rollback and o.code != 0]
    if refused and refused[0].error_name == "CUDA_ERROR_INVALID_VALUE":
        return STILL_PAUSED + UNLESS_IMPORTED
    return MAYBE_LOST


def _bring_back_from_host(ctx: OperationContext, fast: FastPath, draft: ResultDraft) -> OperationResult:
    """After a restore that ended a fast pause: the segments come back from host memory, whose
    staging is then kept or given back. A copy that fails, or whose bytes do not match those the
    job paused with (the staging still holds them), is tried once more; one that found too little
    room on the GPU (another process took it after the room check), or a second mismatch, pauses
    the job again."""
    assert draft.target is not None
    before = ctx.paused_checksums
    for attempt in range(2):
        try:
            _, timing = fast.restore_from_host(ctx.logical, draft.target.uuid)
            draft.steps.append(timing)
        except RelocationError as exc:
            draft.steps.append(exc.timing)
            if _out_of_memory(exc):
                # What came back (a fill mapped in part, imported memory the checkpoint cannot carry) waits in
                # the staging again, which still holds it, so that the job is paused with all of it there.
                came_back = any(s.mapped for s in _C.vmm_segments() if s.device == ctx.logical)
                failed = _back_to_staging(ctx, fast, draft, str(exc), failed_step=exc.step) if came_back else None
                if failed is not None:
                    return failed
                return _pause_again(ctx, fast, draft, str(exc), _taken_after_room_check(draft, ctx.paused_bytes))
            if attempt == 1:
                ctx.set_state(EngineState.FAILED)
                return draft.build(
                    failed_step=exc.step,
                    error=f"{exc}; ROLLBACK FAILED: the job runs on {draft.target.device} but part of its memory is "
                    "still in host memory; restart the job",
                )
            continue
        if before is None:
            break
        try:
            # A segment the job freed meanwhile (its free waited for the restore) is not there to check.
            present = checksum.of_present(
                before, {int(s.address) for s in _C.vmm_segments() if s.device == ctx.logical}
            )
            draft.steps.append(checksum.verify(present, partial(checksum.of_segments, ctx.logical, present.live)))
            break
        except RelocationError as exc:
            draft.steps.append(exc.timing)
            failed = _back_to_staging(ctx, fast, draft, str(exc))
            if failed is not None:
                return failed
            if attempt == 1:
                return _pause_again(ctx, fast, draft, str(exc), TWICE_MISMATCHED, failed_step="verify")
    ctx.paused_checksums = None
    notes = (*overlap_notes(fast), *copier_notes(fast))
    fast.done_with_host()
    ctx.set_state(EngineState.RUNNING)
    return draft.build(ok=True, notes=notes)


def _back_to_staging(
    ctx: OperationContext, fast: FastPath, draft: ResultDraft, error: str, failed_step: str = "verify"
) -> OperationResult | None:
    """After a copy back whose bytes did not check out, or that found too little room: the memory it
    made goes and the segments wait in the staging again, which still holds what the job paused
    with. A result only if that failed."""
    try:
        draft.steps.append(replace(fast.release(ctx.logical), rollback=True))
        _C.restage_released_segments()
    except (RelocationError, RuntimeError) as exc:
        ctx.set_state(EngineState.FAILED)
        return draft.build(
            failed_step=failed_step,
            error=f"{error}; ROLLBACK FAILED: the copy back could not be undone ({exc}); restart the job",
        )
    return None


TWICE_MISMATCHED = (
    "; the bytes copied back from host memory differed twice from those the job paused with: the job is paused again, "
    "its memory still in host memory. Resume it again (on another GPU too); if it fails the same way, the host's "
    "memory no longer holds what the job paused with: restart the job from its last checkpoint"
)


def _taken_after_room_check(draft: ResultDraft, paused_bytes: int) -> str:
    assert draft.target is not None
    return (
        f": another process took memory on {draft.target.device} after the room check; the job is paused again, its "
        f"memory in host memory: free {gib(paused_bytes, 2)} there and resume it, or resume it on another GPU"
    )


def _out_of_memory(exc: RelocationError) -> bool:
    cause = exc.__cause__
    return isinstance(cause, DriverError) and cause.error_name == "CUDA_ERROR_OUT_OF_MEMORY"


def _pause_again(
    ctx: OperationContext, fast: FastPath, draft: ResultDraft, error: str, then: str, failed_step: str = "copy_back"
) -> OperationResult:
    """The restore brought the job back without its pool, which is still in host memory: the
    driver checkpoints the rest again (a small image), and the job is paused as before, on the
    GPU it was resumed on. `error` says what went wrong, `then` what it means once paused again."""
    assert draft.target is not None
    outcomes, final = checkpoint_the_rest(ctx, fast, draft, ctx.paused_bytes, {draft.target.uuid: ctx.paused_bytes})
    if ctx.state == EngineState.PAUSED:
        return draft.build(failed_step=failed_step, error=f"{error}{then}")
    ctx.set_state(EngineState.FAILED)
    failure = first_failure(outcomes) if any(o.code for o in outcomes) else None
    why = describe_failure(failure) if failure is not None else f"the process is {final.name}"
    return draft.build(
        failed_step=failed_step,
        error=f"{error}; pausing the job again failed ({why}); ROLLBACK FAILED: part of its memory is still in host "
        "memory; restart the job",
    )
