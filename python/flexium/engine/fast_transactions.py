"""The fast path's transactions, mixed into Engine (engine.py): fast_path.py moves the memory
pool's segments itself at a safe point (to the target GPU, or to host memory for a pause) and the
driver's checkpoint carries only the rest. Each ends with the job RUNNING where it was, RUNNING on
its target, or paused; a failure at any step rolls back to the source and names the step."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Optional

from flexium import _C
from flexium.engine.fast_path import FastPath, RelocationError, Staged
from flexium.engine.operations import EngineState, GpuIdentity, OperationKind, OperationResult, StepTiming
from flexium.engine.step_outcomes import describe_failure, first_failure, own_restore_succeeded, timing_of
from flexium.errors import OperationFailedError

if TYPE_CHECKING:
    from flexium.engine.identity import IdentityMap
    from flexium.engine.safe_point import SafePoints

GIB = 1 << 30
# Memory made the job's own per optimizer step after a fast move (H200s: about 4.4 ms per GiB).
OWN_SLICE_BYTES = 4 << 30


class FastTransactions:
    if TYPE_CHECKING:  # Engine's, which these transactions share with the driver path's
        _fast: Optional[FastPath]
        _logical: int
        _pid: int
        _identity: IdentityMap
        _safe_points: SafePoints
        _paused_bytes: int

        @property
        def logical_device(self) -> str: ...

        def _set_state(self, state: EngineState) -> None: ...

        def _prepare(self, kind: OperationKind) -> tuple[StepTiming, int]: ...

        def _result(self, kind: OperationKind, source: GpuIdentity, target: Optional[GpuIdentity],
                    steps: tuple[StepTiming, ...], moved: int, started: float, notes: tuple[str, ...] = (),
                    path: str = "driver") -> OperationResult: ...

        def _run_steps(self, steps: list[_C.Step], rollbacks: list[list[_C.Step]], *,
                       hold_gil: bool = False) -> list[_C.StepOutcome]: ...

        def _migration_steps(self, pairs: list[tuple[str, str]]) -> tuple[list[_C.Step], list[list[_C.Step]]]: ...

        def _pause_steps(self) -> tuple[list[_C.Step], list[list[_C.Step]]]: ...

    def _run_fast_migration(
        self, source: GpuIdentity, dest: GpuIdentity, pairs: list[tuple[str, str]], notes: tuple[str, ...]
    ) -> OperationResult:
        assert self._fast is not None
        fast = self._fast
        started = time.perf_counter()
        self._set_state(EngineState.MIGRATING)
        prepare, moved = self._prepare(OperationKind.MIGRATE)
        target_ordinal = self._identity.logical_on(dest.uuid)
        assert target_ordinal is not None, f"{dest.uuid} has no ordinal in this process"
        steps: list[StepTiming] = [prepare]

        def result(**changes: object) -> OperationResult:
            base = self._result(OperationKind.MIGRATE, source, dest, tuple(steps), moved, started, notes, path="fast")
            return replace(base, **changes)  # type: ignore[arg-type]

        try:
            staged, timing = fast.stage_to_device(self._logical, target_ordinal)
            steps.append(timing)
        except RelocationError as exc:
            steps.append(exc.timing)
            self._set_state(EngineState.RUNNING)
            return result(failed_step=exc.step, error=f"{exc}; nothing moved: the job runs on {source.device} as before")
        copied = note_copied(staged)
        try:
            steps.append(fast.release(self._logical))
        except RelocationError as exc:
            steps.append(exc.timing)
            return self._fast_rollback(result, steps, exc.step, str(exc), staged, source, (*notes, copied))

        outcomes = self._run_steps(*self._migration_steps(pairs), hold_gil=True)
        steps.extend(map(timing_of, outcomes))
        final = _C.process_state(self._pid)
        restored = own_restore_succeeded(outcomes)
        if restored:
            self._identity.apply(pairs)
        if final == _C.ProcessState.RUNNING and restored:
            try:
                steps.append(fast.map_back(staged, self._logical))
            except RelocationError as first:
                steps.append(first.timing)
                try:  # once more: a segment that mapped stays mapped, the rest may go through now
                    steps.append(fast.map_back(staged, self._logical))
                except RelocationError as exc:
                    steps.append(exc.timing)
                    self._set_state(EngineState.FAILED)
                    return result(
                        failed_step=exc.step, notes=(*notes, copied),
                        error=f"{exc}; ROLLBACK FAILED: the job runs on {dest.device} but part of its memory is "
                        "not mapped back; restart the job",
                    )
            self._set_state(EngineState.RUNNING)
            return result(ok=True, notes=(*notes, copied, "the moved memory becomes the job's own over the next "
                                          f"optimizer steps ({OWN_SLICE_BYTES / GIB:.2f} GiB each)"))
        failure = first_failure(outcomes)
        if final == _C.ProcessState.RUNNING:
            return self._fast_rollback(result, steps, failure.step, describe_failure(failure), staged, source, (*notes, copied))
        self._set_state(EngineState.FAILED)
        return result(
            failed_step=failure.step, notes=(*notes, copied),
            error=f"{describe_failure(failure)}; ROLLBACK FAILED: the process is {final.name}, not RUNNING; its pool memory "
            f"waits on {dest.device}",
        )

    def _own_in_slices(self) -> None:
        """After a fast move the mapped copies came in through fds: imported memory is neither
        restorable by a driver checkpoint nor counted for this process by NVML. After a driver
        restore the pool's memory cannot be exported to the copier process. Either way the
        segments get fresh memory of the job's own a slice at a time at the next optimizer steps,
        outside the operation's downtime (H200: 0.28 s for 64 GiB in one go). Should a slice fail,
        the rest waits: the driver path owns imported memory before its checkpoint, and a pause
        copies unexportable memory in this process."""
        if self._fast is None or _C.vmm_segments_to_own() == 0:
            return
        fast, logical = self._fast, self._logical

        def own_a_slice() -> bool:
            if _C.vmm_segments_to_own() == 0:
                return False
            fast.own(logical, OWN_SLICE_BYTES)
            return _C.vmm_segments_to_own() > 0

        self._safe_points.between_operations(own_a_slice)

    def _own_before_driver_checkpoint(self, kind: OperationKind, at_safe_point: bool) -> tuple[StepTiming, ...]:
        """Imported memory left by a fast move whose own step failed cannot be restored by a driver
        checkpoint (docs/fast-path.md): it is made the job's own here, before a driver-path
        checkpoint, and only where no kernel can be launched on a segment while its memory is
        swapped: at a safe point or on the training thread."""
        if self._fast is None or _C.vmm_imported_count() == 0:
            return ()
        # The training thread itself (recoverable() after an error) launches nothing meanwhile either.
        if not (at_safe_point or self._safe_points.on_training_thread()):
            raise OperationFailedError(
                f"{kind.value} refused before anything was touched: part of the job's memory came in by an "
                "earlier fast move and must be made its own at an optimizer step before the driver's "
                f"checkpoint can carry it, and {self._safe_points.missed()}; try again while the job trains",
                step="validate",
            )
        try:
            return (self._fast.own(self._logical),)
        except RelocationError as exc:
            raise OperationFailedError(
                f"{kind.value} failed at step 'own' before anything was locked: {exc}; the job keeps running "
                "on its GPU (the fast path can still move it)",
                step="own",
            ) from exc

    def _fast_rollback(
        self,
        result: Callable[..., OperationResult],
        steps: list[StepTiming],
        failed_step: str,
        error: str,
        staged: Staged,
        source: GpuIdentity,
        notes: tuple[str, ...],
    ) -> OperationResult:
        """The job runs on its source GPU with some segments released: bring their data home."""
        assert self._fast is not None
        try:
            steps.append(self._fast.bring_home(staged, self._logical))
        except RelocationError as exc:
            steps.append(replace(exc.timing, rollback=True))
            self._set_state(EngineState.FAILED)
            return result(failed_step=failed_step, notes=notes, error=f"{error}; ROLLBACK FAILED: {exc}; restart the job")
        steps[-1] = replace(steps[-1], rollback=True)
        self._set_state(EngineState.RUNNING)
        return result(
            failed_step=failed_step, notes=notes, error=f"{error}; rolled back: the job runs on {source.device} as before"
        )

    def _run_fast_pause(self, source: GpuIdentity, notes: tuple[str, ...] = ()) -> OperationResult:
        assert self._fast is not None
        fast = self._fast
        started = time.perf_counter()
        self._set_state(EngineState.PAUSING)
        prepare, moved = self._prepare(OperationKind.PAUSE)
        steps: list[StepTiming] = [prepare]

        def result(**changes: object) -> OperationResult:
            base = self._result(OperationKind.PAUSE, source, None, tuple(steps), moved, started, notes, path="fast")
            return replace(base, **changes)  # type: ignore[arg-type]

        def undo(failed_step: str, error: str) -> OperationResult:
            try:
                _, timing = fast.restore_from_host(self._logical, source.uuid, step="rollback_copy")
                steps.append(replace(timing, rollback=True))
            except RelocationError as exc:
                steps.append(replace(exc.timing, rollback=True))
                self._set_state(EngineState.FAILED)
                return result(failed_step=failed_step, error=f"{error}; ROLLBACK FAILED: {exc}; restart the job")
            fast.release_host_later()
            self._set_state(EngineState.RUNNING)
            return result(failed_step=failed_step, error=f"{error}; rolled back: the job runs on {source.device} as before")

        try:
            copied, timing = fast.stage_to_host(self._logical)
            steps.append(timing)
        except RelocationError as exc:
            steps.append(exc.timing)
            fast.release_host_later()
            self._set_state(EngineState.RUNNING)
            return result(failed_step=exc.step, error=f"{exc}; nothing moved: the job runs on {source.device} as before")
        notes = (*notes, f"fast path: copied {copied / GIB:.2f} GiB in use of {fast.pool_bytes(self._logical) / GIB:.2f} "
                 "GiB of pool segments to host memory")
        try:
            steps.append(fast.release(self._logical))
        except RelocationError as exc:
            steps.append(exc.timing)
            return undo(exc.step, str(exc))
        outcomes = self._run_steps(*self._pause_steps(), hold_gil=True)
        steps.extend(map(timing_of, outcomes))
        final = _C.process_state(self._pid)
        if final == _C.ProcessState.CHECKPOINTED and not any(o.code for o in outcomes):
            steps.append(fast.copier_asleep())
            self._paused_bytes = moved
            self._set_state(EngineState.PAUSED)
            return result(ok=True, notes=(*notes, *copier_notes(fast)))
        failure = first_failure(outcomes)
        if final == _C.ProcessState.RUNNING:
            return undo(failure.step, describe_failure(failure))
        self._set_state(EngineState.FAILED)
        return result(
            failed_step=failure.step,
            error=f"{describe_failure(failure)}; ROLLBACK FAILED: the process is {final.name}; its pool memory is in host memory",
        )

    def _bring_back_from_host(self, result: OperationResult, dest: GpuIdentity) -> OperationResult:
        """After a restore that ended a fast pause: the segments come back from host memory, whose
        staging is then given back."""
        assert self._fast is not None
        steps = list(result.steps)
        for attempt in range(2):
            try:
                _, timing = self._fast.restore_from_host(self._logical, dest.uuid)
                steps.append(timing)
                break
            except RelocationError as exc:
                steps.append(exc.timing)
                if attempt == 1:
                    self._set_state(EngineState.FAILED)
                    where = result.target.device if result.target is not None else self.logical_device
                    return replace(
                        result, steps=tuple(steps), failed_step=exc.step,
                        error=f"{exc}; ROLLBACK FAILED: the job runs on {where} but part of its memory is still in "
                        "host memory; restart the job",
                    )
        notes = copier_notes(self._fast)
        self._fast.release_host_later()
        self._set_state(EngineState.RUNNING)
        return replace(result, ok=True, steps=tuple(steps), notes=(*result.notes, *notes), seconds=result.seconds + sum(
            s.seconds for s in steps[len(result.steps):]))


def copier_notes(fast: FastPath) -> tuple[str, ...]:
    """Says when the copies ran in this process because the copier failed, once."""
    why, fast.copier_fallback = fast.copier_fallback, ""
    return (f"the copies to and from host memory ran in this process: {why}",) if why else ()


def note_copied(staged: Staged) -> str:
    return (
        f"fast path: copied {staged.copied_bytes / GIB:.2f} GiB in use of {staged.segment_bytes / GIB:.2f} GiB "
        f"in {len(staged.entries)} pool segments"
    )
