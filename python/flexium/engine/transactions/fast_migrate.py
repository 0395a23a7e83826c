"""A migration on the fast path: at a safe point, holding the GIL, the pool's segments are
copied to the target GPU and their source memory released, the driver's checkpoint carries only
the rest, and the copies are mapped back at their own addresses after the restore. A failure at
any step rolls back to the source and names the step."""

from __future__ import annotations

import time
from dataclasses import replace

from flexium import _C
from flexium.engine.fast import checksum
from flexium.engine.fast.device_moves import Staged, close_fds
from flexium.engine.fast.path import FastPath
from flexium.engine.fast.steps import RelocationError
from flexium.engine.identity import MovePlan
from flexium.engine.operations import EngineState, GpuIdentity, OperationKind, OperationResult
from flexium.engine.step_outcomes import describe_failure, first_failure, own_restore_succeeded, timing_of
from flexium.engine.transactions import locked_section
from flexium.engine.transactions.context import OperationContext
from flexium.engine.transactions.own_memory import OWN_SLICE_BYTES
from flexium.engine.transactions.results import GIB, ResultDraft, note_copied, settle


def migrate_fast(ctx: OperationContext, fast: FastPath, plan: MovePlan, notes: tuple[str, ...]) -> OperationResult:
    started = time.perf_counter()
    source, dest = plan.move.source, plan.move.target
    ctx.set_state(EngineState.MIGRATING)
    prepare, moved, _by_gpu = locked_section.prepare(ctx, OperationKind.MIGRATE)
    target_ordinal = ctx.identity.logical_on(dest.uuid)
    assert target_ordinal is not None, f"{dest.uuid} has no ordinal in this process"
    draft = ResultDraft(
        OperationKind.MIGRATE, "fast", ctx.logical_device, source, dest, moved, started, notes, steps=[prepare]
    )

    live = fast.pool.live_ranges(ctx.logical)  # one snapshot of PyTorch's allocator for both steps
    before, timing, unchecked = checksum.before_the_move(ctx.logical, live)
    draft.steps.extend([timing] if timing is not None else [])
    draft.notes = (*draft.notes, *([unchecked] if unchecked else []))
    try:
        staged, timing = fast.stage_to_device(ctx.logical, target_ordinal, live, checksum_copies=before is not None)
        draft.steps.append(timing)
    except RelocationError as exc:
        draft.steps.append(exc.timing)
        ctx.set_state(EngineState.RUNNING)
        return draft.build(
            failed_step=exc.step, error=f"{exc}; nothing moved: the job runs on {source.device} as before"
        )
    draft.notes = (*draft.notes, note_copied(staged))
    if before is not None:
        try:
            draft.steps.append(
                checksum.verify(before, lambda: {e.address: e.checksum for e in staged.entries}, staged.checksum_s)
            )
        except RelocationError as exc:
            draft.steps.append(exc.timing)
            close_fds(staged.entries)
            ctx.set_state(EngineState.RUNNING)
            return draft.build(
                failed_step=exc.step,
                error=f"{exc}; nothing moved: the job runs on {source.device} as before. {checksum.ADVICE}",
            )
    try:
        draft.steps.append(fast.release(ctx.logical))
    except RelocationError as exc:
        draft.steps.append(exc.timing)
        return _bring_home(ctx, fast, draft, exc.step, str(exc), staged, source)

    outcomes = locked_section.run(ctx, locked_section.migration_steps(ctx, plan), hold_gil=True)
    draft.steps.extend(map(timing_of, outcomes))
    final = locked_section.process_state(ctx)
    restored = own_restore_succeeded(outcomes)
    if restored:
        ctx.identity.apply(plan)
    if final == _C.ProcessState.RUNNING and restored:
        try:
            draft.steps.append(fast.map_back(staged, ctx.logical))
        except RelocationError as first:
            draft.steps.append(first.timing)
            try:  # once more: a segment that mapped stays mapped, the rest may go through now
                draft.steps.append(fast.map_back(staged, ctx.logical))
            except RelocationError as exc:
                draft.steps.append(exc.timing)
                ctx.set_state(EngineState.FAILED)
                return draft.build(
                    failed_step=exc.step,
                    error=f"{exc}; ROLLBACK FAILED: the job runs on {dest.device} but part of its memory is "
                    "not mapped back; restart the job",
                )
        ctx.set_state(EngineState.RUNNING)
        return draft.build(
            ok=True,
            notes=(
                "the moved memory becomes the job's own over the next optimizer steps "
                f"({OWN_SLICE_BYTES / GIB:.2f} GiB each)",
            ),
        )
    failure = first_failure(outcomes)
    if final == _C.ProcessState.RUNNING:
        return _bring_home(ctx, fast, draft, failure.step, describe_failure(failure), staged, source)
    return settle(
        ctx,
        draft,
        outcomes,
        final,
        succeeded=False,
        on_success=EngineState.RUNNING,
        rolled_back={},
        stuck=f", not RUNNING; its pool memory waits on {dest.device}",
    )


def _bring_home(
    ctx: OperationContext,
    fast: FastPath,
    draft: ResultDraft,
    failed_step: str,
    error: str,
    staged: Staged,
    source: GpuIdentity,
) -> OperationResult:
    """The job runs on its source GPU with some segments released: bring their data home."""
    try:
        draft.steps.append(fast.bring_home(staged, ctx.logical))
    except RelocationError as exc:
        draft.steps.append(replace(exc.timing, rollback=True))
        ctx.set_state(EngineState.FAILED)
        return draft.build(failed_step=failed_step, error=f"{error}; ROLLBACK FAILED: {exc}; restart the job")
    draft.steps[-1] = replace(draft.steps[-1], rollback=True)
    ctx.set_state(EngineState.RUNNING)
    return draft.build(
        failed_step=failed_step, error=f"{error}; rolled back: the job runs on {source.device} as before"
    )
