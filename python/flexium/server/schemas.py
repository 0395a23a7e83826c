"""Pydantic models of the request and response bodies: the validated, documented (OpenAPI)
form of the TypedDicts in ``flexium.protocol``, with its limits.

Strict types (a string is not a number), finite floats, bounded strings without NUL (which
PostgreSQL refuses in text: it would otherwise surface as a 500), bounded free-form JSON.
Unknown fields are ignored so an older server accepts a newer client.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StringConstraints

from flexium import protocol


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


def _check_json(value: Any) -> Any:
    """Bounded depth and size, finite numbers, no NUL: anything both databases store."""
    budget = [protocol.MAX_JSON_ITEMS]

    def walk(node: Any, depth: int) -> None:
        if depth > protocol.MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {protocol.MAX_JSON_DEPTH} levels")
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError(f"more than {protocol.MAX_JSON_ITEMS} values")
        if isinstance(node, dict):
            for key, item in node.items():
                if not isinstance(key, str):
                    raise ValueError("object keys must be strings")
                _no_nul(key)
                walk(item, depth + 1)
        elif isinstance(node, list):
            for item in node:
                walk(item, depth + 1)
        elif isinstance(node, str):
            _no_nul(node)
            if len(node) > protocol.MAX_LONG_TEXT:
                raise ValueError(f"a string is longer than {protocol.MAX_LONG_TEXT} characters")
        elif isinstance(node, bool) or node is None:
            pass
        elif isinstance(node, int):
            if abs(node) > protocol.MAX_INT:
                raise ValueError("a number is out of range")
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise ValueError("numbers must be finite")
        else:
            raise ValueError(f"unsupported value of type {type(node).__name__}")

    walk(value, 0)
    return value


ShortText = Annotated[str, StringConstraints(max_length=protocol.MAX_SHORT_TEXT), AfterValidator(_no_nul)]
NonEmptyText = Annotated[str, StringConstraints(min_length=1, max_length=protocol.MAX_SHORT_TEXT,
                                                strip_whitespace=True), AfterValidator(_no_nul)]
HostName = Annotated[str, StringConstraints(min_length=1, max_length=protocol.MAX_HOST_LEN,
                                            strip_whitespace=True), AfterValidator(_no_nul)]
LongText = Annotated[str, StringConstraints(max_length=protocol.MAX_LONG_TEXT), AfterValidator(_no_nul)]
ProcessId = Annotated[str, StringConstraints(pattern=protocol.PROCESS_ID_RE.pattern)]
Bytes = Annotated[int, Field(ge=0, le=protocol.MAX_INT)]
Seq = Annotated[int, Field(ge=0, le=protocol.MAX_INT, description="grows with every body the process builds")]
Pid = Annotated[int, Field(ge=0, le=1 << 40)]
GpuIndex = Annotated[int, Field(ge=0, le=4095)]
Epoch = Annotated[float, Field(ge=0, le=1e11)]
FreeJson = Annotated[dict[str, Any], AfterValidator(_check_json)]

ProcessState = Literal["RUNNING", "MIGRATING", "PAUSING", "PAUSED", "RESUMING", "FAILED"]
DisplayState = Literal["RUNNING", "MIGRATING", "PAUSING", "PAUSED", "RESUMING", "FAILED", "STALE"]
CommandKind = Literal["migrate", "pause", "resume"]
CommandState = Literal["queued", "delivered", "running", "succeeded", "failed", "expired"]
ReportState = Literal["running", "succeeded", "failed"]


class In(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class Out(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --- requests -------------------------------------------------------------------------------

class GpuReportIn(In):
    uuid: NonEmptyText
    index: Optional[GpuIndex] = None
    name: ShortText = ""
    memory_total: Bytes = 0
    memory_used: Bytes = 0
    utilization: Optional[Annotated[int, Field(ge=0, le=100)]] = None
    temperature: Optional[Annotated[int, Field(ge=-100, le=300)]] = None
    health: ShortText = "ok"


class RegisterIn(In):
    process_id: ProcessId
    host: HostName
    user: ShortText = ""
    pid: Pid = 0
    gpu_uuid: Optional[ShortText] = None
    gpu_model: ShortText = ""
    gpu_index: Optional[GpuIndex] = None
    logical_device: ShortText = ""
    physical_device: ShortText = ""
    visible_gpus: Annotated[list[NonEmptyText], Field(max_length=protocol.MAX_DEVICES)] = []
    torch_version: ShortText = ""
    driver_version: ShortText = ""
    flexium_version: ShortText = ""
    capabilities: FreeJson = {}
    memory_bytes: Bytes = 0
    footprint_bytes: Optional[Bytes] = None
    state: ProcessState = "RUNNING"
    started_at: Optional[Epoch] = None
    cmdline: LongText = ""
    devices: Annotated[list[GpuReportIn], Field(max_length=protocol.MAX_DEVICES)] = []
    seq: Optional[Seq] = None


class HeartbeatIn(In):
    state: Optional[ProcessState] = None
    memory_bytes: Optional[Bytes] = None
    footprint_bytes: Optional[Bytes] = None
    gpu_uuid: Optional[ShortText] = None
    gpu_index: Optional[GpuIndex] = None
    physical_device: Optional[ShortText] = None
    devices: Annotated[list[GpuReportIn], Field(max_length=protocol.MAX_DEVICES)] = []
    seq: Optional[Seq] = None


class CommandIn(In):
    kind: CommandKind
    process_id: ProcessId
    target: Union[StrictInt, ShortText, None] = Field(
        default=None, description="GPU UUID, NVML index on the process's host, or 'cuda:N' "
                                  "(the process's own ordinal); resume: optional")


class ProcessUpdateIn(In):
    state: Optional[ProcessState] = None
    gpu_uuid: Optional[ShortText] = None
    gpu_index: Optional[GpuIndex] = None
    physical_device: Optional[ShortText] = None
    memory_bytes: Optional[Bytes] = None
    seq: Optional[Seq] = None


class CommandReportIn(In):
    state: ReportState
    result: Optional[FreeJson] = None
    error: Optional[LongText] = None
    process: Optional[ProcessUpdateIn] = None


class TokenIn(In):
    name: ShortText = ""


# --- responses ------------------------------------------------------------------------------

class ErrorOut(Out):
    error: str
    message: str
    detail: Any = None


class CommandOut(Out):
    id: int
    kind: CommandKind
    process_id: str
    state: CommandState
    target_uuid: Optional[str]
    target_index: Optional[int]
    target_device: Optional[str]
    created_at: float
    delivered_at: Optional[float]
    started_at: Optional[float]
    finished_at: Optional[float]
    deliveries: int
    result: Optional[dict[str, Any]]
    error: Optional[str]


class ProcessOut(Out):
    process_id: str
    host: str
    user: str
    pid: int
    state: DisplayState
    reported_state: ProcessState
    stale: bool
    gpu_uuid: Optional[str]
    gpu_model: str
    gpu_index: Optional[int]
    logical_device: str
    physical_device: str
    visible_gpus: list[str]
    torch_version: str
    driver_version: str
    flexium_version: str
    capabilities: dict[str, Any]
    memory_bytes: int
    footprint_bytes: int
    started_at: Optional[float]
    registered_at: float
    last_seen: float
    cmdline: str
    active_command: Optional[CommandOut]


class RegisterOut(Out):
    process: ProcessOut
    heartbeat_interval_s: float
    poll_timeout_s: float
    stale_after_s: float
    server_time: float


class HeartbeatOut(Out):
    ok: bool
    pending_command: Optional[int]
    heartbeat_interval_s: float
    server_time: float


class DeviceOut(Out):
    uuid: str
    index: Optional[int]
    name: str
    memory_total: int
    memory_used: int
    memory_flexium: int
    memory_other: int
    memory_free: int
    utilization: Optional[int]
    temperature: Optional[int]
    health: str
    updated_at: float
    processes: list[str]


class HostOut(Out):
    host: str
    updated_at: float
    stale: bool
    devices: list[DeviceOut]


class DevicesOut(Out):
    hosts: list[HostOut]


class TargetOut(Out):
    device: DeviceOut
    refusal: Optional[str]


class TokenOut(Out):
    id: int
    name: str
    prefix: str
    created_at: float
    revoked_at: Optional[float]
    revoked: bool


class TokenCreatedOut(TokenOut):
    token: str = Field(description="shown once; only its hash is stored")


class WorkspaceOut(Out):
    id: int
    name: str
    created_at: float
    processes: int
    active_commands: int


class HealthOut(Out):
    status: Literal["ok", "degraded"]
    database: str
    version: int = protocol.PROTOCOL_VERSION
