"""What every transaction works on, handed to it explicitly by the engine."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from flexium.engine import nvml, torch_bridge
from flexium.engine.distributed.nccl import Communicator
from flexium.engine.fast.checksum import Before
from flexium.engine.fast.path import FastPath
from flexium.engine.identity import IdentityMap, MovePlan
from flexium.engine.operations import EngineState, GpuIdentity
from flexium.engine.safe_point import SafePoints

log = logging.getLogger("flexium")

StateListener = Callable[[EngineState], None]


class OperationContext:
    """One process's engine state shared by its transactions and by its part in a whole-job
    operation: where its devices are, the fast path, the safe points, the engine's state with its
    listeners, and what a pause left behind."""

    def __init__(
        self,
        *,
        pid: int,
        logical: int,
        identity: IdentityMap,
        safe_points: SafePoints,
        fast: FastPath | None,
        lock_timeout_ms: int,
    ) -> None:
        self.pid = pid
        self.logical = logical  # the CUDA ordinal the training code uses
        self.identity = identity
        self.safe_points = safe_points
        self.fast = fast
        self.lock_timeout_ms = lock_timeout_ms
        self.paused_bytes = 0  # what the job held on its GPUs when it was paused
        # The same by GPU UUID (a process may use several); empty where NVML cannot see processes.
        self.paused_by_gpu: dict[str, int] = {}
        # The checksums of what a fast pause moved to host memory, which its resume verifies.
        self.paused_checksums: Before | None = None
        # The communicators a whole-job pause suspended, for its resume.
        self.suspended_communicators: list[Communicator] = []
        self._state = EngineState.RUNNING
        self._state_lock = threading.Lock()
        self._listeners: list[StateListener] = []

    @property
    def logical_device(self) -> str:
        return f"cuda:{self.logical}"

    @property
    def source(self) -> GpuIdentity:
        """The GPU the training code's device is on now."""
        return self.identity.physical_of(self.logical)

    def plan_to(self, dest: GpuIdentity) -> MovePlan:
        """The plan that puts the training code's device on `dest`."""
        return self.identity.plan({self.logical: dest})

    @property
    def state(self) -> EngineState:
        with self._state_lock:
            return self._state

    def set_state(self, state: EngineState) -> None:
        with self._state_lock:
            self._state = state
        for listener in list(self._listeners):
            try:
                listener(state)
            except Exception:  # a reporting hook must never break an operation
                log.exception("state listener failed")

    def add_state_listener(self, listener: StateListener) -> None:
        self._listeners.append(listener)

    def process_bytes(self) -> int:
        """GPU memory this process holds on every GPU (held_now); while the process is frozen it
        holds nothing on any GPU, and asking torch would block."""
        if nvml.is_frozen():
            return 0
        return self.held_now()[0]

    def held_now(self) -> tuple[int, dict[str, int]]:
        """What this process holds on every GPU, in all and by GPU UUID, from NVML; where NVML
        cannot see processes, PyTorch's reserved bytes in all (it then misses the context, a few
        hundred MiB; none while frozen) and nothing by GPU."""
        by_gpu = {}
        for gpu in nvml.host_gpus():
            used = gpu.used_by(self.pid)
            if used is not None:
                by_gpu[gpu.uuid] = used
        if by_gpu:
            return sum(by_gpu.values()), by_gpu
        return (0 if nvml.is_frozen() else torch_bridge.reserved_bytes()), by_gpu
