"""What the client uses of the training process's flexium state (``flexium.api.runtime.Runtime``
and its engine), as Protocols: the client depends on these few members, not on the classes,
and mypy checks both sides against them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from flexium.config import FlexiumConfig
from flexium.engine.capabilities import Capabilities
from flexium.engine.distributed.job_operation import JobOperation
from flexium.engine.operations import EngineState, GpuIdentity, OperationResult


class EngineControl(Protocol):
    """The engine as the client drives it. Targets are GPU UUIDs only: the server resolved
    the person's text (``cuda:N``, an index, a UUID) once."""

    @property
    def state(self) -> EngineState: ...

    @property
    def gpus(self) -> Sequence[GpuIdentity]: ...

    def placement(self) -> tuple[str, GpuIdentity]: ...

    def add_state_listener(self, listener: Callable[[EngineState], None]) -> None: ...

    def process_bytes(self) -> int: ...

    def footprint_bytes(self) -> int: ...

    def migrate(self, target: str | None = None, *, moves: Mapping[str, str] | None = None) -> OperationResult: ...

    def pause(self) -> OperationResult: ...

    def resume(self, target: str | None = None) -> OperationResult: ...

    def run_job_operation(self, op: JobOperation) -> OperationResult: ...


class MemoryPoolState(Protocol):
    @property
    def active(self) -> bool: ...

    @property
    def reason_off(self) -> str | None: ...


class TrainingProcess(Protocol):
    """The ``Runtime`` that ``flexium.init()`` made in this process."""

    @property
    def process_id(self) -> str: ...

    @property
    def logical_device(self) -> str: ...

    @property
    def config(self) -> FlexiumConfig | None: ...

    @property
    def capabilities(self) -> Capabilities | None: ...

    @property
    def engine(self) -> EngineControl | None: ...

    @property
    def memory_pool(self) -> MemoryPoolState | None: ...
