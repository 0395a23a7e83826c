"""migrate / pause / resume of this process, each a transaction on the driver checkpoint API.

Every operation validates before touching anything, runs its locked section in one native call
(csrc/checkpoint.cpp says why), and ends with the process RUNNING on its source GPU, RUNNING on
its target, or (pause, failed resume) checkpointed and paused. Anything else raises
RollbackFailedError and is logged at CRITICAL.

Two paths: the fast path (fast_path.py) moves the memory pool's segments itself at a safe
point and leaves the driver only the rest; the driver path lets the checkpoint carry
everything. The fast path runs when the pool is in use and a safe point comes within the
bounded wait; otherwise, or when asked, the driver path does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional, Sequence

from flexium import _C
from flexium.engine import nvml, torch_bridge
from flexium.engine.capabilities import Capabilities
from flexium.engine.fast_path import FastPath, RelocationError, Staged, host_memory_available
from flexium.engine.identity import IdentityMap, Target
from flexium.engine.operations import (
    EngineState,
    GpuIdentity,
    OperationKind,
    OperationResult,
    StepTiming,
)
from flexium.engine.parking import Parking
from flexium.engine.safe_point import SafePoints
from flexium.errors import (
    CapabilityError,
    InvalidStateError,
    OperationFailedError,
    OperationInProgressError,
    RollbackFailedError,
    TargetRefusedError,
)

log = logging.getLogger("flexium")

GIB = 1 << 30
DEFAULT_LOCK_TIMEOUT_MS = 30_000
DEFAULT_SAFE_POINT_WAIT_SECONDS = 5.0
# Restore needs some room beyond the process's own bytes (driver bookkeeping on the target).
DEFAULT_MEMORY_MARGIN_BYTES = 512 << 20
# Memory made the job's own per optimizer step after a fast move (H200s: about 4.4 ms per GiB).
OWN_SLICE_BYTES = 4 << 30
# Host memory a pause leaves free beside what it stages.
HOST_MEMORY_MARGIN_BYTES = 1 << 30
PATHS = ("auto", "fast", "driver")


@dataclass(frozen=True)
class TargetCandidate:
    gpu: GpuIdentity
    free_bytes: int


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def snapshot_gpus() -> list[GpuIdentity]:
    """The visible GPUs as the driver reports them now: call before any migration."""
    nvml_index = {gpu.uuid: gpu.index for gpu in nvml.host_gpus()}
    return [
        GpuIdentity(
            ordinal=d.ordinal,
            uuid=d.uuid,
            name=d.name,
            total_memory=int(d.total_memory),
            pci_bus_id=d.pci_bus_id,
            nvml_index=nvml_index.get(d.uuid),
        )
        for d in _C.list_devices()
    ]


class Engine:
    def __init__(
        self,
        *,
        logical_ordinal: int,
        gpus: Sequence[GpuIdentity],
        capabilities: Capabilities,
        lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
        safe_point_wait_seconds: float = DEFAULT_SAFE_POINT_WAIT_SECONDS,
        memory_margin_bytes: int = DEFAULT_MEMORY_MARGIN_BYTES,
        fast_path: Optional[FastPath] = None,
    ) -> None:
        if not 0 <= logical_ordinal < len(gpus):
            raise ValueError(f"device cuda:{logical_ordinal} is not among the {len(gpus)} visible GPU(s)")
        self.capabilities = capabilities
        self.lock_timeout_ms = lock_timeout_ms
        self.memory_margin_bytes = memory_margin_bytes
        self._pid = os.getpid()
        self._logical = logical_ordinal
        self._identity = IdentityMap(gpus)
        self._state = EngineState.RUNNING
        self._state_lock = threading.Lock()
        self._operation_lock = threading.Lock()
        self._safe_points = SafePoints(safe_point_wait_seconds)
        self._parking = Parking()
        self._paused_bytes = 0
        self._fast = fast_path
        self._listeners: list[Callable[[EngineState], None]] = []
        self.last_result: Optional[OperationResult] = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._safe_points.install()
        nvml.start_reader()  # reads while the job is frozen (a resume's room check) take milliseconds
        if self._fast is not None and self._fast.pool.active:
            self._fast.warm_up()  # the copier process starts now, not in a pause's preparation

    def stop(self) -> None:
        """Unhooks; a job paused at shutdown is resumed in place so the process can exit."""
        self._safe_points.between_operations(None)
        self._safe_points.uninstall()
        if self.state == EngineState.PAUSED:
            try:
                self.resume()
            except Exception as exc:  # exiting anyway; say what happened
                log.error("could not resume the paused job at shutdown: %s", exc)
        self._parking.release()
        if self._fast is not None:
            self._fast.close()
        nvml.stop_reader()

    # ---- what the rest of flexium reads ----------------------------------------------------

    @property
    def state(self) -> EngineState:
        with self._state_lock:
            return self._state

    @property
    def gpus(self) -> tuple[GpuIdentity, ...]:
        return self._identity.gpus

    @property
    def logical_device(self) -> str:
        return f"cuda:{self._logical}"

    @property
    def safe_point_wait_seconds(self) -> float:
        return self._safe_points.wait_seconds

    def placement(self) -> tuple[str, GpuIdentity]:
        return self.logical_device, self._identity.physical_of(self._logical)

    def is_busy(self) -> bool:
        return self.state in (EngineState.MIGRATING, EngineState.PAUSING, EngineState.RESUMING)

    def add_state_listener(self, listener: Callable[[EngineState], None]) -> None:
        self._listeners.append(listener)

    def process_bytes(self) -> int:
        """GPU memory this process holds on every GPU, from NVML; PyTorch's reserved bytes where
        NVML cannot see processes (it then misses the context, a few hundred MiB). While the
        process is frozen it holds nothing on any GPU, and asking torch would block."""
        if nvml.is_frozen():
            return 0
        total = 0
        seen = False
        for gpu in nvml.host_gpus():
            used = gpu.used_by(self._pid)
            if used is not None:
                total += used
                seen = True
        return total if seen else torch_bridge.reserved_bytes()

    def footprint_bytes(self) -> int:
        """What the job needs on a GPU: what it holds now, or what it held when it was paused."""
        return self._paused_bytes if self.state == EngineState.PAUSED else self.process_bytes()

    def _bytes_on(self, gpu: GpuIdentity) -> Optional[int]:
        host = nvml.gpu_by_uuid(gpu.uuid)
        if host is None:
            return None
        return host.used_by(self._pid) or 0

    def candidate_targets(self) -> list[TargetCandidate]:
        """GPUs this job could move to now: same model, room for it; most free memory first."""
        _, source = self.placement()
        # One NVML reading for all GPUs: while frozen each reading is a child process.
        on_host = {gpu.uuid: gpu for gpu in nvml.host_gpus()}
        if self.state == EngineState.PAUSED:
            needed = self._paused_bytes
        else:
            source_host = on_host.get(source.uuid)
            needed = (source_host.used_by(self._pid) or 0) if source_host is not None else 0
        candidates = []
        for gpu in self._identity.gpus:
            host = on_host.get(gpu.uuid)
            if gpu.uuid == source.uuid or gpu.name != source.name or host is None:
                continue
            free = host.memory_free + (host.used_by(self._pid) or 0)
            if free >= needed + self.memory_margin_bytes:
                candidates.append(TargetCandidate(gpu=gpu, free_bytes=free))
        return sorted(candidates, key=lambda c: -c.free_bytes)

    # ---- operations ------------------------------------------------------------------------

    def migrate(self, target: Target, *, path: str = "auto") -> OperationResult:
        """Moves the job to `target`. `path`: "auto" (fast when possible), "fast" (refuse
        otherwise) or "driver"."""
        _check_path(path)
        with self._operation(OperationKind.MIGRATE, allowed=(EngineState.RUNNING,)):
            self._require(self.capabilities.migration, "migration to another GPU")
            source = self._identity.physical_of(self._logical)
            dest = self._identity.resolve(target)
            notes = self._validate_target(source, dest, needed=self._bytes_on(source))
            pairs = self._identity.pairs_to_move(self._logical, dest)

            def work(at_safe_point: bool) -> OperationResult:
                fast, why = self._choose_path(path, at_safe_point)
                if fast:
                    return self._run_fast_migration(source, dest, pairs, notes)
                return self._run_migration(source, dest, pairs, (*notes, *why), at_safe_point=at_safe_point)

            result, _ = self._safe_points.run(work)
            return self._finish(result)

    def pause(self, *, path: str = "auto") -> OperationResult:
        _check_path(path)
        with self._operation(OperationKind.PAUSE, allowed=(EngineState.RUNNING,)):
            self._require(self.capabilities.pause_resume, "pause")
            if self._safe_points.on_training_thread():
                raise InvalidStateError(
                    "pause() was called from the training thread: it would block at its next CUDA call "
                    "until resume(); call pause() from another thread (the flexium control thread does)"
                )
            source = self._identity.physical_of(self._logical)
            pinned = self._prepare_host_staging(path, source)

            def work(at_safe_point: bool) -> OperationResult:
                fast, why = self._choose_path(path, at_safe_point)
                if fast:
                    return self._run_fast_pause(source, pinned)
                if self._fast is not None:
                    self._fast.release_host_now()  # pinned staging would slow the driver's checkpoint
                return self._run_pause(source, why, at_safe_point=at_safe_point)

            result, at_safe_point = self._safe_points.run(work, then=self._park_while_paused)
            if not at_safe_point and result.ok:
                log.info("paused outside a safe point: the training thread waits in its next CUDA call")
            return self._finish(result)

    def resume(self, target: Optional[Target] = None) -> OperationResult:
        with self._operation(OperationKind.RESUME, allowed=(EngineState.PAUSED,)):
            source = self._identity.physical_of(self._logical)
            dest = self._choose_resume_target(source, target)
            if dest.uuid != source.uuid:
                self._require(self.capabilities.migration, "resuming on another GPU")
            pairs = self._identity.pairs_to_move(self._logical, dest) if dest.uuid != source.uuid else []

            def work() -> OperationResult:
                return self._run_resume(source, dest, pairs)

            result = self._parking.submit(work) if self._parking.occupied else work()
            return self._finish(result)

    # ---- validation ------------------------------------------------------------------------

    def _prepare_host_staging(self, path: str, source: GpuIdentity) -> tuple[str, ...]:
        """Before a pause that can take the fast path: refuses it when the host cannot hold the
        pool's live bytes, and touches and pins the staging before the safe point, while the job
        trains. A pause on the driver path is checked for host memory in _run_pause."""
        fast = self._fast if path != "driver" and self.fast_path_blocker() is None else None
        if fast is None:
            return ()
        wanted = fast.host_bytes_wanted(self._logical)
        to_map = fast.host_bytes_to_map(wanted)
        self._check_host_room(to_map, fast=True)
        try:
            pinned, seconds, where = fast.reserve_host(self._logical, wanted, source.uuid)
        except Exception as exc:
            fast.release_host_later()
            raise OperationFailedError(
                f"pause failed at step 'pin' before anything was touched: could not prepare host staging "
                f"({type(exc).__name__}: {exc}); the job keeps training",
                step="pin",
            ) from exc
        if pinned == 0:
            return ()
        return (f"pinned {_gib(pinned)} of host staging {where} in {seconds:.2f} s before the safe point "
                f"({_gib(to_map)} of it newly mapped and touched)",)

    def _check_host_room(self, needed: int, *, fast: bool) -> None:
        """A pause stages the job's memory in host memory: pinned by us (fast) or by the driver."""
        available = host_memory_available()
        wanted = needed + HOST_MEMORY_MARGIN_BYTES
        if available is not None and available < wanted:
            what = "host memory to stage the job's pool" if fast else "host memory to hold the job's GPU memory"
            raise TargetRefusedError(
                f"pausing needs {_gib(wanted)} of {what} and this machine has {_gib(available)} available: "
                "free host memory, or migrate the job instead"
            )

    def fast_path_blocker(self) -> Optional[str]:
        """Why a move now would take the driver path (None: the fast path can run at a safe point)."""
        if self._fast is None:
            return "the memory pool is not in use"
        return self._fast.blocker(self._logical)

    def _choose_path(self, requested: str, at_safe_point: bool) -> tuple[bool, tuple[str, ...]]:
        """Whether to take the fast path, else the note saying why the driver path runs."""
        if requested == "driver":
            return False, ("driver path: asked for",)
        if self._fast is None and requested == "auto":
            return False, ()  # no pool in this process (no CUDA torch): the driver path is the only one
        blocker = self.fast_path_blocker()
        if blocker is None and not at_safe_point:
            blocker = (
                "called on the training thread outside an optimizer step"
                if self._safe_points.on_training_thread()
                else f"no optimizer step (safe point) came within {self.safe_point_wait_seconds:g} s"
            )
        if blocker is None:
            return True, ()
        if requested == "fast":
            raise CapabilityError(f"the fast path cannot run: {blocker}")
        return False, (f"driver path: {blocker}",)

    def _require(self, available: bool, feature: str) -> None:
        if not available:
            why = "; ".join(self.capabilities.problems) or "the driver does not support it"
            raise CapabilityError(f"{feature} is not available on this machine: {why}")

    def _validate_target(self, source: GpuIdentity, dest: GpuIdentity, *, needed: Optional[int]) -> tuple[str, ...]:
        if dest.uuid == source.uuid:
            raise TargetRefusedError(f"the job is already on {dest.device} ({dest.uuid})")
        if dest.name != source.name:
            raise TargetRefusedError(
                f"{dest.device} is a {dest.name}, the job runs on a {source.name}: migration needs the same GPU model"
            )
        host = nvml.gpu_by_uuid(dest.uuid)
        if host is None or needed is None:
            return ("free memory on the target not checked: NVML unavailable",)
        # Whatever of ours already sits on the target moves to the source in the swap.
        available = host.memory_free + (host.used_by(self._pid) or 0)
        if available < needed + self.memory_margin_bytes:
            raise TargetRefusedError(
                f"{dest.device} ({dest.name}, nvidia-smi index {host.index}) has {_gib(available)} free; "
                f"the job needs {_gib(needed)} plus {_gib(self.memory_margin_bytes)} headroom: "
                "free memory there or choose another GPU"
            )
        return ()

    def _choose_resume_target(self, source: GpuIdentity, target: Optional[Target]) -> GpuIdentity:
        needed = self._paused_bytes
        if target is not None:
            dest = self._identity.resolve(target)
            if dest.name != source.name:
                raise TargetRefusedError(
                    f"{dest.device} is a {dest.name}, the job was paused on a {source.name}: resume needs the same model"
                )
            self._check_room(dest, needed)
            return dest
        host = nvml.gpu_by_uuid(source.uuid)
        if host is None or host.memory_free >= needed + self.memory_margin_bytes:
            return source
        fitting = self.candidate_targets() if self.capabilities.migration else []
        if not fitting:
            raise TargetRefusedError(
                f"the job needs {_gib(needed)} and no GPU of model {source.name} has that free; it stays paused"
            )
        return fitting[0].gpu

    def _check_room(self, dest: GpuIdentity, needed: int) -> None:
        host = nvml.gpu_by_uuid(dest.uuid)
        if host is not None and host.memory_free < needed + self.memory_margin_bytes:
            raise TargetRefusedError(
                f"{dest.device} has {_gib(host.memory_free)} free; the paused job needs {_gib(needed)} "
                f"plus {_gib(self.memory_margin_bytes)}: it stays paused"
            )

    # ---- the transactions ------------------------------------------------------------------

    def _prepare(self, kind: OperationKind) -> tuple[StepTiming, int]:
        """Before the lock; a failure here (a sticky CUDA error surfacing in synchronize, NVML
        gone) touched nothing, so the job simply stays RUNNING."""
        started = time.perf_counter()
        try:
            torch_bridge.synchronize()
            torch_bridge.release_cached_memory()
            moved = self.process_bytes()
        except Exception as exc:
            self._set_state(EngineState.RUNNING)
            raise OperationFailedError(
                f"{kind.value} failed at step 'prepare' before anything was locked: {type(exc).__name__}: {exc}",
                step="prepare",
            ) from exc
        return StepTiming("prepare", time.perf_counter() - started, ok=True), moved

    def _run_migration(
        self,
        source: GpuIdentity,
        dest: GpuIdentity,
        pairs: list[tuple[str, str]],
        notes: tuple[str, ...],
        *,
        at_safe_point: bool = False,
    ) -> OperationResult:
        started = time.perf_counter()
        owned = self._own_before_driver_checkpoint(OperationKind.MIGRATE, at_safe_point)
        self._set_state(EngineState.MIGRATING)
        prepare, moved = self._prepare(OperationKind.MIGRATE)
        outcomes = self._run_steps(*self._migration_steps(pairs))
        final = _C.process_state(self._pid)
        restored = _restored(outcomes)
        if restored:
            self._identity.apply(pairs)  # its memory is on the target now, whatever follows
        where = dest if restored else source
        return self._settle(
            self._result(
                OperationKind.MIGRATE, source, dest, (*owned, prepare, *map(_timing, outcomes)), moved, started, notes
            ),
            outcomes,
            final,
            succeeded=final == _C.ProcessState.RUNNING and restored,
            on_success=EngineState.RUNNING,
            rolled_back={
                _C.ProcessState.RUNNING: (
                    EngineState.RUNNING,
                    f"rolled back: the job runs on {source.device} ({source.uuid}) as before",
                )
            },
            stuck=f", not RUNNING, its memory on {where.device} ({where.uuid})",
        )

    def _run_pause(
        self, source: GpuIdentity, notes: tuple[str, ...] = (), *, at_safe_point: bool = False
    ) -> OperationResult:
        self._check_host_room(self.process_bytes(), fast=False)
        started = time.perf_counter()
        owned = self._own_before_driver_checkpoint(OperationKind.PAUSE, at_safe_point)
        self._set_state(EngineState.PAUSING)
        prepare, moved = self._prepare(OperationKind.PAUSE)
        outcomes = self._run_steps(*self._pause_steps())
        final = _C.process_state(self._pid)
        succeeded = final == _C.ProcessState.CHECKPOINTED and not any(o.code for o in outcomes)
        if succeeded:
            self._paused_bytes = moved
        return self._settle(
            self._result(OperationKind.PAUSE, source, None, (*owned, prepare, *map(_timing, outcomes)), moved, started, notes),
            outcomes,
            final,
            succeeded=succeeded,
            on_success=EngineState.PAUSED,
            rolled_back={
                _C.ProcessState.RUNNING: (EngineState.RUNNING, f"rolled back: the job runs on {source.device} as before")
            },
        )

    def _run_resume(self, source: GpuIdentity, dest: GpuIdentity, pairs: list[tuple[str, str]]) -> OperationResult:
        started = time.perf_counter()
        self._set_state(EngineState.RESUMING)
        steps = [
            _C.Step(_C.StepKind.RESTORE, pairs=[_C.GpuPair(old, new) for old, new in pairs]),
            _C.Step(_C.StepKind.UNLOCK),
        ]
        # Paused by the fast path: the pool's segments wait in pinned host memory, and no other
        # thread may touch them before they are back.
        from_host = self._fast is not None and self._fast.host_waiting() > 0
        if from_host and self._fast is not None:
            self._fast.wake_for_restore(dest.uuid)  # pins while the restore runs
        # A failed restore leaves the process checkpointed (DESIGN.md fact 3): still paused, nothing to undo.
        outcomes = self._run_steps(steps, [[], [_C.Step(_C.StepKind.UNLOCK)]], hold_gil=from_host)
        final = _C.process_state(self._pid)
        succeeded = final == _C.ProcessState.RUNNING and _restored(outcomes)
        timings = tuple(map(_timing, outcomes))
        if succeeded:
            self._identity.apply(pairs)
        result = self._result(
            OperationKind.RESUME, source, dest, timings, self._paused_bytes, started, path="fast" if from_host else "driver"
        )
        if succeeded and from_host:
            return self._bring_back_from_host(result, dest)
        return self._settle(
            result,
            outcomes,
            final,
            succeeded=succeeded,
            on_success=EngineState.RUNNING,
            rolled_back={
                _C.ProcessState.CHECKPOINTED: (EngineState.PAUSED, "the job is still paused and can be resumed again")
            },
        )

    # ---- the fast path's transactions (fast_path.py moves the segments) -----------------

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
        copied = _note_copied(staged)
        try:
            steps.append(fast.release(self._logical))
        except RelocationError as exc:
            steps.append(exc.timing)
            return self._fast_rollback(result, steps, exc.step, str(exc), staged, source, (*notes, copied))

        outcomes = self._run_steps(*self._migration_steps(pairs), hold_gil=True)
        steps.extend(map(_timing, outcomes))
        final = _C.process_state(self._pid)
        restored = _restored(outcomes)
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
                                          f"optimizer steps ({_gib(OWN_SLICE_BYTES)} each)"))
        failure = _first_failure(outcomes)
        if final == _C.ProcessState.RUNNING:
            return self._fast_rollback(result, steps, failure.step, _describe(failure), staged, source, (*notes, copied))
        self._set_state(EngineState.FAILED)
        return result(
            failed_step=failure.step, notes=(*notes, copied),
            error=f"{_describe(failure)}; ROLLBACK FAILED: the process is {final.name}, not RUNNING; its pool memory "
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
                f"checkpoint can carry it, and no optimizer step came within {self.safe_point_wait_seconds:g} s; "
                "try again while the job trains",
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
        steps.extend(map(_timing, outcomes))
        final = _C.process_state(self._pid)
        if final == _C.ProcessState.CHECKPOINTED and not any(o.code for o in outcomes):
            steps.append(fast.copier_asleep())
            self._paused_bytes = moved
            self._set_state(EngineState.PAUSED)
            return result(ok=True, notes=(*notes, *_copier_notes(fast)))
        failure = _first_failure(outcomes)
        if final == _C.ProcessState.RUNNING:
            return undo(failure.step, _describe(failure))
        self._set_state(EngineState.FAILED)
        return result(
            failed_step=failure.step,
            error=f"{_describe(failure)}; ROLLBACK FAILED: the process is {final.name}; its pool memory is in host memory",
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
        notes = _copier_notes(self._fast)
        self._fast.release_host_later()
        self._set_state(EngineState.RUNNING)
        return replace(result, ok=True, steps=tuple(steps), notes=(*result.notes, *notes), seconds=result.seconds + sum(
            s.seconds for s in steps[len(result.steps):]))

    def _result(
        self,
        kind: OperationKind,
        source: GpuIdentity,
        target: Optional[GpuIdentity],
        steps: tuple[StepTiming, ...],
        moved: int,
        started: float,
        notes: tuple[str, ...] = (),
        path: str = "driver",
    ) -> OperationResult:
        return OperationResult(
            kind=kind,
            path=path,
            ok=False,
            logical_device=self.logical_device,
            source=source,
            target=target,
            steps=steps,
            bytes_moved=moved,
            seconds=time.perf_counter() - started,
            notes=notes,
        )

    def _settle(
        self,
        result: OperationResult,
        outcomes: Sequence[_C.StepOutcome],
        final: _C.ProcessState,
        *,
        succeeded: bool,
        on_success: EngineState,
        rolled_back: dict[_C.ProcessState, tuple[EngineState, str]],
        stuck: str = "",
    ) -> OperationResult:
        """The engine's state and the result's error from how the process ended up: where the
        operation wanted it, back where it was (rolled_back, by process state), or stuck."""
        if succeeded:
            self._set_state(on_success)
            return replace(result, ok=True)
        failure = _first_failure(outcomes)
        if final in rolled_back:
            state, outcome = rolled_back[final]
            self._set_state(state)
            return replace(result, failed_step=failure.step, error=f"{_describe(failure)}; {outcome}")
        self._set_state(EngineState.FAILED)
        return replace(
            result,
            failed_step=failure.step,
            error=f"{_describe(failure)}; ROLLBACK FAILED: the process is {final.name}{stuck}",
        )

    def _migration_steps(self, pairs: list[tuple[str, str]]) -> tuple[list[_C.Step], list[list[_C.Step]]]:
        """The locked section of a migration and each step's rollback: a failed checkpoint or
        restore is recovered in place (DESIGN.md fact 3), a failed unlock is tried again."""
        steps = [
            _C.Step(_C.StepKind.LOCK, timeout_ms=self.lock_timeout_ms),
            _C.Step(_C.StepKind.CHECKPOINT),
            _C.Step(_C.StepKind.RESTORE, pairs=[_C.GpuPair(old, new) for old, new in pairs]),
            _C.Step(_C.StepKind.UNLOCK),
        ]
        recover = [_C.Step(_C.StepKind.RECOVER)]
        return steps, [[], recover, recover, [_C.Step(_C.StepKind.UNLOCK)]]

    def _pause_steps(self) -> tuple[list[_C.Step], list[list[_C.Step]]]:
        """The locked section of a pause: a failed checkpoint is recovered in place."""
        steps = [_C.Step(_C.StepKind.LOCK, timeout_ms=self.lock_timeout_ms), _C.Step(_C.StepKind.CHECKPOINT)]
        return steps, [[], [_C.Step(_C.StepKind.RECOVER)]]

    def _run_steps(
        self, steps: list[_C.Step], rollbacks: list[list[_C.Step]], *, hold_gil: bool = False
    ) -> list[_C.StepOutcome]:
        """Runs a locked section; NVML queries go elsewhere until the process runs again."""
        nvml.set_frozen(True)
        try:
            outcomes = list(_C.run_steps(self._pid, steps, rollbacks, hold_gil=hold_gil))
        finally:
            nvml.set_frozen(_C.process_state(self._pid) != _C.ProcessState.RUNNING)
        if self._fast is not None and any(o.step == "restore" and o.code == 0 for o in outcomes):
            # What the driver carried through its checkpoint comes back unexportable (fast-path.md).
            _C.vmm_mark_restored_by_driver()
        return outcomes

    def _park_while_paused(self, result: OperationResult) -> None:
        if result.ok:
            self._parking.park(lambda: self.state == EngineState.PAUSED)

    # ---- bookkeeping -----------------------------------------------------------------------

    @contextlib.contextmanager
    def _operation(self, kind: OperationKind, *, allowed: tuple[EngineState, ...]) -> Iterator[None]:
        if not self._operation_lock.acquire(blocking=False):
            raise OperationInProgressError(
                f"cannot {kind.value}: another operation is in progress ({self.state.value}); wait for it to finish"
            )
        try:
            state = self.state
            if state not in allowed:
                raise InvalidStateError(_state_refusal(kind, state))
            yield
        finally:
            self._operation_lock.release()

    def _set_state(self, state: EngineState) -> None:
        with self._state_lock:
            self._state = state
        for listener in list(self._listeners):
            try:
                listener(state)
            except Exception:  # a reporting hook must never break an operation
                log.exception("state listener failed")

    def _finish(self, result: OperationResult) -> OperationResult:
        self.last_result = result
        if self.state == EngineState.RUNNING:
            self._own_in_slices()
        summary = ", ".join(f"{s.step} {s.seconds * 1e3:.0f} ms" for s in result.steps if not s.rollback)
        if result.ok:
            where = f" -> {result.target.device}" if result.target is not None else ""
            log.info("%s %s%s done in %.2f s (%s)", result.kind.value, result.source.device, where, result.seconds, summary)
            return result
        if self.state == EngineState.FAILED:
            log.critical("%s failed and could not be rolled back: %s", result.kind.value, result.error)
            raise RollbackFailedError(f"{result.kind.value} failed: {result.error}", step=result.failed_step or "?", result=result)
        log.error("%s failed: %s", result.kind.value, result.error)
        raise OperationFailedError(f"{result.kind.value} failed: {result.error}", step=result.failed_step or "?", result=result)


def _copier_notes(fast: FastPath) -> tuple[str, ...]:
    """Says when the copies ran in this process because the copier failed, once."""
    why, fast.copier_fallback = fast.copier_fallback, ""
    return (f"the copies to and from host memory ran in this process: {why}",) if why else ()


def _note_copied(staged: Staged) -> str:
    return (
        f"fast path: copied {staged.copied_bytes / GIB:.2f} GiB in use of {staged.segment_bytes / GIB:.2f} GiB "
        f"in {len(staged.entries)} pool segments"
    )


def _check_path(path: str) -> None:
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, not {path!r}")


def _timing(outcome: _C.StepOutcome) -> StepTiming:
    error = None if outcome.code == 0 else f"{outcome.error_name} ({outcome.error_text})"
    return StepTiming(
        step=outcome.step, seconds=float(outcome.seconds), ok=outcome.code == 0, rollback=outcome.rollback, error=error
    )


def _restored(outcomes: Sequence[_C.StepOutcome]) -> bool:
    """Whether the operation's own restore (not a rollback's) succeeded."""
    return any(o.step == "restore" and not o.rollback and o.code == 0 for o in outcomes)


def _first_failure(outcomes: Sequence[_C.StepOutcome]) -> _C.StepOutcome:
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


def _describe(outcome: _C.StepOutcome) -> str:
    step, name = outcome.step, outcome.error_name
    text = f"step '{step}' failed: {_STEP_CALLS.get(step, step)} returned {name} ({outcome.error_text})"
    if step == "lock" and name == "CUDA_ERROR_TIMEOUT":
        text += " (the process stayed busy in CUDA work past the lock timeout; try again)"
    return text


def _state_refusal(kind: OperationKind, state: EngineState) -> str:
    if state == EngineState.PAUSED:
        return f"cannot {kind.value}: the job is paused; resume it first (resume may pick the GPU)"
    if state == EngineState.RUNNING and kind == OperationKind.RESUME:
        return "cannot resume: the job is running, not paused"
    if state == EngineState.FAILED:
        return f"cannot {kind.value}: an earlier rollback failed and the process may be stuck; restart the job"
    return f"cannot {kind.value}: the job is {state.value}"
