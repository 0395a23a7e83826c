"""A resume: the restore brings the job back, on its GPU or another of the same model; after a
fast pause the pool's segments then come back from host staging, which is kept for the next pause
when the pinned host memory budget allows (fast_path.py done_with_host), else given back."""

from __future__ import annotations

import time

from flexium import _C
from flexium.engine.fast_path import FastPath, RelocationError
from flexium.engine.identity import MovePlan
from flexium.engine.operations import EngineState, OperationKind, OperationResult
from flexium.engine.step_outcomes import own_restore_succeeded, restore_refused_for_good, timing_of
from flexium.engine.transactions import locked_section
from flexium.engine.transactions.context import OperationContext
from flexium.engine.transactions.results import ResultDraft, copier_notes, settle

LOST = (
    ": the driver refuses every restore of a process after one failed (docs/facts.md fact 26), so it can "
    "never run CUDA again; end the job and start it again from its last checkpoint"
)


def resume(ctx: OperationContext, plan: MovePlan) -> OperationResult:
    started = time.perf_counter()
    source, dest = plan.move.source, plan.move.target
    ctx.set_state(EngineState.RESUMING)
    # Paused by the fast path: the pool's segments wait in pinned host memory, and no other
    # thread may touch them before they are back.
    fast = ctx.fast if ctx.fast is not None and ctx.fast.host_waiting() > 0 else None
    if fast is not None:
        fast.wake_for_restore(dest.uuid)  # pins while the restore runs
    outcomes = locked_section.run(ctx, locked_section.resume_steps(plan), hold_gil=fast is not None)
    final = locked_section.process_state(ctx)
    succeeded = final == _C.ProcessState.RUNNING and own_restore_succeeded(outcomes)
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
    # A restore the driver refused for good leaves nothing to resume: saying "can be resumed again"
    # would be untrue.
    lost = restore_refused_for_good(outcomes)
    return settle(
        ctx,
        draft,
        outcomes,
        final,
        succeeded=succeeded,
        on_success=EngineState.RUNNING,
        rolled_back={}
        if lost
        else {_C.ProcessState.CHECKPOINTED: (EngineState.PAUSED, "the job is still paused and can be resumed again")},
        stuck=LOST if lost else "",
    )


def _bring_back_from_host(ctx: OperationContext, fast: FastPath, draft: ResultDraft) -> OperationResult:
    """After a restore that ended a fast pause: the segments come back from host memory, whose
    staging is then kept or given back. A copy that fails is tried once more."""
    assert draft.target is not None
    for attempt in range(2):
        try:
            _, timing = fast.restore_from_host(ctx.logical, draft.target.uuid)
            draft.steps.append(timing)
            break
        except RelocationError as exc:
            draft.steps.append(exc.timing)
            if attempt == 1:
                ctx.set_state(EngineState.FAILED)
                return draft.build(
                    failed_step=exc.step,
                    error=f"{exc}; ROLLBACK FAILED: the job runs on {draft.target.device} but part of its memory is "
                    "still in host memory; restart the job",
                )
    notes = copier_notes(fast)
    fast.done_with_host()
    ctx.set_state(EngineState.RUNNING)
    return draft.build(ok=True, notes=notes)
