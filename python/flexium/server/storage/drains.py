"""Drains: a GPU of a host, or every GPU of it, taken out of use by an admin (``flexium drain
HOST[:GPU]``) until it is undrained. The rows (``Drain``, and what the drain did to each job on its
GPUs, ``DrainMove``), the one rule every judge of a target asks (``drain_refusal``: nothing is
placed, resumed or migrated onto a drained GPU) and the views. What a drain does to the jobs on its
GPUs is the policy's (``server/policies/drain.py``)."""

from __future__ import annotations

from sqlalchemy import or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.errors import InvalidRequest, InvalidState, NotFound
from flexium.server.models import Command, Device, Drain, DrainMove, Process
from flexium.server.storage.audit import record_audit
from flexium.server.storage.devices import held_by_gpu, host_devices
from flexium.server.storage.listing import listed
from flexium.server.storage.staleness import is_stale
from flexium.server.storage.workspaces import AuthInfo

WHOLE_HOST = ""  # Drain.gpu_uuid of a drain of every GPU of its host


def drain_label(row: Drain) -> str:
    """How a person names what it drains: ``HOST`` or ``HOST:INDEX``."""
    if row.gpu_uuid == WHOLE_HOST:
        return row.host
    return f"{row.host}:{row.gpu_index if row.gpu_index is not None else row.gpu_uuid}"


def live_drains(
    *, session: Session, workspace_id: int | None = None, host: str | None = None, for_update: bool = False
) -> list[Drain]:
    """Drains not ended, oldest first; read locked (``for_update``) another server's are skipped."""
    query = select(Drain).where(Drain.ended_at.is_(None))
    if workspace_id is not None:
        query = query.where(Drain.workspace_id == workspace_id)
    if host is not None:
        query = query.where(Drain.host == host)
    query = query.order_by(Drain.id)
    if for_update:
        query = query.with_for_update(skip_locked=True)
    return list(session.scalars(query))


def drained_gpus(*, session: Session, workspace_id: int, host: str) -> dict[str, Drain]:
    """GPU UUID -> the live drain that covers it, for every drained GPU of the host as it reported them."""
    drains = live_drains(session=session, workspace_id=workspace_id, host=host)
    covered: dict[str, Drain] = {}
    for uuid in host_devices(session=session, workspace_id=workspace_id, host=host):
        drain = next((d for d in drains if d.gpu_uuid in (uuid, WHOLE_HOST)), None)
        if drain is not None:
            covered[uuid] = drain
    return covered


def drain_refusal(*, session: Session, dev: Device) -> str | None:
    """Why nothing may go to ``dev`` now (a drain), or None."""
    drain = session.scalar(
        select(Drain)
        .where(
            Drain.workspace_id == dev.workspace_id,
            Drain.host == dev.host,
            Drain.ended_at.is_(None),
            or_(Drain.gpu_uuid == dev.uuid, Drain.gpu_uuid == WHOLE_HOST),
        )
        .limit(1)
    )
    if drain is None:
        return None
    return f"drained by {drain.requested_by} (drain {drain.id}) until `flexium undrain {drain_label(drain)}`"


def create_drain(
    *, session: Session, workspace_id: int, actor: AuthInfo, request: wire.DrainRequest, now: float
) -> Drain:
    """The drain's row, audited; refused when the host reported no such GPU or it is drained already."""
    devices = host_devices(session=session, workspace_id=workspace_id, host=request.host)
    if not devices:
        raise NotFound(
            f"host {request.host!r} reported no GPU in this workspace (`flexium devices` lists each host's GPUs)"
        )
    gpu = None if request.gpu in (None, "") else _named_gpu(request.host, devices, request.gpu)
    who = actor.token_name or f"token {actor.token_id}"
    row = Drain(
        workspace_id=workspace_id,
        host=request.host,
        gpu_uuid=WHOLE_HOST if gpu is None else gpu.uuid,
        gpu_index=None if gpu is None else gpu.index,
        created_at=now,
        requested_by=who[: protocol.MAX_SHORT_TEXT],
        token_id=actor.token_id,
        reason=request.reason,
    )
    covering = [d for d in live_drains(session=session, workspace_id=workspace_id, host=request.host)]
    for other in covering:
        if other.gpu_uuid in (WHOLE_HOST, row.gpu_uuid):
            raise InvalidState(f"{drain_label(other)} is drained already (drain {other.id}, by {other.requested_by})")
    session.add(row)
    try:
        session.flush()
    except IntegrityError:
        raise InvalidState(f"{drain_label(row)} is drained already") from None
    record_audit(
        session=session,
        workspace_id=workspace_id,
        actor=actor,
        action="drain.created",
        target=f"drain {row.id} ({drain_label(row)})",
        outcome="ok",
        detail=request.reason,
        now=now,
    )
    return row


def _named_gpu(host: str, devices: dict[str, Device], gpu: str | int) -> Device:
    """A GPU of the host by its nvidia-smi index (a number, or digits) or its UUID."""
    text = str(gpu).strip()
    if text.isdigit():
        found = next((d for d in devices.values() if d.index == int(text)), None)
    else:
        found = devices.get(text)
    if found is None:
        known = ", ".join(f"{d.index} ({d.uuid})" for d in sorted(devices.values(), key=lambda d: d.index or 0))
        raise InvalidRequest(f"host {host!r} reported no GPU {text!r}: its GPUs are {known}")
    return found


def end_drain(
    *, session: Session, workspace_id: int, actor: AuthInfo, drain_id: int, now: float, stale_after: float
) -> wire.DrainInfo:
    """Undrain: its GPUs take jobs again (a command under way it sent goes on)."""
    row = session.scalar(
        select(Drain).where(Drain.id == drain_id, Drain.workspace_id == workspace_id).with_for_update()
    )
    if row is None:
        raise NotFound(f"drain {drain_id} not found")
    if row.ended_at is not None:
        raise InvalidState(f"drain {drain_id} ({drain_label(row)}) was ended already, by {row.ended_by}")
    row.ended_at = now
    row.ended_by = (actor.token_name or f"token {actor.token_id}")[: protocol.MAX_SHORT_TEXT]
    record_audit(
        session=session,
        workspace_id=workspace_id,
        actor=actor,
        action="drain.ended",
        target=f"drain {row.id} ({drain_label(row)})",
        outcome="ok",
        now=now,
    )
    return drain_view(session=session, row=row, now=now, stale_after=stale_after)


def unit_key(proc: Process) -> str:
    """One job: every rank of a job of several, or one process."""
    return f"job {proc.job_key}" if proc.job_key is not None and (proc.job_world_size or 1) > 1 else f"pk {proc.pk}"


def record_move(
    *,
    session: Session,
    drain: Drain,
    proc: Process,
    action: str,
    note: str,
    now: float,
    command_id: int | None = None,
    target_uuid: str | None = None,
) -> DrainMove:
    row = DrainMove(
        drain_id=drain.id,
        process_pk=proc.pk,
        process_id=proc.process_id,
        job_key=proc.job_key if unit_key(proc).startswith("job ") else None,
        action=action,
        command_id=command_id,
        target_uuid=target_uuid,
        created_at=now,
        note=note[: protocol.MAX_LONG_TEXT],
    )
    session.add(row)
    session.flush()
    return row


def latest_moves(*, session: Session, drain_id: int) -> dict[str, DrainMove]:
    """The unit key (``unit_key``) -> the drain's last move of that job."""
    latest: dict[str, DrainMove] = {}
    for move in session.scalars(select(DrainMove).where(DrainMove.drain_id == drain_id).order_by(DrainMove.id)):
        latest[f"job {move.job_key}" if move.job_key is not None else f"pk {move.process_pk}"] = move
    return latest


def holders_on(
    *, session: Session, workspace_id: int, host: str, gpus: set[str], now: float, stale_after: float
) -> dict[str, list[Process]]:
    """unit key -> its processes, for every job holding memory on one of ``gpus`` (paused and silent
    ones hold nothing known), its ranks by rank."""
    rows = session.scalars(
        select(Process)
        .where(Process.workspace_id == workspace_id, Process.host == host, Process.state != "PAUSED")
        .order_by(Process.job_rank, Process.pk)
    )
    units: dict[str, list[Process]] = {}
    for proc in rows:
        units.setdefault(unit_key(proc), []).append(proc)
    return {
        key: members
        for key, members in units.items()
        if any(gpus & held_by_gpu(p.gpu_uuid, p.memory_bytes, p.gpu_bytes).keys() for p in members)
        and not all(is_stale(p, now=now, stale_after=stale_after) for p in members)
    }


def drain_view(*, session: Session, row: Drain, now: float, stale_after: float) -> wire.DrainInfo:
    moves = list(session.scalars(select(DrainMove).where(DrainMove.drain_id == row.id).order_by(DrainMove.id)))
    ids = [m.command_id for m in moves if m.command_id is not None]
    states = {i: s for i, s in session.execute(select(Command.id, Command.state).where(Command.id.in_(ids)))}
    remaining: list[str] = []
    if row.ended_at is None:
        gpus = set(drained_gpus(session=session, workspace_id=row.workspace_id, host=row.host))
        if row.gpu_uuid != WHOLE_HOST:
            gpus &= {row.gpu_uuid}
        latest = latest_moves(session=session, drain_id=row.id)
        for key, members in holders_on(
            session=session, workspace_id=row.workspace_id, host=row.host, gpus=gpus, now=now, stale_after=stale_after
        ).items():
            last = latest.get(key)
            if last is None or (
                last.action != "refused" and states.get(last.command_id or 0) not in protocol.ACTIVE_COMMAND_STATES
            ):
                remaining.append(members[0].process_id)
    under_way = any(states.get(m.command_id or 0) in protocol.ACTIVE_COMMAND_STATES for m in moves)
    state: protocol.DrainState = (
        "ended" if row.ended_at is not None else "draining" if under_way or remaining else "drained"
    )
    return wire.DrainInfo(
        id=row.id,
        host=row.host,
        gpu_uuid=None if row.gpu_uuid == WHOLE_HOST else row.gpu_uuid,
        gpu_index=row.gpu_index,
        state=state,
        created_at=row.created_at,
        ended_at=row.ended_at,
        requested_by=row.requested_by,
        ended_by=row.ended_by,
        reason=row.reason,
        moves=[
            wire.DrainMoveInfo(
                process_id=m.process_id,
                job_key=m.job_key,
                action=m.action,  # type: ignore[arg-type]
                command_id=m.command_id,
                command_state=states.get(m.command_id or 0),  # type: ignore[arg-type]
                target_uuid=m.target_uuid,
                created_at=m.created_at,
                note=m.note,
            )
            for m in moves
        ],
        remaining=remaining,
    )


def get_drain(*, session: Session, workspace_id: int, drain_id: int, now: float, stale_after: float) -> wire.DrainInfo:
    row = session.scalar(select(Drain).where(Drain.id == drain_id, Drain.workspace_id == workspace_id))
    if row is None:
        raise NotFound(f"drain {drain_id} not found")
    return drain_view(session=session, row=row, now=now, stale_after=stale_after)


def list_drains(
    *,
    session: Session,
    workspace_id: int,
    now: float,
    stale_after: float,
    host: str | None = None,
    live: bool = True,
    limit: int = 100,
) -> list[wire.DrainInfo]:
    """Live drains oldest first, or with ``live=False`` every drain, newest first."""
    rows = listed(
        Drain,
        session=session,
        workspace_id=workspace_id,
        host=host,
        live=live,
        limit=limit,
        live_where=Drain.ended_at.is_(None),
        live_order=[Drain.id.expression],
    )
    return [drain_view(session=session, row=row, now=now, stale_after=stale_after) for row in rows]
