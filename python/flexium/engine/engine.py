"""migrate / pause / resume of this process, each a transaction on the driver checkpoint API.

Every operation validates before touching anything, runs its locked section in one native call
(csrc/checkpoint.cpp says why), and ends with the process RUNNING on its source GPU, RUNNING on
its target, or (pause, failed resume) checkpointed and paused. Anything else raises
RollbackFailedError and is logged at CRITICAL.

Two paths: the fast path (fast_transactions.py, mixed in here) moves the memory pool's
segments itself at a safe point and leaves the driver only the rest; the driver path (here) lets
the checkpoint carry everything. The fast path runs when the pool is in use and a safe point
comes within the bounded wait; otherwise, or when asked, the driver path does.
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
from flexium.engine.fast_path import FastPath, host_memory_available
from flexium.engine.fast_transactions import FastTransactions
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
from flexium.engine.step_outcomes import describe_failure, first_failure, own_restore_succeeded, timing_of
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


class Engine(FastTransactions):
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
            blocker = self._safe_points.missed()
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
        restored = own_restore_succeeded(outcomes)
        if restored:
            self._identity.apply(pairs)  # its memory is on the target now, whatever follows
        where = dest if restored else source
        return self._settle(
            self._result(
                OperationKind.MIGRATE, source, dest, (*owned, prepare, *map(timing_of, outcomes)), moved, started, notes
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
            self._result(OperationKind.PAUSE, source, None, (*owned, prepare, *map(timing_of, outcomes)), moved, started, notes),
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
        succeeded = final == _C.ProcessState.RUNNING and own_restore_succeeded(outcomes)
        timings = tuple(map(timing_of, outcomes))
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
        failure = first_failure(outcomes)
        if final in rolled_back:
            state, outcome = rolled_back[final]
            self._set_state(state)
            return replace(result, failed_step=failure.step, error=f"{describe_failure(failure)}; {outcome}")
        self._set_state(EngineState.FAILED)
        return replace(
            result,
            failed_step=failure.step,
            error=f"{describe_failure(failure)}; ROLLBACK FAILED: the process is {final.name}{stuck}",
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


def _check_path(path: str) -> None:
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, not {path!r}")


def _state_refusal(kind: OperationKind, state: EngineState) -> str:
    if state == EngineState.PAUSED:
        return f"cannot {kind.value}: the job is paused; resume it first (resume may pick the GPU)"
    if state == EngineState.RUNNING and kind == OperationKind.RESUME:
        return "cannot resume: the job is running, not paused"
    if state == EngineState.FAILED:
        return f"cannot {kind.value}: an earlier rollback failed and the process may be stuck; restart the job"
    return f"cannot {kind.value}: the job is {state.value}"
