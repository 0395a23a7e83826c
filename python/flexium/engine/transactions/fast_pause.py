"""A pause on the fast path: at a safe point, holding the GIL, the pool's segments are copied to
host staging (kept pinned before the safe point, or made there: prepare_host_staging) and their GPU memory released;
the driver's checkpoint carries only the rest. A failure at any step copies them back and names
the step."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from flexium import _C
from flexium.engine.fast import checksum
from flexium.engine.fast.host_copier import written_staging_enabled
from flexium.engine.fast.host_staging import CopierCopy, HostCopy, PinnedAhead
from flexium.engine.fast.path import FastPath
from flexium.engine.fast.steps import RelocationError
from flexium.engine.operations import EngineState, GpuIdentity, OperationKind, OperationResult
from flexium.engine.step_outcomes import describe_failure, first_failure, timing_of
from flexium.engine.target_rules import check_host_room
from flexium.engine.transactions import locked_section
from flexium.engine.transactions.context import OperationContext
from flexium.engine.transactions.results import GIB, ResultDraft, copier_notes
from flexium.errors import OperationFailedError
from flexium.units import gib, gib_or_mib


@dataclass(frozen=True)
class StagingPlan:
    """How a pause gets its host staging: `notes` of what was pinned before its safe point, or,
    `at_safe_point`, made there with the job stopped (stop first, then stream)."""

    notes: tuple[str, ...] = ()
    at_safe_point: bool = False


def prepare_host_staging(ctx: OperationContext, fast: FastPath, source: GpuIdentity) -> StagingPlan:
    """Before a pause that can take the fast path, while the job trains: refuses it when the host
    cannot hold the pool's live bytes. A staging kept pinned for the pause is topped up here;
    one not kept is made at the safe point: touching beside training runs at half the speed
    (fact `training-slows-staging-prep`) and a paused job's downtime does not matter, the time to
    a free GPU does (docs/fast-path.md)."""
    logical = ctx.logical
    wanted = fast.host_bytes_wanted(logical)
    to_map = fast.host_bytes_to_map(wanted)
    check_host_room(to_map, fast=True)
    if not fast.kept_on(source.uuid):
        return StagingPlan(at_safe_point=True)
    ahead = fast.kept_pinning(source.uuid)
    if ahead is None or not ahead.complete or to_map > 0:
        # Kept, but still being pinned ahead (a young job's first pause, or just after a resume), or
        # grown since: waiting for that pinning, with its breaks for the job's CUDA calls, would take
        # longer than streaming the rest at the safe point with the job stopped.
        return StagingPlan(notes=(streaming_kept(ahead, wanted, fast.kept_in_part),), at_safe_point=True)
    try:
        reserved = fast.reserve_host(logical, wanted, source.uuid)
    except Exception as exc:
        fast.release_host_later()
        raise OperationFailedError(
            f"pause failed at phase 'pin' before anything was touched: could not prepare host staging "
            f"({type(exc).__name__}: {exc}); the job keeps training",
            step="pin",
        ) from exc
    if reserved.pinned == 0:
        return StagingPlan()
    phases = f"; {reserved.phases}" if reserved.phases else ""
    pinner = f"; its pinning ahead: {ahead.pinner}" if ahead.pinner else ""
    return StagingPlan(
        (
            f"pinned {gib(reserved.pinned, 2)} of host staging {reserved.where} in {reserved.seconds:.2f} s before "
            f"the safe point ({gib(to_map, 2)} of it newly mapped and touched, {gib(reserved.newly_pinned, 2)} newly "
            f"pinned{phases}{pinner})",
        )
    )


def streaming_kept(ahead: PinnedAhead | None, wanted: int, in_part: str = "") -> str:
    """Why a pause that found its staging kept streams it at its safe point, and how far it was pinned;
    `in_part`: why only part of it is kept (FastPath.kept_in_part)."""
    if ahead is None:
        return (
            "the staging kept for pauses: its copier did not say how far it had pinned it (busy, or stopped as it "
            f"failed): what is not pinned is {rest_at_safe_point(new=False)}, at the safe point"
        )
    if not ahead.complete:
        state = "still being pinned ahead" if ahead.pinning else f"pinned only in part ({ahead.pinner})"
        return (
            f"the staging kept for pauses was {state}: {gib(ahead.pinned, 2)} of {gib(ahead.staging, 2)} pinned when "
            f"the pause was asked for; the rest is {rest_at_safe_point(new=False)}, at the safe point"
        )
    if in_part:
        return (
            f"the staging kept for pauses holds {gib_or_mib(ahead.staging)}, pinned, of the {gib_or_mib(wanted)} the "
            f"pool needs (only that part is kept, as {in_part}): it is copied at once, and the rest "
            f"{rest_at_safe_point(new=True)}, at the safe point"
        )
    return (
        f"the staging kept for pauses ({gib(ahead.staging, 2)}, pinned) is short of the {gib(wanted, 2)} the pool "
        f"needs now: the rest is {rest_at_safe_point(new=True)}, at the safe point"
    )


def rest_at_safe_point(*, new: bool) -> str:
    """How a pause's copies take what its kept staging has not pinned: memory mapped at the safe point
    (`new`), or the kept staging's own chunks, of which those the copier has not touched yet are written
    as a staging made at the safe point is (docs/fast-path.md, "Written at the safe point")."""
    if written_staging_enabled():
        return (
            "mapped and written as the copies reach it"
            if new
            else "pinned as the copies reach it, or written where not touched yet"
        )
    return "mapped and pinned as the copies reach it" if new else "pinned as the copies reach it"


def note_made(host: HostCopy, mapped: int) -> tuple[str, ...]:
    """Where a copy step that made its staging spent its time, for the benchmark and the log."""
    made = host.made
    if made is None:
        return ()
    phases = f"; {made.phases}" if made.phases else ""
    by_copier = host.by_copier
    written = by_copier is not None and by_copier.written > 0
    if by_copier is None:
        pinned = "then pinned and copied in this process"
    elif written and not by_copier.pinned:
        pinned = f"then wrote {gib(by_copier.written, 2)}{through(by_copier)} as the copies came, nothing of it pinned"
    else:
        pinned = (
            f"then pinned {gib(by_copier.pinned, 2)} in {by_copier.pin_s:.2f} s as the copies reached it (of which "
            f"{by_copier.touch_wait_s:.2f} s waiting for the touching)"
        ) + (f" and wrote {gib(by_copier.written, 2)}{through(by_copier)}, not pinned" if written else "")
    ahead = f" (its pinning ahead: {made.pinning_before})" if made.found_pinned and made.pinning_before else ""
    streamed = f", {gib(made.staging - made.found_pinned, 2)} streamed" if made.staging else ""
    by_driver = f", {gib(made.made_by_driver, 2)} made by the driver ahead" if made.made_by_driver else ""
    made_how = "written" if written else "touched"
    return (
        f"made the host staging {made.where} at the safe point in {made.seconds:.2f} s ({gib(mapped, 2)} of it "
        f"newly mapped and {made_how}{by_driver}, {gib(made.found_pinned, 2)} found pinned{ahead}{streamed}"
        f"{phases}), {pinned}, copies {host.copy_s:.2f} s",
    )


def through(copy: CopierCopy) -> str:
    """The buffers a copier's writes went through (FLEXIUM_WRITE_BUFFER), as the notes say it."""
    if not copy.write_buffer:
        return ""
    size = copy.write_buffer
    return f" through {size >> 20} MiB buffers" if size % (1 << 20) == 0 else f" through {size >> 10} KiB buffers"


def pause_fast(ctx: OperationContext, fast: FastPath, source: GpuIdentity, staging: StagingPlan) -> OperationResult:
    started = time.perf_counter()
    ctx.set_state(EngineState.PAUSING)
    prepare, moved, by_gpu = locked_section.prepare(ctx, OperationKind.PAUSE)
    draft = ResultDraft(
        OperationKind.PAUSE, "fast", ctx.logical_device, source, None, moved, started, staging.notes, steps=[prepare]
    )

    def undo(failed_step: str, error: str) -> OperationResult:
        try:
            _, timing = fast.restore_from_host(ctx.logical, source.uuid, step="rollback_copy")
            draft.steps.append(replace(timing, rollback=True))
        except RelocationError as exc:
            draft.steps.append(replace(exc.timing, rollback=True))
            ctx.set_state(EngineState.FAILED)
            return draft.build(failed_step=failed_step, error=f"{error}; ROLLBACK FAILED: {exc}; restart the job")
        fast.done_with_host()
        ctx.set_state(EngineState.RUNNING)
        return draft.build(
            failed_step=failed_step, error=f"{error}; rolled back: the job runs on {source.device} as before"
        )

    live = fast.pool.live_ranges(ctx.logical)  # one snapshot of PyTorch's allocator for both steps
    before, timing, unchecked = checksum.before_the_move(ctx.logical, live)
    draft.steps.extend([timing] if timing is not None else [])
    draft.notes = (*draft.notes, *([unchecked] if unchecked else []))
    wanted = fast.host_bytes_wanted(ctx.logical, stopped=True, live=live) if staging.at_safe_point else 0
    to_map = fast.host_bytes_to_map(wanted) if staging.at_safe_point else 0
    try:
        host, timing = fast.stage_to_host(ctx.logical, live, make_for=source.uuid if staging.at_safe_point else None)
        draft.steps.append(timing)
    except RelocationError as exc:
        draft.steps.append(exc.timing)
        fast.done_with_host()
        ctx.set_state(EngineState.RUNNING)
        return draft.build(
            failed_step=exc.step, error=f"{exc}; nothing moved: the job runs on {source.device} as before"
        )
    draft.notes = (
        *draft.notes,
        *note_made(host, to_map),
        f"fast path: copied {host.copied / GIB:.2f} GiB in use of "
        f"{fast.pool_bytes(ctx.logical) / GIB:.2f} GiB of pool segments to host memory",
    )
    try:
        draft.steps.append(fast.release(ctx.logical))
    except RelocationError as exc:
        draft.steps.append(exc.timing)
        return undo(exc.step, str(exc))
    outcomes, final = checkpoint_the_rest(ctx, fast, draft, moved, by_gpu)
    if ctx.state == EngineState.PAUSED:
        ctx.paused_checksums = before  # verified where the bytes land again, at the resume
        return draft.build(ok=True, notes=copier_notes(fast))
    failure = first_failure(outcomes)
    if final == _C.ProcessState.RUNNING:
        return undo(failure.step, describe_failure(failure))
    ctx.set_state(EngineState.FAILED)
    return draft.build(
        failed_step=failure.step,
        error=f"{describe_failure(failure)}; ROLLBACK FAILED: the process is {final.name}; "
        "its pool memory is in host memory",
    )


def checkpoint_the_rest(
    ctx: OperationContext, fast: FastPath, draft: ResultDraft, held: int, by_gpu: dict[str, int]
) -> tuple[list[_C.StepOutcome], _C.ProcessState]:
    """With the pool's segments in host memory: the driver checkpoints the rest of the process and
    the copier lets go of the GPU; once CHECKPOINTED the job is PAUSED, holding `held` bytes (by
    GPU UUID `by_gpu`) for its resume. The outcomes and the process state, for a caller's failure."""
    outcomes = locked_section.run(ctx, locked_section.pause_steps(ctx), hold_gil=True)
    draft.steps.extend(map(timing_of, outcomes))
    final = locked_section.process_state(ctx)
    if final == _C.ProcessState.CHECKPOINTED and not any(o.code for o in outcomes):
        draft.steps.append(fast.copier_asleep())
        ctx.paused_bytes = held
        ctx.paused_by_gpu = by_gpu
        ctx.set_state(EngineState.PAUSED)
    return outcomes, final
