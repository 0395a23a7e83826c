"""Targets of moves: how a person's target text names a GPU (``resolve_target``) and whether
that GPU can take a process (``target_refusal``; every GPU of its host at once:
``judge_targets``), and whether the process can be moved at all (``require_capability``).
Single commands and job operations both judge by these.

Room is judged on the host's last GPU report, which is older than any command: a person's command
is never refused for room (``room=False``), the job's own room check has the last word (it refuses
before anything changes); the queue judges room on a report that came after the room appeared
(``policies/``), and a dialog shows what the last report says."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import event
from sqlalchemy.orm import Session, object_session

from flexium import protocol, wire
from flexium.server.errors import CapabilityMissing, InvalidRequest, TargetRefused
from flexium.server.models import Device, Process
from flexium.server.storage.devices import find_device_hosts, held_by_gpu, host_devices, list_devices
from flexium.server.storage.drains import drain_refusal
from flexium.server.storage.processes import find_process
from flexium.server.storage.staleness import silent
from flexium.server.storage.views import stored_capabilities
from flexium.units import gib

_GIB = float(1 << 30)


def require_capability(proc: Process, key: str, what: str) -> None:
    caps = stored_capabilities(proc)
    if not (caps.migration if key == protocol.CAP_MIGRATION else caps.pause_resume):
        # The process knows why (no GPU, no engine, driver too old...): its word first.
        problems = [p for p in caps.problems if p]
        if problems:
            raise CapabilityMissing(
                f"process {proc.process_id!r} cannot {what}: it reports no {key!r} capability: {'; '.join(problems)}"
            )
        driver = caps.driver_version or proc.driver_version or "unknown"
        need = protocol.MIGRATION_MIN_DRIVER if key == protocol.CAP_MIGRATION else protocol.PAUSE_RESUME_MIN_DRIVER
        raise CapabilityMissing(
            f"process {proc.process_id!r} cannot {what}: it reports no "
            f"{key!r} capability (driver {driver}; {what} needs driver {need}+)"
        )


def _by_index(devices: Iterable[Device], index: int, host: str) -> Device:
    for dev in devices:
        if dev.index == index:
            return dev
    raise _no_such_gpu(f"host {host!r} reported no GPU with index {index}")


def resolve_target(*, session: Session, proc: Process, target: str | int) -> Device:
    """The one reading of a person's target text (the CLI's help and ``wire.CommandRequest``
    say the same; ``protocol.read_target`` reads its syntax): ``cuda:N`` is entry N of the
    process's ``visible_gpus`` (the job's own CUDA numbering, as it registered), a bare integer
    or digits the nvidia-smi index on the process's host, ``GPU-...`` a GPU UUID. Commands carry
    only the UUID it resolves to."""
    devices = host_devices(session=session, workspace_id=proc.workspace_id, host=proc.host)
    if isinstance(target, bool):
        raise InvalidRequest(f"target must name a GPU as {protocol.TARGET_SYNTAX}")
    if isinstance(target, int):
        return _by_index(devices.values(), target, proc.host)
    try:
        named = protocol.read_target(target)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    if named.index is not None:
        return _by_index(devices.values(), named.index, proc.host)
    if named.ordinal is not None:
        visible = list(proc.visible_gpus or [])
        if not visible:
            raise TargetRefused(
                f"process {proc.process_id!r} did not report its visible GPUs; name the target by UUID or by index"
            )
        if named.ordinal >= len(visible):
            raise _no_such_gpu(
                f"process {proc.process_id!r} sees {len(visible)} GPU(s); cuda:{named.ordinal} is not one of them"
            )
        text = visible[named.ordinal]
    else:
        text = named.uuid or ""
    found = devices.get(text)
    if found is not None:
        return found
    elsewhere = [
        h for h in find_device_hosts(session=session, workspace_id=proc.workspace_id, uuid=text) if h != proc.host
    ]
    if elsewhere:
        raise _no_such_gpu(
            f"GPU {text} is on host {elsewhere[0]!r} and process {proc.process_id!r} on host {proc.host!r}: a job "
            f"moves only to a GPU of its own host (flexium devices --host {proc.host} lists them)"
        )
    raise _no_such_gpu(f"unknown GPU {text!r} on host {proc.host!r}")


def _no_such_gpu(message: str) -> TargetRefused:
    """A target that names no GPU of the process's host (protocol.UNKNOWN_GPU)."""
    return TargetRefused(message, detail={protocol.UNKNOWN_GPU: True})


# A refusal that is the process's lack, not the GPU's: command creation answers it as a
# missing capability.
_RESUME_ELSEWHERE = "resuming on another GPU needs the migration capability"


def target_refusal(
    *,
    proc: Process,
    dev: Device,
    kind: str,
    now: float,
    stale_after: float,
    freed: int = 0,
    source: str | None = None,
    room: bool = True,
) -> str | None:
    """Why GPU ``dev`` cannot take ``proc`` for a ``kind`` command, in a few words; None when
    it can. The one statement of the target rules: command creation raises it, the resume
    choice picks by it, the dashboard's dialog and ``GET .../targets`` show it. ``freed``: the
    bytes other ranks of the same job operation take off ``dev`` as ``proc`` arrives (a swap).
    ``source``: for a process on several GPUs moved GPU by GPU, the GPU whose share goes to
    ``dev`` (default: its own device's). ``room``: whether the last report's free memory counts
    (not for a person's command: see the module's docstring)."""
    visible = list(proc.visible_gpus or [])
    moving_from = source or proc.gpu_uuid
    if kind == "migrate" and dev.uuid == moving_from:
        return "the job is already on it"
    if visible and dev.uuid not in visible:
        return "not visible to the job (CUDA_VISIBLE_DEVICES)"
    if proc.gpu_model and dev.name and dev.name != proc.gpu_model:
        # The driver restores a checkpoint only on a GPU of the model it was taken on.
        return f"{dev.name}; the job runs on {proc.gpu_model} (jobs move only between GPUs of one model)"
    if dev.health and dev.health not in protocol.TARGETABLE_HEALTH:
        return f"health: {dev.health}"
    drained = _drained(dev)
    if drained is not None:
        return drained
    if silent(dev.updated_at, now=now, stale_after=stale_after):
        return "no fresh report from its host"
    held = held_by_gpu(proc.gpu_uuid, proc.memory_bytes, proc.gpu_bytes)
    if len(held) > 1 and moving_from is not None:
        # A process on several GPUs: only the moving device's share moves, and a share of its
        # that is on the target now moves off it (the restore swaps them).
        need = held.get(moving_from, 0)
        freed += held.get(dev.uuid, 0) if proc.state != "PAUSED" else 0
    else:
        need = max(proc.footprint_bytes, proc.memory_bytes)
    free = max(0, dev.memory_total - dev.memory_used + freed)
    # A job moved to another GPU asks headroom beside its memory there, as its own room check does.
    margin = protocol.ROOM_MARGIN_BYTES if need and dev.uuid != moving_from else 0
    if room and free < need + margin:
        return f"{gib(free)} free, the job needs {gib(need)}" + (f" plus {gib(margin)} headroom" if margin else "")
    if kind == "resume" and proc.gpu_uuid and dev.uuid != proc.gpu_uuid and not stored_capabilities(proc).migration:
        return _RESUME_ELSEWHERE
    return None


def _drained(dev: Device) -> str | None:
    """A drain refuses its GPUs to every kind of target, read in the session the GPU's row was: no
    judge of a target can leave it out. Read once per GPU until the session next writes (the queue's
    pass judges every GPU of a host for each waiting job: a query each was a fifth of a loaded
    server's time)."""
    session = object_session(dev)
    if session is None:
        return None
    read: dict[tuple[int, str, str], str | None] = session.info.setdefault(_DRAINS_READ, {})
    key = (dev.workspace_id, dev.host, dev.uuid)
    if key not in read:
        read[key] = drain_refusal(session=session, dev=dev)
    return read[key]


_DRAINS_READ = "flexium_drains_read"


@event.listens_for(Session, "after_flush")
def _forget_drains_read(session: Session, _flush_context: object) -> None:
    """What a session read of drains holds until it writes: a query sees what was flushed, so must this."""
    session.info.pop(_DRAINS_READ, None)


def resolve_gpu_moves(
    *, session: Session, proc: Process, gpus: dict[str, str | int], now: float, stale_after: float
) -> dict[str, Device]:
    """A migrate of a process on several GPUs named GPU by GPU, resolved (UUID now -> the GPU it
    goes to) and checked move by move as the target rules check one device's share."""
    held = held_by_gpu(proc.gpu_uuid, proc.memory_bytes, proc.gpu_bytes)
    if not gpus:
        raise InvalidRequest("gpus names no GPU: give GPU-now=GPU-after for each GPU that moves")
    moves: dict[str, Device] = {}
    for now_text, after in gpus.items():
        source = resolve_target(session=session, proc=proc, target=now_text)
        dest = resolve_target(session=session, proc=proc, target=after)
        if source.uuid not in held:
            uses = ", ".join(sorted(held)) or "none reported"
            raise TargetRefused(
                f"process {proc.process_id!r} holds nothing on GPU {source.uuid} ({now_text}): gpus name the GPUs "
                f"it uses ({uses})"
            )
        if source.uuid in moves:
            raise InvalidRequest(f"GPU {source.uuid} is named twice in gpus")
        if any(taken.uuid == dest.uuid for taken in moves.values()):
            raise TargetRefused(f"two GPUs of process {proc.process_id!r} cannot both go to GPU {dest.uuid}")
        check_target(proc, dest, kind="migrate", now=now, stale_after=stale_after, source=source.uuid)
        moves[source.uuid] = dest
    return moves


def check_target(
    proc: Process,
    dev: Device,
    *,
    kind: str,
    now: float,
    stale_after: float,
    freed: int = 0,
    source: str | None = None,
) -> None:
    """``target_refusal`` as a command's refusal: room is the job's to judge."""
    reason = target_refusal(
        proc=proc, dev=dev, kind=kind, now=now, stale_after=stale_after, freed=freed, source=source, room=False
    )
    if reason == _RESUME_ELSEWHERE:
        require_capability(proc, protocol.CAP_MIGRATION, "resume on another GPU")
    if reason is not None:
        raise TargetRefused(f"GPU {dev.uuid} cannot take process {proc.process_id!r}: {reason}")


def judge_targets(
    *, session: Session, workspace_id: int, process_id: str, kind: str, now: float, stale_after: float
) -> list[wire.TargetInfo]:
    """Every GPU of the process's host (by index) with ``refusal``: why a ``kind`` command
    (migrate or resume) to it would be refused, or None when it fits. The server still has
    the last word: the picture may change before a command is sent."""
    if kind not in ("migrate", "resume"):
        raise InvalidRequest(f"targets are judged for migrate or resume, not {kind!r}")
    proc = find_process(session=session, workspace_id=workspace_id, process_id=process_id)
    rows = host_devices(session=session, workspace_id=workspace_id, host=proc.host)
    return [
        wire.TargetInfo(
            device=device,
            refusal=target_refusal(proc=proc, dev=rows[device.uuid], kind=kind, now=now, stale_after=stale_after),
        )
        for entry in list_devices(
            session=session, workspace_id=workspace_id, now=now, stale_after=stale_after, host=proc.host
        ).hosts
        for device in entry.devices
    ]
