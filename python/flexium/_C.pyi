"""flexium's native layer (csrc/). Private: the public API is pure Python."""

import enum
from typing import Any

class DriverError(RuntimeError):
    call: str
    code: int
    error_name: str

def driver_status() -> dict[str, Any]: ...

class DeviceInfo:
    ordinal: int
    uuid: str
    name: str
    total_memory: int
    pci_bus_id: str

def list_devices() -> list[DeviceInfo]: ...

class ProcessState(enum.Enum):
    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3

class GpuPair:
    old_uuid: str
    new_uuid: str
    def __init__(self, old_uuid: str, new_uuid: str) -> None: ...

def process_state(pid: int) -> ProcessState: ...
def restore_thread_id(pid: int) -> int: ...
def lock(pid: int, timeout_ms: int) -> None: ...
def checkpoint(pid: int) -> None: ...
def restore(pid: int, pairs: list[GpuPair] = ...) -> None: ...
def unlock(pid: int) -> None: ...

class StepKind(enum.Enum):
    LOCK = 0
    CHECKPOINT = 1
    RESTORE = 2
    UNLOCK = 3
    RECOVER = 4

class Step:
    kind: StepKind
    pair_count: int
    def __init__(self, kind: StepKind, timeout_ms: int = 0, pairs: list[GpuPair] = ...) -> None: ...

class StepOutcome:
    step: str
    rollback: bool
    code: int
    error_name: str
    error_text: str
    seconds: float

def run_steps(pid: int, steps: list[Step], rollbacks: list[list[Step]]) -> list[StepOutcome]: ...
