"""The wire format between training processes, the CLI, the dashboard and the server.

This module is imported by both sides. The client side of a base install has only the
standard library, nvidia-ml-py, pyyaml and requests, so everything here is plain Python:
constants, TypedDicts describing the JSON bodies, and small pure helpers. The server's
pydantic models (``flexium.server.schemas``) mirror these shapes and take their limits from
here; a test keeps the two in step.

All times on the wire are Unix epoch seconds (float). All sizes are bytes (int).
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional, TypedDict, Union

PROTOCOL_VERSION = 1

# --- addressing -----------------------------------------------------------------------------

DEFAULT_PORT = 8080
API_PREFIX = "/api"
TOKEN_HEADER = "Authorization"         # "Bearer <token>"
TOKEN_COOKIE = "flexium_token"         # the dashboard's login cookie, same token
CSRF_HEADER = "X-Flexium-Request"      # must be present on unsafe requests authenticated by cookie
TOKEN_PREFIX = "flx_"
TOKEN_ENV = "FLEXIUM_TOKEN"
SERVER_ENV = "FLEXIUM_SERVER"
DATABASE_ENV = "FLEXIUM_DATABASE_URL"
DEFAULT_WORKSPACE = "default"

WORKSPACE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
PROCESS_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


class ServerAddress(TypedDict):
    host: str
    port: int
    workspace: str
    scheme: str


def parse_server_address(address: str) -> ServerAddress:
    """``host[:port]/workspace`` (the spec's format) -> parts. ``http://`` or ``https://`` may
    prefix it; without a scheme, http is used. Raises ValueError with the reason."""
    text = (address or "").strip()
    scheme = "http"
    for prefix in ("http://", "https://"):
        if text.lower().startswith(prefix):
            scheme = prefix[:-3]
            text = text[len(prefix):]
            break
    hostport, sep, workspace = text.partition("/")
    workspace = workspace.strip("/")
    if not sep or not workspace:
        raise ValueError(f"server address {address!r} has no workspace: expected host[:port]/workspace")
    if not WORKSPACE_NAME_RE.match(workspace):
        raise ValueError(f"server address {address!r}: workspace {workspace!r} is not a valid name "
                         "(lowercase letters, digits, '.', '_', '-'; at most 63)")
    host, port = hostport, DEFAULT_PORT
    if hostport.startswith("["):                       # [::1]:8080
        end = hostport.find("]")
        if end < 0:
            raise ValueError(f"server address {address!r}: unclosed '['")
        host, rest = hostport[1:end], hostport[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"server address {address!r}: expected ':port' after ']'")
            port = _parse_port(rest[1:], address)
    elif ":" in hostport:
        host, _, port_text = hostport.rpartition(":")
        port = _parse_port(port_text, address)
    if not host:
        raise ValueError(f"server address {address!r} has no host")
    return ServerAddress(host=host, port=port, workspace=workspace, scheme=scheme)


def _parse_port(text: str, address: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"server address {address!r}: port {text!r} is not a number in 1..65535")
    return int(text)


def base_url(address: ServerAddress) -> str:
    host = f"[{address['host']}]" if ":" in address["host"] else address["host"]
    return f"{address['scheme']}://{host}:{address['port']}"


def workspace_path(workspace: str) -> str:
    """Prefix of every workspace-scoped API path, e.g. ``/api/w/default``."""
    return f"{API_PREFIX}/w/{workspace}"


# Paths below are relative to workspace_path(workspace).
PATH_PROCESSES = "/processes"
PATH_PROCESS = "/processes/{process_id}"
PATH_HEARTBEAT = "/processes/{process_id}/heartbeat"
PATH_NEXT_COMMAND = "/processes/{process_id}/commands/next"   # long-poll, ?wait=seconds
PATH_COMMANDS = "/commands"
PATH_COMMAND = "/commands/{command_id}"                      # ?wait=seconds: until finished
PATH_COMMAND_REPORT = "/commands/{command_id}/report"
PATH_TARGETS = "/processes/{process_id}/targets"           # ?kind=migrate|resume: which GPUs fit
PATH_DEVICES = "/devices"
PATH_EVENTS = "/events"                                      # text/event-stream
PATH_TOKENS = "/tokens"
PATH_TOKEN = "/tokens/{token_id}"

# --- timing defaults (the server sends its own values in RegisterResponse) ------------------

HEARTBEAT_INTERVAL_S = 5.0
POLL_TIMEOUT_S = 25.0          # a long-poll with nothing to deliver answers 204 after this
MAX_POLL_TIMEOUT_S = 60.0
STALE_AFTER_S = 30.0           # no heartbeat for this long: shown STALE
REMOVE_AFTER_S = 900.0         # no heartbeat for this long: removed
COMMAND_TTL_S = 300.0          # queued/delivered but never started for this long: expired

# --- limits the server enforces (4xx, never 5xx) --------------------------------------------

MAX_BODY_BYTES = 1 << 20
MAX_SHORT_TEXT = 128
MAX_HOST_LEN = 255
MAX_LONG_TEXT = 4096
MAX_DEVICES = 64
MAX_JSON_DEPTH = 8
MAX_JSON_ITEMS = 512
MAX_INT = (1 << 62)           # memory sizes, pids: fits every database's BIGINT

# --- states ---------------------------------------------------------------------------------

# What a process reports (flexium.engine.operations.EngineState values). FAILED: a rollback
# failed, the process may be stuck; it takes no command, the job must be restarted.
PROCESS_STATES = ("RUNNING", "MIGRATING", "PAUSING", "PAUSED", "RESUMING", "FAILED")
FAILED = "FAILED"
# What the server shows: the reported state, or STALE when heartbeats stopped.
STALE = "STALE"
DISPLAY_STATES = PROCESS_STATES + (STALE,)

CommandKind = Literal["migrate", "pause", "resume"]
COMMAND_KINDS = ("migrate", "pause", "resume")

CommandState = Literal["queued", "delivered", "running", "succeeded", "failed", "expired"]
COMMAND_STATES = ("queued", "delivered", "running", "succeeded", "failed", "expired")
ACTIVE_COMMAND_STATES = ("queued", "delivered", "running")
PENDING_COMMAND_STATES = ("queued", "delivered")          # what a long-poll hands out
FINAL_COMMAND_STATES = ("succeeded", "failed", "expired")
REPORT_STATES = ("running", "succeeded", "failed")        # what a process may report

# Capability keys a process reports (flexium.utils.get_capabilities()).
CAP_PAUSE_RESUME = "pause_resume"
CAP_MIGRATION = "migration"
# Whether the job's memory is in flexium's pool (moves can take the fast path), and if not, why.
CAP_FAST_PATH = "fast_path"
CAP_FAST_PATH_PROBLEM = "fast_path_problem"

# GPU health (GpuReport.health): "ok", "unknown" (NVML cannot read the ECC counters: nothing
# known against it) or a short reason. Only a known-bad health refuses a GPU as a target.
HEALTH_OK = "ok"
HEALTH_UNKNOWN = "unknown"
TARGETABLE_HEALTH = (HEALTH_OK, HEALTH_UNKNOWN)

# --- errors ---------------------------------------------------------------------------------

# Every 4xx/5xx body is {"error": CODE, "message": "...", "detail": optional}.
ERROR_STATUS: dict[str, int] = {
    "bad_request": 400,           # malformed JSON, unreadable body
    "unauthorized": 401,          # no token, unknown or revoked token
    "forbidden": 403,             # cookie-authenticated write without the CSRF header
    "not_found": 404,             # unknown id, or another workspace's (never told apart)
    "invalid_state": 409,         # e.g. pause a paused job
    "busy": 409,                  # the process already has an active command
    "stale": 409,                 # the process stopped sending heartbeats
    "payload_too_large": 413,
    "invalid_request": 422,       # wrong types, out-of-range values
    "target_refused": 422,        # unknown GPU, other host, other model, no room, same GPU
    "capability": 422,            # the process lacks the feature (driver too old)
    "unavailable": 503,           # database unreachable
    "internal": 500,
}


class ErrorBody(TypedDict, total=False):
    error: str
    message: str
    detail: Any


# --- bodies ---------------------------------------------------------------------------------

class GpuReport(TypedDict, total=False):
    """One GPU of the reporting host, read through NVML (every GPU, not only the job's)."""
    uuid: str                       # required: "GPU-..."
    index: int                      # nvidia-smi's index on that host
    name: str                       # model, e.g. "NVIDIA H200"
    memory_total: int
    memory_used: int                # everything on it, ours and others'
    utilization: Optional[int]      # percent
    temperature: Optional[int]      # degrees C
    health: str                     # "ok", "unknown" or a short reason ("xid 79", "ecc_errors")


class RegisterRequest(TypedDict, total=False):
    process_id: str                 # required; flexium.auto.get_process_id(), e.g. "gpu-abc12345"
    host: str                       # required
    user: str
    pid: int
    gpu_uuid: Optional[str]         # the physical GPU it is on (None while paused)
    gpu_model: str
    gpu_index: Optional[int]        # NVML index of that GPU
    logical_device: str             # what the training code uses, "cuda:0"
    physical_device: str            # flexium.auto.get_physical_device()
    visible_gpus: list[str]         # UUIDs in this process's CUDA ordinal order ("cuda:N" = [N])
    torch_version: str
    driver_version: str
    flexium_version: str
    capabilities: dict[str, Any]    # {"pause_resume": bool, "migration": bool, ...}
    memory_bytes: int               # bytes it holds on its GPU now
    footprint_bytes: int            # bytes it needs on a GPU (kept while paused)
    state: str                      # one of PROCESS_STATES, default RUNNING
    started_at: float
    cmdline: str
    devices: list[GpuReport]        # every GPU of the host
    seq: int                        # see HeartbeatRequest.seq


class HeartbeatRequest(TypedDict, total=False):
    state: str
    memory_bytes: int
    footprint_bytes: int
    gpu_uuid: Optional[str]
    gpu_index: Optional[int]
    physical_device: str
    devices: list[GpuReport]
    # Grows with every body the process builds (the client sends time.monotonic_ns()). The
    # server ignores what a heartbeat says (state, placement, memory, devices) when its seq is
    # older than the last applied register, heartbeat or command report's ``process``: a beat
    # built during a pause (PAUSING) and delivered after the final report (PAUSED) changes
    # nothing. Optional: a body without it is applied as it comes.
    seq: int


class CommandRequest(TypedDict, total=False):
    kind: str                       # migrate | pause | resume
    process_id: str
    target: Union[str, int, None]   # GPU UUID, NVML index on the process's host, or "cuda:N"


class ProcessUpdate(TypedDict, total=False):
    state: str
    gpu_uuid: Optional[str]
    gpu_index: Optional[int]
    physical_device: str
    memory_bytes: int
    seq: int                        # see HeartbeatRequest.seq


class CommandReport(TypedDict, total=False):
    state: str                      # running | succeeded | failed
    result: Optional[dict[str, Any]]  # OperationResult.to_dict() (path, steps, seconds, ...)
    error: Optional[str]
    process: ProcessUpdate          # where the process is after the operation


class CommandInfo(TypedDict):
    id: int
    kind: str
    process_id: str
    state: str
    target_uuid: Optional[str]
    target_index: Optional[int]
    target_device: Optional[str]    # "cuda:N" in the process's own ordinals, when known
    created_at: float
    delivered_at: Optional[float]
    started_at: Optional[float]
    finished_at: Optional[float]
    deliveries: int
    result: Optional[dict[str, Any]]
    error: Optional[str]


class ProcessInfo(TypedDict):
    process_id: str
    host: str
    user: str
    pid: int
    state: str                      # DISPLAY_STATES
    reported_state: str
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
    active_command: Optional[CommandInfo]


class RegisterResponse(TypedDict):
    process: ProcessInfo
    heartbeat_interval_s: float
    poll_timeout_s: float
    stale_after_s: float
    server_time: float


class HeartbeatResponse(TypedDict):
    ok: bool
    pending_command: Optional[int]  # a command waits: the long-poll will hand it out
    heartbeat_interval_s: float
    server_time: float


class DeviceInfo(TypedDict):
    uuid: str
    index: Optional[int]
    name: str
    memory_total: int
    memory_used: int
    memory_flexium: int             # held by this workspace's flexium jobs on it
    memory_other: int               # memory_used - memory_flexium, never negative
    memory_free: int
    utilization: Optional[int]
    temperature: Optional[int]
    health: str
    updated_at: float
    processes: list[str]            # process ids on it


class HostInfo(TypedDict):
    host: str
    updated_at: float
    stale: bool                     # no report from this host for stale_after seconds
    devices: list[DeviceInfo]


class DevicesResponse(TypedDict):
    hosts: list[HostInfo]


class TargetInfo(TypedDict):
    """One GPU of a process's host, judged as the target of a migrate or resume."""
    device: DeviceInfo
    refusal: Optional[str]          # why a command to it would be refused; None: it fits


# --- server-sent events (GET .../events) -----------------------------------------------------
# Each event: "id: N", "event: TYPE", "data: JSON". TYPEs:
EVENT_HELLO = "hello"           # {"workspace": name, "last_event_id": N}
EVENT_PROCESS = "process"       # {"action": "registered"|"updated"|"removed"|"stale", "process": ProcessInfo | {"process_id"}}
EVENT_COMMAND = "command"       # {"action": "created"|"updated", "command": CommandInfo}
EVENT_DEVICES = "devices"       # {"host": name}: that host's GPUs changed; GET .../devices?host=name
EVENT_RESYNC = "resync"         # events were missed: reload the lists, then keep listening


def is_active(state: str) -> bool:
    return state in ACTIVE_COMMAND_STATES
