"""What both sides of the wire agree on besides the bodies: the address format and its
parser, paths, timing defaults, limits, states, error codes and event names. The bodies
themselves are the pydantic models of ``flexium.wire``, which take their limits from here.

All times on the wire are Unix epoch seconds (float). All sizes are bytes (int).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

PROTOCOL_VERSION = 1

# --- addressing -----------------------------------------------------------------------------

DEFAULT_PORT = 8080
HTTPS_PORT = 443
API_PREFIX = "/api"
TOKEN_HEADER = "Authorization"  # "Bearer <token>"
SESSION_COOKIE = "flexium_session"  # the dashboard's login: a server-side session's id, never a token
CSRF_HEADER = "X-Flexium-Request"  # must be present on unsafe requests authenticated by cookie
TOKEN_PREFIX = "flx_"
TOKEN_ENV = "FLEXIUM_TOKEN"
SERVER_ENV = "FLEXIUM_SERVER"
DATABASE_ENV = "FLEXIUM_DATABASE_URL"
CA_BUNDLE_ENV = "FLEXIUM_CA_BUNDLE"  # a PEM file of CAs the client trusts for https:// servers
DEFAULT_WORKSPACE = "default"

# Match with fullmatch(): with match(), "$" also takes a name followed by a newline.
WORKSPACE_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
PROCESS_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
_ASCII_DIGITS = re.compile(r"[0-9]+")


def ascii_number(text: str) -> int | None:
    """`text` as a non-negative integer when it is ASCII digits alone, else None: the one way a
    number is read from text on this wire. str.isdigit() also takes '²', which int() refuses,
    and '١', which int() reads as 1."""
    return int(text) if _ASCII_DIGITS.fullmatch(text) else None


# GPU UUIDs as NVML gives them ("GPU-" or, for a MIG instance, "MIG-", then hex and dashes).
_GPU_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z-]+")
# What people type for "the job's GPU N" that is not the syntax: cuda1, gpu:1, GPU 1, device-1.
_ALMOST_ORDINAL = re.compile(r"(?i)(cuda|gpu|device|dev)\s*[:#_-]?\s*([0-9]+)")


@dataclass(frozen=True)
class TargetText:
    """A person's name for a GPU, read by its syntax alone (which GPU it is, the server decides
    from the process's reports): ``cuda:N`` the job's own CUDA numbering (``ordinal``), digits
    nvidia-smi's index on the job's host (``index``), ``GPU-...`` a GPU UUID (``uuid``)."""

    ordinal: int | None = None
    index: int | None = None
    uuid: str | None = None


TARGET_SYNTAX = "cuda:N (the job's own numbering), N (nvidia-smi's index) or a GPU UUID (GPU-...)"
# A migrate's target, or the GPU a wait or a placement asks for, that lets the server pick: the GPU
# of the job's host with the most room it can use. "any" is what a wait first called it, still taken.
AUTO_TARGET = "auto"
# A target_refused error's detail key, true where the GPU named is none of the process's host: no queue
# can resume it there (the CLI offers --when-free only for a GPU that exists).
UNKNOWN_GPU = "unknown_gpu"
AUTO_TARGET_WORDS = (AUTO_TARGET, "any")


def nccl_ranks_on_one_gpu(placement: dict[int, str | None], restored: set[int]) -> str | None:
    """Why an operation of an NCCL job is refused when it would leave a rank the driver restores
    (``restored``) on one GPU with another rank (``placement``: rank -> the GPU's UUID after the
    operation), and what to do; None when each restored rank has its GPU to itself. NCCL's next
    collective fails in such a rank (fact `nccl-ranks-sharing-gpu-fail`). The one rule of the ranks, the
    server and the dashboard."""
    by_gpu: dict[str, list[int]] = {}
    for rank, uuid in sorted(placement.items()):
        if uuid is not None:
            by_gpu.setdefault(uuid, []).append(rank)
    for uuid, ranks in by_gpu.items():
        if len(ranks) > 1 and restored.intersection(ranks):
            together = ", ".join(str(rank) for rank in ranks[:-1]) + f" and {ranks[-1]}"
            return (
                f"ranks {together} of this NCCL job would be on one GPU ({uuid}) when the driver restores them, and "
                "NCCL's next collective fails in a rank restored on a GPU it shares with another rank (fact "
                "`nccl-ranks-sharing-gpu-fail` in docs/facts.md); give each rank a GPU of its own (launch the job with "
                "one per rank) to make it movable"
            )
    return None


def read_target(text: str, *, ordinals: int | None = None) -> TargetText:
    """The one reading of a target's syntax (the CLI checks with it before sending, the server
    resolves by it); ValueError names what is wrong and suggests what was probably meant.
    ``ordinals``: how many GPUs the job sees, where the reader knows: a number it cannot see is
    not suggested, its range is."""
    text = text.strip()
    if not text:
        raise ValueError(f"the target is empty: name a GPU as {TARGET_SYNTAX}")
    index = ascii_number(text)
    if index is not None:
        return TargetText(index=index)
    if text.startswith("cuda:"):
        ordinal = ascii_number(text[len("cuda:") :])
        if ordinal is None:
            raise ValueError(f"target {text!r} is not cuda:N (N: the job's CUDA ordinal, in digits 0-9)")
        return TargetText(ordinal=ordinal)
    if _GPU_UUID.fullmatch(text):
        return TargetText(uuid=text)
    almost = _ALMOST_ORDINAL.fullmatch(text)
    meant = ascii_number(almost.group(2)) if almost else None
    hint = ""
    if meant is not None and (ordinals is None or meant < ordinals):
        hint = f"; did you mean cuda:{meant}?"
    elif meant is not None and ordinals:
        hint = f"; the job sees cuda:0 to cuda:{ordinals - 1}"
    raise ValueError(f"target {text!r} is not a GPU name: use {TARGET_SYNTAX}{hint}")


@dataclass(frozen=True)
class ServerAddress:
    """A parsed ``host[:port]/workspace``: what the client, the CLI and ``flexium.config``
    (which checks the host more strictly) all hold."""

    host: str  # without IPv6 brackets
    port: int  # where the address names none: HTTPS_PORT for https://, else DEFAULT_PORT
    workspace: str
    scheme: str  # "http" (the default) or "https"

    @property
    def base_url(self) -> str:
        """``http://gpu-server:8080``, ``https://[::1]:8443``: no workspace, no trailing slash."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.base_url}/{self.workspace}"


def parse_server_address(address: str) -> ServerAddress:
    """``host[:port]/workspace`` (what ``--server`` and FLEXIUM_SERVER take) -> parts. ``http://`` or ``https://`` may
    prefix it; without a scheme, http is used. Raises ValueError with the reason."""
    text = (address or "").strip()
    scheme = "http"
    for prefix in ("http://", "https://"):
        if text.lower().startswith(prefix):
            scheme = prefix[:-3]
            text = text[len(prefix) :]
            break
    hostport, sep, workspace = text.partition("/")
    workspace = workspace.strip("/")
    if not sep or not workspace:
        raise ValueError(f"server address {address!r} has no workspace: expected host[:port]/workspace")
    if not WORKSPACE_NAME_RE.fullmatch(workspace):
        raise ValueError(
            f"server address {address!r}: workspace {workspace!r} is not a valid name "
            "(lowercase letters, digits, '.', '_', '-'; at most 63)"
        )
    # An https:// address without a port is a TLS endpoint (a reverse proxy), on 443 as browsers
    # assume; a bare host:... or http:// one is flexium's own port.
    host, port = hostport, HTTPS_PORT if scheme == "https" else DEFAULT_PORT
    if hostport.startswith("["):  # [::1]:8080
        end = hostport.find("]")
        if end < 0:
            raise ValueError(f"server address {address!r}: unclosed '['")
        host, rest = hostport[1:end], hostport[end + 1 :]
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
    port = ascii_number(text)
    if port is None or not 0 < port < 65536:
        raise ValueError(f"server address {address!r}: port {text!r} is not a number in 1..65535")
    return port


def workspace_path(workspace: str) -> str:
    """Prefix of every workspace-scoped API path, e.g. ``/api/w/default``."""
    return f"{API_PREFIX}/w/{workspace}"


PATH_HEALTH = "/healthz"  # not under a workspace, no token


# Paths below are relative to workspace_path(workspace).
PATH_PROCESSES = "/processes"
PATH_PROCESS = "/processes/{process_id}"
PATH_HEARTBEAT = "/processes/{process_id}/heartbeat"
PATH_NEXT_COMMAND = "/processes/{process_id}/commands/next"  # long-poll, ?wait=seconds
PATH_COMMANDS = "/commands"
PATH_COMMAND = "/commands/{command_id}"  # ?wait=seconds: until finished
PATH_COMMAND_REPORT = "/commands/{command_id}/report"
PATH_TARGETS = "/processes/{process_id}/targets"  # ?kind=migrate|resume: which GPUs fit
PATH_OPERATION = "/operations/{operation_id}"  # ?wait=seconds: until every rank's command ended
PATH_JOBS = "/jobs"  # multi-process jobs, each with its ranks
PATH_DEVICES = "/devices"
PATH_EVENTS = "/events"  # text/event-stream
PATH_TOKENS = "/tokens"
PATH_TOKEN = "/tokens/{token_id}"
PATH_AUDIT = "/audit"  # newest first
PATH_WAITS = "/waits"  # the resume-when-free queue: POST queues a paused job, GET lists
PATH_WAIT = "/waits/{wait_id}"  # DELETE cancels
PATH_DRAINS = "/drains"  # POST drains a GPU of a host (or all of them), GET lists the drains
PATH_DRAIN = "/drains/{drain_id}"  # GET: its progress, job by job; DELETE undrains
PATH_PRIORITY = "/processes/{process_id}/priority"  # PUT: a job's priority (admin)
PATH_PLACEMENTS = "/placements"  # flexium run: POST places a job not started yet, GET lists
PATH_PLACEMENT = "/placements/{placement_id}"  # DELETE: flexium run is done with it
PATH_PLACEMENT_REPORT = "/placements/{placement_id}/report"  # POST: asked again, with the host's GPUs now

# --- timing defaults (the server sends its own values in wire.RegisterResponse) ------------------

HEARTBEAT_INTERVAL_S = 5.0
POLL_TIMEOUT_S = 25.0  # a long-poll with nothing to deliver answers 204 after this
MAX_POLL_TIMEOUT_S = 60.0
STALE_AFTER_S = 30.0  # no heartbeat for this long: shown STALE
REMOVE_AFTER_S = 900.0  # no heartbeat for this long: removed
COMMAND_TTL_S = 300.0  # queued/delivered but never started for this long: expired
# A paused job waiting in the queue reads its GPUs this often (through its NVML reader process)
# and reports at once when one it may use has the room it needs: resumed within about a second
# of a neighbour's exit, where device reports ride heartbeats every HEARTBEAT_INTERVAL_S.
ROOM_WATCH_INTERVAL_S = 0.15
RESERVATION_TTL_S = 300.0  # room made for a job is held for it this long at most
# What a job flexium run started has not taken yet of its room stays held this long from its
# registration: a job registers at flexium.init(), before it loads its data and allocates.
STARTED_HOLD_S = 900.0
# The headroom a job's own room check asks beside other processes or on another GPU
# (engine/target_rules.py's DEFAULT_MEMORY_MARGIN_BYTES): the server's queue asks the same.
ROOM_MARGIN_BYTES = 512 << 20

# --- limits the server enforces (4xx, never 5xx) --------------------------------------------

MAX_BODY_BYTES = 1 << 20
MAX_SHORT_TEXT = 128
MAX_HOST_LEN = 255
MAX_LONG_TEXT = 4096
MAX_REASON_LEN = 200  # a command's reason: one line a colleague reads on the timeline
MAX_DEVICES = 64
MAX_RANKS = 1 << 16  # of one multi-process job
MAX_JSON_DEPTH = 8
MAX_JSON_ITEMS = 512
MAX_INT = 1 << 62  # memory sizes, pids: fits every database's BIGINT

# --- states ---------------------------------------------------------------------------------

# Each set of values is written once, as a Literal type (what the wire models and mypy
# check); the tuples beside them, for code that iterates the values, are derived from it.

# What a process reports (flexium.engine.operations.EngineState values). FAILED: a rollback
# failed, the process may be stuck; it takes no command, the job must be restarted.
ProcessState = Literal["RUNNING", "MIGRATING", "PAUSING", "PAUSED", "RESUMING", "FAILED"]
PROCESS_STATES: tuple[str, ...] = get_args(ProcessState)
FAILED = "FAILED"
# What the server shows: the reported state, or STALE when heartbeats stopped.
DisplayState = Literal[ProcessState, "STALE"]
DISPLAY_STATES: tuple[str, ...] = get_args(DisplayState)  # a nested Literal is flattened
STALE = "STALE"

CommandKind = Literal["migrate", "pause", "resume"]
COMMAND_KINDS: tuple[str, ...] = get_args(CommandKind)

CommandState = Literal["queued", "delivered", "running", "succeeded", "failed", "expired"]
COMMAND_STATES: tuple[str, ...] = get_args(CommandState)
ACTIVE_COMMAND_STATES: tuple[str, ...] = ("queued", "delivered", "running")
PENDING_COMMAND_STATES: tuple[str, ...] = ("queued", "delivered")  # what a long-poll hands out
FINAL_COMMAND_STATES: tuple[str, ...] = ("succeeded", "failed", "expired")
ReportState = Literal["running", "succeeded", "failed"]  # what a process may report
REPORT_STATES: tuple[str, ...] = get_args(ReportState)

# The NVIDIA driver each capability needs. NVIDIA's cuda-checkpoint tool checkpoints from driver 550
# through an interface of its own; the public cuCheckpointProcess* calls that flexium makes in the
# job's process arrive with CUDA 12.8, driver 570. Moving restores onto other GPUs: CUDA 13.0, 580.
PAUSE_RESUME_MIN_DRIVER = 570
MIGRATION_MIN_DRIVER = 580
DRIVER_NEEDS = f"{PAUSE_RESUME_MIN_DRIVER}+ to pause and resume, {MIGRATION_MIN_DRIVER}+ to move between GPUs"

# Capability keys a process reports (flexium.utils.get_capabilities()).
CAP_PAUSE_RESUME = "pause_resume"
CAP_MIGRATION = "migration"
# Whether the job's memory is in flexium's pool (moves can take the fast path), and if not, why.
CAP_FAST_PATH = "fast_path"
CAP_FAST_PATH_PROBLEM = "fast_path_problem"

# GPU health (wire.GpuReport.health): "ok", "unknown" (NVML cannot read the ECC counters: nothing
# known against it) or a short reason. Only a known-bad health refuses a GPU as a target.
HEALTH_OK = "ok"
HEALTH_UNKNOWN = "unknown"
TARGETABLE_HEALTH = (HEALTH_OK, HEALTH_UNKNOWN)

# --- priorities and the queue ----------------------------------------------------------------

# A job's priority is a number: the resume-when-free queue resumes a higher one first (first come,
# first served within one), and making room pauses only jobs of a lower one. The names people
# type stand for these numbers, here only.
PRIORITIES: dict[str, int] = {"low": 10, "normal": 50, "high": 90}
DEFAULT_PRIORITY = PRIORITIES["normal"]
MAX_PRIORITY = 100
PRIORITY_SYNTAX = f"low, normal, high or a number 0-{MAX_PRIORITY} (higher goes first)"


def read_priority(text: str | int) -> int:
    """A priority as people give it (a name of PRIORITIES or a number 0..MAX_PRIORITY); ValueError
    says what is accepted. The one reading: flexium.init(priority=), FLEXIUM_PRIORITY, the CLI
    and the API."""
    if isinstance(text, bool):
        raise ValueError(f"priority {text!r} is not {PRIORITY_SYNTAX}")
    value = text if isinstance(text, int) else PRIORITIES.get(text.strip().lower(), ascii_number(text.strip()))
    if value is None or not 0 <= value <= MAX_PRIORITY:
        raise ValueError(f"priority {text!r} is not {PRIORITY_SYNTAX}")
    return value


def priority_name(value: int) -> str:
    """``high`` for 90, ``70`` for 70."""
    return next((name for name, number in PRIORITIES.items() if number == value), str(value))


# waiting: in the queue; dispatched: its resume command was created; done: that resume succeeded;
# cancelled: by a person, a plain pause or resume, or because the job cannot resume any more.
WaitState = Literal["waiting", "dispatched", "done", "cancelled"]
WAIT_STATES: tuple[str, ...] = get_args(WaitState)
LIVE_WAIT_STATES: tuple[str, ...] = ("waiting", "dispatched")

# flexium run's placements. waiting: for room on its host; placed: a GPU chosen and its room held;
# started: its job registered and took that room; ended: placed, but its flexium run ended first;
# cancelled: never placed (Ctrl-C, its flexium run stopped asking).
PlacementState = Literal["waiting", "placed", "started", "ended", "cancelled"]
PLACEMENT_STATES: tuple[str, ...] = get_args(PlacementState)
LIVE_PLACEMENT_STATES: tuple[str, ...] = ("waiting", "placed")
# What flexium run hands its job: the placement whose held room its registration takes.
PLACEMENT_ENV = "FLEXIUM_PLACEMENT"

# What a drain did to one job on the GPUs it drains: moved it to another GPU of its host (migrate),
# paused it to resume when free (pause: it fits nowhere, or its move failed), or nothing it could
# (refused: the note says why; the drain goes on with the others).
DrainAction = Literal["migrate", "pause", "refused"]
DRAIN_ACTIONS: tuple[str, ...] = get_args(DrainAction)
# draining: moves under way (or jobs on its GPUs still to move); drained: done; ended: undrained.
DrainState = Literal["draining", "drained", "ended"]

# --- roles of tokens -------------------------------------------------------------------------

# admin: everything. job: what a training job does, and only to the processes it registered
# (register, heartbeat, report, poll and read its own commands). viewer: reads everything,
# writes nothing.
TokenRole = Literal["admin", "job", "viewer"]
TOKEN_ROLES: tuple[str, ...] = get_args(TokenRole)
ROLE_ADMIN: TokenRole = "admin"
ROLE_JOB: TokenRole = "job"
ROLE_VIEWER: TokenRole = "viewer"
# What each role may do, as `flexium token issue --role` and the dashboard's issue form say it.
ROLE_PURPOSES: dict[str, str] = {
    ROLE_JOB: "what a training job does, to the processes it registers",
    ROLE_VIEWER: "reads everything, changes nothing",
    ROLE_ADMIN: "everything: commands, tokens",
}
# What `flexium token issue` and POST /tokens give when no role is named: most tokens handed
# out go to training jobs, and a token that can do less is the safer one to hand out by mistake.
DEFAULT_ISSUED_ROLE: TokenRole = ROLE_JOB
# Why a token no longer opens doors: revoked (by a person, or with the token that minted it), or
# expired (its life, given when it was issued, is over).
TokenEnd = Literal["revoked", "expired"]
TokenState = Literal["active", "revoked", "expired"]
# The longest life a token may be given (a slip of a unit should not make one forever).
MAX_TOKEN_LIFE_S = 10 * 366 * 86400.0

# --- doors: how a command came in ------------------------------------------------------------

# Who acted is a token's name and the door it came through: flexium's command line (its
# User-Agent ends with CLI_AGENT_MARK), the dashboard (a session), one of the server's own
# policies, or any other client of the API.
Door = Literal["cli", "dashboard", "policy", "api"]
DOORS: tuple[str, ...] = get_args(Door)
CLI_AGENT_MARK = "(cli)"

# --- errors ---------------------------------------------------------------------------------

# Every 4xx/5xx body is {"error": CODE, "message": "...", "detail": optional}.
ERROR_STATUS: dict[str, int] = {
    "bad_request": 400,  # malformed JSON, unreadable body
    "unauthorized": 401,  # no token, unknown or revoked token
    "forbidden": 403,  # the token's role may not do this; cookie write without the CSRF header; cross-site login
    "not_found": 404,  # unknown id, or another workspace's (never told apart)
    "invalid_state": 409,  # e.g. pause a paused job
    "busy": 409,  # the process already has an active command
    "stale": 409,  # the process stopped sending heartbeats
    "payload_too_large": 413,
    "header_fields_too_large": 431,  # a header block past --max-header-bytes or --max-header-lines
    "quota_exceeded": 409,  # the workspace holds all the processes or tokens its quota allows
    "invalid_request": 422,  # wrong types, out-of-range values
    "target_refused": 422,  # unknown GPU, other host, other model, no room, same GPU
    "capability": 422,  # the process lacks the feature (driver too old)
    "too_many_requests": 429,  # the client holds its share of a bound (event streams per token)
    "unavailable": 503,  # database unreachable
    "internal": 500,
}


# --- server-sent events (GET .../events) -----------------------------------------------------
# Each event: "id: N", "event: TYPE", "data: JSON". TYPEs:
EVENT_HELLO = "hello"  # {"workspace": name, "last_event_id": N}
EVENT_PROCESS = (
    "process"  # {"action": "registered"|"updated"|"removed"|"stale", "process": wire.ProcessInfo | {"process_id"}}
)
EVENT_COMMAND = "command"  # {"action": "created"|"updated", "command": wire.CommandInfo}
EVENT_COMMAND_REFUSED = "command_refused"  # {"request": wire.CommandRequest, "reason": text}: none was created
EVENT_PROGRESS = "progress"  # {"processes": [{"process_id", "steps", "steps_at", "steps_per_s", "loss"}]}: stored
EVENT_WAIT = "wait"  # {"action": "created"|"updated", "wait": wire.WaitInfo}: the queue changed
EVENT_DRAIN = "drain"  # {"action": "created"|"updated"|"ended", "drain": wire.DrainInfo}: a drain acted
EVENT_DEVICES = "devices"  # {"host": name}: that host's GPUs changed; GET .../devices?host=name
EVENT_PLACEMENT = "placement"  # {"action": "created"|"updated", "placement": wire.PlacementInfo}: asked, placed, ended
EVENT_RESYNC = "resync"  # events were missed: reload the lists, then keep listening


def is_active(state: str) -> bool:
    return state in ACTIVE_COMMAND_STATES
