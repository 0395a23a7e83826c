"""The bodies on the wire between training processes, the CLI, the dashboard and the server:
one pydantic model per shape, used by both sides. The server validates requests and
documents responses with them (the served OpenAPI, ``/openapi.json`` and ``/docs``, is the
reference); the client builds its requests and reads the answers through them. Constants,
paths and limits are in ``flexium.protocol``.

Requests (``WireIn``) are validated strictly: a string is not a number, floats are finite,
strings are bounded and free of NUL (which PostgreSQL refuses in text: it would otherwise
surface as a 500), a command's result and a process's capabilities are bounded in depth and
size. Every model ignores fields it does not know, so an older server accepts a newer client
and an older client reads a newer server.

A client sends a request with ``model_dump(exclude_unset=True)``: a field it set to None
(``gpu_uuid`` of a process without flexium's engine, so without a GPU of its own) is sent as
null and means "none", a field it left out means "unchanged".

A process's location is one fact, ``gpu_uuid``, read with ``visible_gpus`` (its CUDA ordinal
order): ``ProcessInfo.gpu_index`` and ``physical_device`` are derived when the server builds
the answer, and ``cuda_ordinal`` is the one derivation of ``cuda:N``.

All times are Unix epoch seconds (float); all sizes are bytes (int).
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NoReturn

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StringConstraints,
    computed_field,
    field_validator,
    model_validator,
)

from flexium import protocol
from flexium.protocol import CommandKind as CommandKind
from flexium.protocol import CommandState as CommandState
from flexium.protocol import DisplayState as DisplayState
from flexium.protocol import ProcessState as ProcessState
from flexium.protocol import ReportState as ReportState
from flexium.protocol import WaitState as WaitState
from flexium.simulated import SIMULATED_DRIVER


def _no_nul(value: str) -> str:
    """Text both databases store and JSON carries: no NUL (PostgreSQL refuses it in text) and no
    lone surrogate (no UTF-8 for it: Python keeps undecodable file names and arguments so)."""
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"must be valid Unicode text: U+{ord(value[exc.start]):04X} at position {exc.start} is a lone "
            "surrogate (clean text with flexium.wire.clean_text before sending it)"
        ) from None
    return value


def clean_text(value: str) -> str:
    """`value` made valid for the wire: what Python smuggled in as lone surrogates (the bytes of
    a file name or argument that are not UTF-8) becomes U+FFFD, NUL becomes U+FFFD."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = "".join("\ufffd" if "\ud800" <= char <= "\udfff" else char for char in value)
    return value.replace("\x00", "\ufffd")


def _cleaned(node: Any) -> Any:
    if isinstance(node, str):
        return clean_text(node)
    if isinstance(node, dict):
        return {_cleaned(key): _cleaned(item) for key, item in node.items()}
    if isinstance(node, list):
        return [_cleaned(item) for item in node]
    return node


def _check_json(value: object) -> None:
    """Bounded depth and size, finite numbers, no NUL: anything both databases store. A model
    in the tree counts as the JSON it dumps to. A refusal says where in `value` it is
    (``problems.0: must not contain NUL characters``): the validation error names only the
    field that holds it."""
    budget = [protocol.MAX_JSON_ITEMS]

    def refuse(where: str, reason: object) -> NoReturn:
        raise ValueError(f"{where}: {reason}" if where else str(reason)) from None

    def text(where: str, node: str) -> None:
        try:
            _no_nul(node)
        except ValueError as exc:
            refuse(where, exc)

    def walk(node: object, depth: int, where: str) -> None:
        if isinstance(node, BaseModel):
            node = node.model_dump()
        if depth > protocol.MAX_JSON_DEPTH:
            raise ValueError(f"nested deeper than {protocol.MAX_JSON_DEPTH} levels")
        budget[0] -= 1
        if budget[0] < 0:
            raise ValueError(f"more than {protocol.MAX_JSON_ITEMS} values")
        inside = f"{where}." if where else ""
        if isinstance(node, dict):
            for key, item in node.items():
                if not isinstance(key, str):
                    refuse(where, "object keys must be strings")
                text(f"{inside}(a key)", key)
                walk(item, depth + 1, inside + key)
        elif isinstance(node, (list, tuple)):  # a tuple goes out as a JSON array
            for index, item in enumerate(node):
                walk(item, depth + 1, f"{inside}{index}")
        elif isinstance(node, str):
            text(where, node)
            if len(node) > protocol.MAX_LONG_TEXT:
                refuse(where, f"a string is longer than {protocol.MAX_LONG_TEXT} characters")
        elif isinstance(node, bool) or node is None:
            pass
        elif isinstance(node, int):
            if abs(node) > protocol.MAX_INT:
                refuse(where, "a number is out of range")
        elif isinstance(node, float):
            if not math.isfinite(node):
                refuse(where, "numbers must be finite")
        else:
            refuse(where, f"unsupported value of type {type(node).__name__}")

    walk(value, 0, "")


ShortText = Annotated[str, StringConstraints(max_length=protocol.MAX_SHORT_TEXT), AfterValidator(_no_nul)]
NonEmptyText = Annotated[
    str,
    StringConstraints(min_length=1, max_length=protocol.MAX_SHORT_TEXT, strip_whitespace=True),
    AfterValidator(_no_nul),
]
HostName = Annotated[
    str,
    StringConstraints(min_length=1, max_length=protocol.MAX_HOST_LEN, strip_whitespace=True),
    AfterValidator(_no_nul),
]
LongText = Annotated[str, StringConstraints(max_length=protocol.MAX_LONG_TEXT), AfterValidator(_no_nul)]
ProcessId = Annotated[str, StringConstraints(pattern=protocol.PROCESS_ID_RE.pattern)]
# C0 and C1 controls (newlines and tabs too) and the bidirectional overrides and isolates: what
# would break the line it is shown on, in a terminal or on a page, or reorder what is read.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _one_line(value: str) -> str:
    found = _UNPRINTABLE.search(value)
    if found is not None:
        raise ValueError(
            f"must be one line of printable text: U+{ord(found.group()):04X} at position {found.start()} is a "
            "control character"
        )
    return value


Reason = Annotated[
    str, StringConstraints(max_length=protocol.MAX_REASON_LEN, strip_whitespace=True), AfterValidator(_one_line)
]
Bytes = Annotated[int, Field(ge=0, le=protocol.MAX_INT)]
Seq = Annotated[int, Field(ge=0, le=protocol.MAX_INT, description="grows with every body the process builds")]
Pid = Annotated[int, Field(ge=0, le=1 << 40)]
GpuIndex = Annotated[int, Field(ge=0, le=4095)]
Epoch = Annotated[float, Field(ge=0, le=1e11)]
Rank = Annotated[int, Field(ge=0, le=protocol.MAX_RANKS - 1)]
WorldSize = Annotated[int, Field(ge=1, le=protocol.MAX_RANKS)]
Priority = Annotated[
    int, Field(ge=0, le=protocol.MAX_PRIORITY, description=f"a job's priority: {protocol.PRIORITY_SYNTAX}")
]

TargetKind = Literal["migrate", "resume"]


def cuda_ordinal(visible_gpus: Sequence[str], gpu_uuid: str | None) -> str | None:
    """``cuda:N`` of GPU ``gpu_uuid`` in a job's own CUDA numbering (``visible_gpus``: its GPU
    UUIDs in ordinal order, as it registered them), or None when the job does not see it.
    The one derivation: the server's ``ProcessInfo.physical_device``, the CLI and the client
    all show a GPU through it."""
    if gpu_uuid is None or gpu_uuid not in visible_gpus:
        return None
    return f"cuda:{list(visible_gpus).index(gpu_uuid)}"


def job_name(cmdline: str) -> str:
    """A short name for a process from its command line, as a person recognizes it: the script
    (``train.py``, wherever it stands: ``torchrun`` and ``python -m torch.distributed.run`` come
    first), else the ``-m`` module, else the program. The one derivation: ``ProcessInfo.name``,
    which the CLI and the dashboard show."""
    try:
        words = shlex.split(cmdline)
    except ValueError:  # unbalanced quotes (the client clips long command lines)
        words = [word.strip("'\"") for word in cmdline.split()]
    for word in words:
        if word.endswith(".py") and len(word) > 3:
            return word.rsplit("/", 1)[-1]
    for option, following in zip(words, words[1:], strict=False):
        if option == "-m":
            return following
    return words[0].rsplit("/", 1)[-1] if words else ""


class WireIn(BaseModel):
    """A request body."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class WireOut(BaseModel):
    """A response body. Its text is made valid as it is built: a row stored before requests
    were checked (or by another writer) never makes an answer fail to encode."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: object) -> object:
        return _cleaned(data) if isinstance(data, dict) else data


# --- requests -------------------------------------------------------------------------------


class GpuReport(WireIn):
    """One GPU of the reporting host, read through NVML (every GPU, not only the job's)."""

    uuid: NonEmptyText
    index: GpuIndex | None = Field(default=None, description="nvidia-smi's index on that host")
    name: ShortText = Field(default="", description="model, e.g. 'NVIDIA H200'")
    memory_total: Bytes = 0
    memory_used: Bytes = Field(default=0, description="everything on it, ours and others'")
    process_bytes: Bytes | None = Field(
        default=None,
        description="what the reporting process holds on it (NVML); none when NVML cannot say (a process may use "
        "several GPUs)",
    )
    utilization: Annotated[int, Field(ge=0, le=100)] | None = None
    temperature: Annotated[int, Field(ge=-100, le=300)] | None = None
    health: ShortText = Field(
        default=protocol.HEALTH_OK,
        description=(
            "'ok', 'unknown' (NVML cannot read the ECC counters) or a short reason ('xid 79'); "
            "only a known-bad health refuses a GPU as a target"
        ),
    )


class JobMembership(WireIn):
    """This process's place in a multi-process torch.distributed job (torchrun): every rank of
    one run sends the same ``key``, and the server shows and moves them as one job."""

    key: NonEmptyText = Field(description="the same for every rank of one run, unique to that run")
    rank: Rank
    world_size: WorldSize
    local_rank: Rank | None = None
    local_world_size: WorldSize | None = Field(default=None, description="ranks on this host")
    node_rank: Rank | None = Field(default=None, description="this host's rank in a multi-node job")


class RegisterRequest(WireIn):
    process_id: ProcessId
    host: HostName
    user: ShortText = ""
    pid: Pid = 0
    gpu_uuid: ShortText | None = Field(
        default=None, description="the GPU it is on, or paused from; None: no engine, no GPU of its own"
    )
    gpu_model: ShortText = ""
    logical_device: ShortText = Field(default="", description="what the training code uses, 'cuda:0'")
    visible_gpus: Annotated[
        list[NonEmptyText],
        Field(
            max_length=protocol.MAX_DEVICES,
            description=("GPU UUIDs in this process's CUDA ordinal order: target 'cuda:N' is entry N"),
        ),
    ] = []
    torch_version: ShortText = ""
    driver_version: ShortText = ""
    flexium_version: ShortText = ""
    capabilities: ProcessCapabilities = Field(default_factory=lambda: ProcessCapabilities())
    memory_bytes: Bytes = Field(default=0, description="held on its GPU now")
    footprint_bytes: Bytes | None = Field(default=None, description="needed on a GPU (kept while paused)")
    state: ProcessState = "RUNNING"
    started_at: Epoch | None = None
    cmdline: LongText = ""
    devices: Annotated[list[GpuReport], Field(max_length=protocol.MAX_DEVICES)] = []
    seq: Seq | None = None
    job: JobMembership | None = Field(default=None, description="None: a single-process job")
    steps: Bytes | None = Field(default=None, description="optimizer steps taken so far; None: not counted")
    loss: float | None = Field(default=None, description="the last loss the job reported (flexium.auto.report)")
    priority: Priority | None = Field(
        default=None,
        description="its priority as the job was started with (FLEXIUM_PRIORITY); taken when the process is new "
        "(an admin's change outlives a registration again); None: normal",
    )
    placement_id: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = Field(
        default=None, description="the placement flexium run started it with: its registration takes the room held"
    )


class HeartbeatRequest(WireIn):
    """``seq`` grows with every body the process builds (the client sends
    ``time.monotonic_ns()``, taken before it reads what the body says, its GPUs included). The
    server ignores what a heartbeat says (state, placement, memory, devices) when its seq is
    older than the last applied register, heartbeat or command report's ``process``: a beat
    built during a pause (PAUSING) and delivered after the final report (PAUSED) changes
    nothing. A body without it is applied as it comes."""

    state: ProcessState | None = None
    memory_bytes: Bytes | None = None
    footprint_bytes: Bytes | None = None
    gpu_uuid: ShortText | None = None
    devices: Annotated[list[GpuReport], Field(max_length=protocol.MAX_DEVICES)] = []
    seq: Seq | None = None
    steps: Bytes | None = Field(
        default=None, description="optimizer steps taken so far (the server derives steps/s from two beats)"
    )
    loss: float | None = Field(default=None, description="the last loss the job reported (flexium.auto.report)")
    room_seen: bool = Field(
        default=False,
        description="a paused job waiting in the queue saw the room it needs appear on a GPU it watches "
        "(HeartbeatResponse.watch): its devices are stored at once and the queue decides",
    )


class CommandRequest(WireIn):
    kind: CommandKind
    process_id: ProcessId
    target: StrictInt | ShortText | None = Field(
        default=None,
        description=(
            "the GPU: 'cuda:N' = entry N of the process's visible_gpus (the job's own CUDA "
            "numbering), a bare integer (or digits) = the nvidia-smi index on the process's host, "
            "'GPU-...' = a GPU UUID; migrate: 'auto' = the GPU of its host with the most room it can use, not "
            "drained (refused with each GPU's reason when none fits). The server resolves it to a UUID once; resume: "
            "optional. For a "
            "rank of a multi-process job: where this rank goes (the others stay)"
        ),
    )
    ranks: dict[NonEmptyText, StrictInt | ShortText] | None = Field(
        default=None,
        max_length=protocol.MAX_RANKS,
        description=(
            "a multi-process job only: rank (as text) -> target, in the addressed process's numbering; "
            "migrate and resume of several ranks at once (a swap); ranks left out stay where they are"
        ),
    )
    gpus: dict[NonEmptyText, StrictInt | ShortText] | None = Field(
        default=None,
        max_length=protocol.MAX_RANKS,
        description=(
            "migrate of one process on several GPUs (DataParallel, a split model) only: a GPU it uses now -> "
            "the GPU its memory there goes to, both named as targets are; GPUs left out stay, unless a named "
            "one moves onto theirs (then they swap)"
        ),
    )
    reason: Reason | None = Field(
        default=None,
        description=f"why, in one line of at most {protocol.MAX_REASON_LEN} characters: the job's timeline and "
        "the audit show it beside who sent the command (empty: none given)",
    )


class ProcessUpdate(WireIn):
    """Where the process is after an operation, in its own word."""

    state: ProcessState | None = None
    gpu_uuid: ShortText | None = None
    memory_bytes: Bytes | None = None
    seq: Seq | None = None


class CommandReport(WireIn):
    state: ReportState
    result: OperationReport | None = None
    error: LongText | None = None
    process: ProcessUpdate | None = None


class WaitRequest(WireIn):
    """Queue a paused job to be resumed when room appears (``flexium resume JOB --when-free``), or make
    room for it at once by pausing jobs of a lower priority (``--make-room``)."""

    process_id: ProcessId = Field(description="the paused process; a rank of a job of several stands for its job")
    gpu: StrictInt | ShortText | None = Field(
        default=None,
        description="the GPU it waits for, named as a command's target is; None or 'auto' ('any' is taken too): the "
        "first GPU of its host with room (where it paused first)",
    )
    host: HostName | None = Field(
        default=None, description="the host it resumes on, which must be its own (a job resumes on its host's GPUs)"
    )
    make_room: bool = Field(
        default=False,
        description="pause the fewest jobs of lower priority on one GPU to free what it needs, hold that room for "
        "it and resume it there; the jobs paused wait in the queue to resume when free",
    )
    reason: Reason | None = Field(
        default=None,
        description=f"why, in one line of at most {protocol.MAX_REASON_LEN} characters: kept on the wait, shown in "
        "the queue and the job's timeline, and carried by the commands the server sends for it (empty: none given)",
    )


class PlacementRequest(WireIn):
    """``flexium run``: start a job on a GPU of its host once that GPU has the room it needs."""

    host: HostName = Field(description="the host the job runs on, as its processes report it")
    gpu_uuid: ShortText | None = Field(default=None, description="the GPU it must run on; None: the one with most room")
    memory_bytes: Bytes = Field(default=0, description="the GPU memory it needs (0: a GPU with the most room, now)")
    priority: Priority = protocol.DEFAULT_PRIORITY
    make_room: bool = Field(
        default=False,
        description="pause the fewest jobs of lower priority on one GPU to free what it needs and hold that room "
        "for it (admin); the jobs paused wait in the queue to resume when free",
    )
    command: LongText = Field(default="", description="its command line, as people see it in the queue")
    devices: Annotated[list[GpuReport], Field(max_length=protocol.MAX_DEVICES)] = Field(
        default_factory=list, description="the host's GPUs as flexium run reads them now"
    )
    reason: Reason | None = Field(
        default=None,
        description=f"why, in one line of at most {protocol.MAX_REASON_LEN} characters: kept on the placement, in "
        "the audit log, and carried by the commands the server sends for it (empty: none given)",
    )

    @field_validator("priority", mode="before")
    @classmethod
    def _named(cls, value: object) -> object:
        return protocol.read_priority(value) if isinstance(value, str) else value


class PlacementReport(WireIn):
    """``flexium run`` asks again while it waits (and until its job registers): its host's GPUs now."""

    devices: Annotated[list[GpuReport], Field(max_length=protocol.MAX_DEVICES)] = []


class PriorityRequest(WireIn):
    priority: Priority

    @field_validator("priority", mode="before")
    @classmethod
    def _named(cls, value: object) -> object:
        return protocol.read_priority(value) if isinstance(value, str) else value


class TokenRequest(WireIn):
    name: ShortText = ""
    role: protocol.TokenRole = Field(
        default=protocol.DEFAULT_ISSUED_ROLE,
        description="admin: everything; job: a training job's own processes; viewer: reads only",
    )
    expires_in_s: float | None = Field(
        default=None,
        gt=0,
        le=protocol.MAX_TOKEN_LIFE_S,
        allow_inf_nan=False,
        description="its life in seconds, after which it is refused as a revoked token is (at most 10 years); "
        "None: valid until revoked. A token never outlives the token that minted it: without a life it gets its "
        "minter's, and a longer one is refused",
    )


# --- responses ------------------------------------------------------------------------------


class ErrorBody(WireOut):
    """Every 4xx/5xx answer; ``error`` is a key of ``protocol.ERROR_STATUS``."""

    error: str
    message: str
    detail: Any = None


class JobCommandInfo(WireOut):
    """The part of a command that makes it one rank's share of a whole-job operation: the server
    creates one command per rank, all with the same ``operation_id``, and the ranks carry it out
    together (docs/design.md, "Distributed jobs")."""

    operation_id: int = Field(description="shared by the commands of every rank of one job operation")
    job_key: str
    rank: int = Field(description="the rank this command is for")
    world_size: int
    moves: dict[str, str] = Field(description="rank (as text) -> target GPU UUID, for every rank that changes GPU")


class JobInfo(WireOut):
    """A process's job, as ``JobMembership`` said it."""

    key: str
    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None
    node_rank: int | None = None


class CommandInfo(WireOut):
    id: int
    kind: CommandKind
    process_id: str
    state: CommandState
    target_uuid: str | None = Field(description="the GPU the server resolved the target to")
    gpu_moves: dict[str, str] | None = Field(
        default=None,
        description="a migrate GPU by GPU (a process on several GPUs): GPU UUID now -> GPU UUID after; "
        "target_uuid is then where the process's own device goes",
    )
    created_at: float
    delivered_at: float | None
    started_at: float | None
    finished_at: float | None
    deliveries: int
    result: OperationReport | None
    error: str | None
    job: JobCommandInfo | None = Field(default=None, description="None: a command for this process alone")
    reason: str | None = Field(
        default=None,
        description="why it was sent: the sender's reason (CommandRequest.reason), or the server's when its own "
        "policy sent it (resume when free, make room)",
    )
    sent_by: str | None = Field(
        default=None, description="who sent it: the token's name, or the server's policy ('policy: make room')"
    )
    door: protocol.Door | None = Field(
        default=None,
        description="how it came in: 'cli' (flexium's command line), 'dashboard', 'policy' (the server on its own) "
        "or 'api' (any other client); None: sent before the server recorded it",
    )

    @property
    def took_s(self) -> float | None:
        """How long it took: the operation's own measure when the process sent one, else the server's
        clock from its start to its end; None before it ended (or when it never started)."""
        seconds = self.result.seconds if self.result is not None else None
        if seconds is not None and seconds >= 0:
            return seconds
        if self.finished_at is not None and self.started_at is not None:
            return self.finished_at - self.started_at
        return None


class ProcessInfo(WireOut):
    process_id: str
    host: str
    user: str
    pid: int
    state: DisplayState = Field(description="the reported state, or STALE when heartbeats stopped")
    reported_state: ProcessState
    stale: bool
    gpu_uuid: str | None = Field(description="the GPU it is on, or paused from; None: no engine, no GPU of its own")
    gpu_model: str
    gpu_index: int | None = Field(description="nvidia-smi index of gpu_uuid, from its host's device reports")
    other_gpus: list[str] = Field(
        default_factory=list,
        description="the other GPUs it holds memory on, by UUID (one process on several GPUs: DataParallel, a model "
        "split over devices); empty for a process on one GPU",
    )
    logical_device: str
    physical_device: str = Field(
        description="gpu_uuid as the job numbers it, cuda_ordinal(visible_gpus, gpu_uuid); else logical_device"
    )
    visible_gpus: list[str]
    torch_version: str
    driver_version: str
    flexium_version: str
    capabilities: ProcessCapabilities
    memory_bytes: int
    footprint_bytes: int
    started_at: float | None
    registered_at: float
    last_seen: float
    cmdline: str
    name: str = Field(default="", description="a short name from cmdline: the script or module (wire.job_name)")
    active_command: CommandInfo | None
    job: JobInfo | None = Field(default=None, description="None: a single-process job")
    steps: int | None = Field(default=None, description="optimizer steps taken, as last reported; None: unknown")
    steps_per_s: float | None = Field(default=None, description="between the last two reports of steps")
    steps_at: float | None = Field(default=None, description="when steps was last reported")
    loss: float | None = Field(default=None, description="the last loss the job reported")
    priority: int = Field(default=protocol.DEFAULT_PRIORITY, description=protocol.PRIORITY_SYNTAX)
    wait_id: int | None = Field(default=None, description="its wait in the resume-when-free queue, while it waits")
    token_revoked: bool = Field(
        default=False,
        description="the token it registered with is revoked: it trains on, but the server no longer hears or "
        "commands it (it goes STALE) until it starts again with a valid token",
    )
    token_expired: bool = Field(
        default=False,
        description="the token it registered with has expired: as token_revoked, it trains on unmanaged until it "
        "starts again with a valid token",
    )

    @computed_field(  # type: ignore[prop-decorator]
        description="its host's GPUs are flexium's simulated ones (flexium demo without a GPU): its memory, driver "
        "and the timings of its moves are the simulation's, not measurements"
    )
    @property
    def simulated(self) -> bool:
        return self.driver_version == SIMULATED_DRIVER


OperationState = Literal["queued", "running", "succeeded", "failed"]
JobState = Literal[ProcessState, "STALE", "MIXED", "INCOMPLETE"]


class JobOperationInfo(WireOut):
    """One pause, resume or migrate of a whole multi-process job: the commands of its ranks
    (one each, created together), and their state taken together."""

    id: int
    job_key: str
    kind: CommandKind
    world_size: int
    moves: dict[str, str] = Field(description="rank (as text) -> target GPU UUID, for every rank that changes GPU")
    created_at: float
    state: OperationState = Field(
        description=(
            "queued: no rank took its command yet; running: while any rank's command is under way; "
            "succeeded: every rank's did; failed: every rank's ended and one failed or expired"
        )
    )
    finished_at: float | None = Field(description="when the last rank's command ended; None while any is under way")
    commands: list[CommandInfo] = Field(description="one per rank, by rank")


class JobSummary(WireOut):
    """A multi-process job: the processes that registered with one ``JobMembership.key``."""

    key: str
    world_size: int
    state: JobState = Field(
        description=(
            "the ranks' common state; INCOMPLETE: a rank has not registered, STALE: a rank is silent, "
            "FAILED: a rank failed, a moving state while any rank is in one, MIXED: the ranks disagree"
        )
    )
    ranks: list[ProcessInfo] = Field(description="by rank")
    missing_ranks: list[int] = Field(description="ranks of 0..world_size-1 that did not register")
    active_operation_id: int | None = Field(description="the job operation under way, if any")


class RoomWatch(WireOut):
    """What a paused job waiting in the queue watches: the GPUs it may resume on and the room it
    needs there. It reads them every ``protocol.ROOM_WATCH_INTERVAL_S`` and sends a heartbeat with
    ``room_seen`` when one has that room free."""

    wait_id: int
    gpus: list[str] = Field(description="GPU UUIDs")
    need_bytes: int


class RegisterResponse(WireOut):
    process: ProcessInfo
    heartbeat_interval_s: float
    poll_timeout_s: float
    stale_after_s: float
    server_time: float
    watch: RoomWatch | None = Field(default=None, description="it waits in the queue: what to watch")


class HeartbeatResponse(WireOut):
    ok: bool
    pending_command: int | None = Field(description="a command waits: the long-poll will hand it out")
    heartbeat_interval_s: float
    server_time: float
    watch: RoomWatch | None = Field(default=None, description="it waits in the queue: what to watch")


class DeviceInfo(WireOut):
    uuid: str
    index: int | None
    name: str
    memory_total: int
    memory_used: int
    memory_flexium: int = Field(description="held by this workspace's flexium jobs on it")
    memory_other: int = Field(description="memory_used - memory_flexium, never negative")
    memory_reserved: int = Field(
        default=0,
        description="held for jobs not on it yet (a flexium run placement, room made by pausing others): "
        "the queue and the placements count it as taken",
    )
    memory_free: int
    utilization: int | None
    temperature: int | None
    health: str
    drained: str | None = Field(default=None, description="why nothing is moved, resumed or placed there (a drain)")
    updated_at: float
    processes: list[str] = Field(description="process ids on it")


class HostInfo(WireOut):
    host: str
    updated_at: float
    stale: bool = Field(description="no report from this host for stale_after seconds")
    devices: list[DeviceInfo]


class DevicesResponse(WireOut):
    hosts: list[HostInfo]


class TargetInfo(WireOut):
    """One GPU of a process's host, judged as the target of a migrate or resume."""

    device: DeviceInfo
    refusal: str | None = Field(description="why a command to it would be refused; None: it fits")


class TokenInfo(WireOut):
    id: int
    name: str
    prefix: str
    role: protocol.TokenRole
    minted_by: int | None = Field(
        default=None, description="the token that issued this one (revoking it revokes this); None: the command line"
    )
    created_at: float
    revoked_at: float | None
    revoked: bool
    expires_at: float | None = Field(default=None, description="refused from then on; None: valid until revoked")
    expired: bool = Field(default=False, description="its expires_at had passed when this was read")
    last_used_at: float | None = Field(
        default=None,
        description="when a request last came with it (or a dashboard session of it), to within a minute; "
        "None: none since the server recorded it",
    )

    @property
    def state(self) -> protocol.TokenState:
        """What the token list and the dashboard show: revoked wins over expired (it is what a person did)."""
        return "revoked" if self.revoked else "expired" if self.expired else "active"


class TokenCreated(TokenInfo):
    token: str = Field(description="shown once; only its hash is stored")


class TokenRevoked(TokenInfo):
    cascade: list[int] = Field(
        default_factory=list, description="the tokens revoked with it: those it minted, and theirs"
    )
    processes: list[str] = Field(
        default_factory=list,
        description="the processes these tokens registered: they train on, but the server no longer hears or "
        "commands them until they start again with a valid token",
    )


class AuditEntry(WireOut):
    """One thing done in a workspace: a command and its outcome, a token issued or revoked, a
    login or logout. ``token_id`` is None for what the server itself did (a command expired)
    or the command line on the database."""

    id: int
    at: float
    token_id: int | None
    token_name: str
    role: str
    action: str = Field(description="e.g. command.created, command.finished, token.issued, token.revoked, login")
    target: str = Field(description="what it was done to: a command, process or token")
    outcome: str = Field(description="ok, refused, or a command's final state")
    detail: str
    process_id: str | None = Field(None, description="the process a command (or a refused one) was for")
    command_id: int | None = Field(None, description="the command created or finished; None for a refused one")
    door: protocol.Door | None = Field(
        None,
        description="how it came in (CommandInfo.door); None: the server itself or the command line on the database",
    )
    repeats: int = Field(1, description="how often it happened: a login or refusal again within the hour counts here")
    last_at: float | None = Field(None, description="when it last happened, where it repeated")


class WorkspaceInfo(WireOut):
    id: int
    name: str
    created_at: float
    processes: int
    active_commands: int


class ReservationInfo(WireOut):
    """Room held on a GPU for one job (made for it by pausing others): the queue's other waits
    cannot take it until it is used, released or expires."""

    id: int
    host: str
    gpu_uuid: str
    bytes: int
    holder: str = Field(description="who it is held for, in words")
    created_at: float
    expires_at: float


class WaitInfo(WireOut):
    """A paused job in the resume-when-free queue: resumed on the first GPU of its host with room,
    a higher priority first, first come first served within one."""

    id: int
    process_id: str = Field(description="the process (for a job of several ranks: the rank that stands for it)")
    job_key: str | None = Field(description="a job of several ranks: every rank resumes together")
    host: str
    gpu_uuid: str | None = Field(description="the GPU it waits for; None: any GPU of its host it may use")
    gpu_index: int | None = Field(
        default=None, description="that GPU's nvidia-smi index on its host (None: any GPU, or not reported)"
    )
    priority: int
    state: WaitState
    position: int | None = Field(
        default=None,
        description="its place in its host's queue, paused jobs and flexium run's placements in one order (1: next); "
        "None once it is not waiting",
    )
    need_bytes: int = Field(description="the room it needs (for a job: its largest rank's)")
    created_at: float
    finished_at: float | None
    command_id: int | None = Field(description="the resume command it dispatched last")
    dispatches: int = Field(description="resumes dispatched for it (a resume the job refuses puts it back)")
    requested_by: str = Field(description="who queued it: a token's name, or the server's policy")
    reason: str = Field(description="why it waits")
    why: str | None = Field(default=None, description="the reason its requester gave (WaitRequest.reason)")
    note: str | None = Field(description="the latest thing that happened to it: a refusal, why it was cancelled")
    reservation: ReservationInfo | None = Field(default=None, description="room held for it")


class DrainMoveInfo(WireOut):
    """What a drain did to one job on the GPUs it drains."""

    process_id: str = Field(description="the process (for a job of several ranks: the rank that stands for it)")
    job_key: str | None
    action: protocol.DrainAction = Field(
        description="migrate: moved to another GPU of its host; pause: paused to resume when free (it fit nowhere, "
        "or its move failed); refused: it could not be moved or paused (note says why), the drain went on"
    )
    command_id: int | None = Field(description="the command it sent (for a job of several ranks: the addressed rank's)")
    command_state: CommandState | None = Field(description="that command's state now (None: none, or forgotten)")
    target_uuid: str | None = Field(description="where a migrate sends it")
    created_at: float
    note: str = Field(description="why this, in words")


class DrainInfo(WireOut):
    """A GPU, or every GPU of a host, taken out of use: its jobs moved off, and nothing placed,
    resumed or migrated there until it is undrained."""

    id: int
    host: str
    gpu_uuid: str | None = Field(description="the GPU drained; None: every GPU of the host")
    gpu_index: int | None = Field(description="its nvidia-smi index when it was drained")
    state: protocol.DrainState = Field(
        description="draining: moves under way, or jobs still on its GPUs that it will move; drained: done (the jobs "
        "it could not move are named in moves); ended: undrained"
    )
    created_at: float
    ended_at: float | None
    requested_by: str
    ended_by: str | None
    reason: str
    moves: list[DrainMoveInfo] = Field(description="what it did, job by job, in order")
    remaining: list[str] = Field(
        description="processes still holding memory on its GPUs that it has not acted on yet (busy with a command)"
    )


class DrainRequest(WireIn):
    """Drain a GPU of a host, or all of them: every job on it is migrated to another GPU of the host
    with room, or paused to resume when free where none has; nothing is placed, resumed or migrated
    there until it is undrained."""

    host: HostName
    gpu: StrictInt | ShortText | None = Field(
        default=None,
        description="the GPU: its nvidia-smi index on the host, or its UUID (GPU-...); None: every GPU of the host",
    )
    reason: Reason = Field(
        default="", description="why, one line, for the audit log and the commands it sends (the jobs' timelines)"
    )


class WaitCreated(WireOut):
    wait: WaitInfo
    commands: list[CommandInfo] = Field(
        description="what it set going at once: the pauses that make room, its resume when there is room now"
    )
    watch: RoomWatch | None = Field(
        default=None, description="it waits: what the queued process watches (as its heartbeats' answers say)"
    )
    queued_before: float | None = Field(
        default=None,
        description="the job was queued already, since then: it kept its place (its wait replaced by one for the GPU "
        "now asked for, where that differs)",
    )


class PlacementInfo(WireOut):
    """A job ``flexium run`` starts once its host has room: placed on the GPU with the most room (or
    the one it names), after the jobs before it in the queue's order, its room then held until its
    job registers."""

    id: int
    host: str
    state: protocol.PlacementState
    gpu_uuid: str | None = Field(description="the GPU it asked for; None: the one with most room")
    gpu_index: int | None = Field(
        default=None, description="that GPU's nvidia-smi index on its host (None: any GPU, or not reported)"
    )
    need_bytes: int
    priority: int
    position: int | None = Field(
        default=None,
        description="its place in its host's queue, paused jobs and flexium run's placements in one order (1: next); "
        "None once placed",
    )
    placed_uuid: str | None = Field(description="the GPU it was placed on")
    placed_index: int | None = Field(description="that GPU's nvidia-smi index on its host")
    process_id: str | None = Field(description="the process that registered with it")
    created_at: float
    placed_at: float | None
    finished_at: float | None
    requested_by: str
    command: str
    note: str | None = Field(description="why it waits, or where it was placed and why")
    why: str | None = Field(default=None, description="the reason its requester gave (PlacementRequest.reason)")
    reservation: ReservationInfo | None = Field(default=None, description="the room held for it")


class QueueListing(WireOut):
    """`flexium queue --json`: the paused jobs waiting to resume and flexium run's placements."""

    waits: list[WaitInfo]
    placements: list[PlacementInfo]


class PlacementCreated(WireOut):
    placement: PlacementInfo
    commands: list[CommandInfo] = Field(description="the pauses that make room for it (make_room)")


class HealthInfo(WireOut):
    status: Literal["ok", "degraded"]
    database: str
    version: int = protocol.PROTOCOL_VERSION


# --- shapes inside requests and responses ---------------------------------------------------
#
# A command's result and a process's capabilities were free-form JSON before they had models:
# every field has a default (an older or newer peer may leave any out), and what a peer sends
# in them, the keys this side ignores included, keeps the bounds that JSON had
# (``_check_json``, run on the whole of each); strings are bounded by MAX_LONG_TEXT as there.


class _BoundedJson(WireIn):
    """Whatever a peer sends in it, the keys this side ignores included, is bounded JSON."""

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: object) -> object:
        if isinstance(data, dict):
            _check_json(data)
        return data


class ProcessCapabilities(_BoundedJson):
    """What a process can be moved by, and why not: the machine's verdict
    (``flexium.engine.capabilities.Capabilities``) as the process amends it (no engine: nothing
    moves) plus whether its memory can take the fast path. A field left out is unknown; the
    server reads a missing pause_resume or migration as "cannot"."""

    driver_version: LongText | None = Field(default=None, description="NVIDIA driver, e.g. '580.159.04'")
    driver_major: Bytes | None = None
    cuda_version: Bytes | None = Field(default=None, description="cuDriverGetVersion, e.g. 13000; 0: no driver")
    checkpoint_api: bool | None = None
    torch_cuda: bool | None = None
    gpu_count: Bytes | None = None
    pause_resume: bool = False
    migration: bool = False
    problems: Annotated[
        list[LongText], Field(max_length=protocol.MAX_JSON_ITEMS, description="each: what is missing and what to do")
    ] = []
    fast_path: bool | None = Field(
        default=None, description="the job's memory is in flexium's pool: moves may take the fast path"
    )
    fast_path_problem: LongText | None = Field(default=None, description="why fast_path is false")
    job_operations: bool | None = Field(
        default=None,
        description=(
            "a rank of a multi-process job: whether the job can be paused, resumed and migrated as a "
            "whole (its problems say why not); None: a single-process job"
        ),
    )
    nccl: bool | None = Field(
        default=None,
        description=(
            "a rank of a multi-process job: whether its process group runs on NCCL, whose ranks the driver "
            "restores each need a GPU of their own; None: a single-process job, or not known yet"
        ),
    )


class OperationGpu(WireIn):
    """One GPU of an operation (``flexium.engine.operations.GpuIdentity``)."""

    ordinal: GpuIndex | None = Field(default=None, description="its CUDA ordinal in the process at init")
    uuid: LongText = ""
    name: LongText = ""
    total_memory: Bytes = 0
    pci_bus_id: LongText = ""
    nvml_index: GpuIndex | None = Field(default=None, description="nvidia-smi's index")


class StepReport(WireIn):
    """One timed step of an operation (``flexium.engine.operations.StepTiming``)."""

    step: LongText = ""
    seconds: float = 0.0
    ok: bool = True
    rollback: bool = Field(default=False, description="part of the rollback after a failure")
    error: LongText | None = None


class OperationReport(_BoundedJson):
    """What a migrate, pause or resume did, as the process measured it
    (``flexium.engine.operations.OperationResult``)."""

    kind: CommandKind | None = None
    path: LongText | None = Field(
        default=None, description="'fast' (flexium moved the pool's memory) or 'driver' (the checkpoint carried all)"
    )
    ok: bool | None = None
    logical_device: LongText = Field(default="", description="what the training code uses, 'cuda:0'")
    source: OperationGpu | None = None
    target: OperationGpu | None = Field(default=None, description="None for pause")
    steps: Annotated[list[StepReport], Field(max_length=protocol.MAX_JSON_ITEMS)] = []
    bytes_moved: Bytes = 0
    seconds: float | None = Field(default=None, description="the whole operation, by the process's clock")
    failed_step: LongText | None = None
    error: LongText | None = None
    notes: Annotated[list[LongText], Field(max_length=protocol.MAX_JSON_ITEMS)] = []


# Some models above name these before they are defined; resolve those names now.
for _model in list(globals().values()):
    if isinstance(_model, type) and issubclass(_model, BaseModel) and _model.__module__ == __name__:
        _model.model_rebuild()
