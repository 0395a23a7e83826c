"""Memory that came in through fds made the job's own. After a fast move the mapped copies are
imported memory: neither restorable by a driver checkpoint nor counted for this process by NVML.
After a driver restore the pool's memory cannot be exported to the copier process."""

from __future__ import annotations

from flexium import _C
from flexium.engine.fast.steps import RelocationError
from flexium.engine.operations import OperationKind, StepTiming
from flexium.engine.transactions.context import OperationContext
from flexium.errors import OperationFailedError

# Memory made the job's own per optimizer step after a fast move (fact `owning-memory-cost`).
OWN_SLICE_BYTES = 4 << 30


def own_in_slices(ctx: OperationContext) -> None:
    """The segments get fresh memory of the job's own a slice at a time at the next optimizer steps, outside the
    operation's downtime (facts `imported-memory-cannot-ride-checkpoint`, `nvml-skips-imported-memory`,
    `restored-memory-unexportable` and `owning-memory-cost`). Should a slice fail, the rest waits: the driver path owns
    imported memory before its checkpoint, and a pause copies unexportable memory in this process."""
    fast = ctx.fast
    if fast is None or _C.vmm_segments_to_own() == 0:
        return
    logical = ctx.logical

    def own_a_slice() -> bool:
        if _C.vmm_segments_to_own() == 0:
            return False
        fast.own(logical, OWN_SLICE_BYTES)
        return _C.vmm_segments_to_own() > 0

    ctx.safe_points.between_operations(own_a_slice)


def own_before_driver_checkpoint(
    ctx: OperationContext, kind: OperationKind, at_safe_point: bool
) -> tuple[StepTiming, ...]:
    """Imported memory left by a fast move whose own step failed cannot be restored by a driver
    checkpoint (fact `imported-memory-cannot-ride-checkpoint`): it is made the job's own here, before a driver-path
    checkpoint, and only where no kernel can be launched on a segment while its memory is
    swapped: at a safe point or on the training thread."""
    if ctx.fast is None or _C.vmm_imported_count() == 0:
        return ()
    # The training thread itself (recoverable() after an error) launches nothing meanwhile either.
    if not (at_safe_point or ctx.safe_points.on_training_thread()):
        raise OperationFailedError(
            f"{kind.value} refused before anything was touched: part of the job's memory came in by an "
            "earlier fast move and must be made its own at an optimizer step before the driver's "
            f"checkpoint can carry it, and {ctx.safe_points.missed()}; try again while the job trains",
            step="validate",
        )
    try:
        return (ctx.fast.own(ctx.logical),)
    except RelocationError as exc:
        raise OperationFailedError(
            f"{kind.value} failed at phase 'own' before anything was locked: {exc}; the job keeps running "
            "on its GPU (the fast path can still move it)",
            step="own",
        ) from exc
