"""Commands: durable rows moving queued -> delivered -> running -> succeeded | failed, or
queued/delivered -> expired.

Checked before a row is written (each a 4xx with a message): the process exists and is
alive, it has no active command, its state allows the operation, its capabilities include
it, and the target GPU is on its host, of its model, visible to it, healthy and has room.
The unique partial index ``uq_commands_one_active`` backs the one-active-command rule against
races. A rank of a job of several gets its command as a share of a job operation, with the
job's own checks (``storage.jobs``); the target rules are ``storage.targets``'. A request's
commands and a report that ends one are written with their audit entries, in one transaction
(``create_commands_audited``, ``report_command_audited``).

A long-poll hands out the oldest queued *or delivered* command: a command whose delivery was
never acknowledged (the answer was lost, the server restarted) goes out again on the next
poll, so a process may see one command twice and must ignore an id it already ran.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.errors import Busy, InvalidRequest, InvalidState, NotFound, PayloadTooLarge, Stale, TargetRefused
from flexium.server.models import Command, Device, Process, table_of
from flexium.server.storage import quotas
from flexium.server.storage.audit import PolicyActor, record_command_finished, record_commands_created
from flexium.server.storage.devices import host_devices
from flexium.server.storage.jobs import create_job_commands, is_job_rank
from flexium.server.storage.processes import (
    Progress,
    active_command,
    apply_process_update,
    find_process,
    is_older,
    shown_process,
)
from flexium.server.storage.staleness import is_stale
from flexium.server.storage.targets import (
    check_target,
    require_capability,
    resolve_gpu_moves,
    resolve_target,
    target_refusal,
)
from flexium.server.storage.views import command_view, stored_capabilities
from flexium.server.storage.waits import cancel_live_wait, command_ended
from flexium.server.storage.workspaces import AuthInfo

_RUNNING_STATE = {"migrate": "MIGRATING", "pause": "PAUSING", "resume": "RESUMING"}


def _choose_resume_target(
    *, session: Session, proc: Process, now: float, stale_after: float
) -> tuple[Device | None, str | None]:
    """Resume where it paused when that GPU has room by the last report; else the GPU with the
    most free memory that has (another GPU only for a job that can migrate), saying why; else where
    it paused, the job judging the room there (the report is older than this command). None lets
    the process resume on its source (no device reports to judge by)."""
    devices = host_devices(session=session, workspace_id=proc.workspace_id, host=proc.host)
    if not devices:
        return None, None

    def refusal(dev: Device, *, room: bool) -> str | None:
        return target_refusal(proc=proc, dev=dev, kind="resume", now=now, stale_after=stale_after, room=room)

    home = devices.get(proc.gpu_uuid or "")
    home_room = None if home is None else refusal(home, room=True)
    if home is not None and home_room is None:
        return home, None
    candidates = [dev for dev in devices.values() if refusal(dev, room=True) is None]
    if candidates and stored_capabilities(proc).migration:
        chosen = max(candidates, key=lambda d: (d.memory_total - d.memory_used, -(d.index or 0)))
        where = "not reported" if home is None else f"GPU {home.index}, {home_room}"
        return chosen, f"to GPU {chosen.index}, the one with the most room (where it paused: {where})"
    home_refusal = None if home is None else refusal(home, room=False)
    if home is not None and home_refusal is None:
        return home, None
    if home_refusal is not None:
        raise TargetRefused(f"no GPU can take process {proc.process_id!r}: its own GPU {proc.gpu_uuid}: {home_refusal}")
    if proc.gpu_uuid is None:
        return None, None
    raise TargetRefused(f"no GPU on host {proc.host!r} can take process {proc.process_id!r}")


def create_commands(
    *,
    session: Session,
    workspace_id: int,
    kind: str,
    process_id: str,
    target: str | int | None = None,
    ranks: dict[str, str | int] | None = None,
    gpus: dict[str, str | int] | None = None,
    now: float,
    stale_after: float,
    reason: str | None = None,
) -> list[wire.CommandInfo]:
    """The commands one request creates, the addressed process's first: its own alone, or, for
    a rank of a job of several, one per rank (``storage.jobs``). ``reason``: why a policy of the
    server sends them (the job's timeline shows it)."""
    if kind not in protocol.COMMAND_KINDS:
        raise InvalidRequest(f"unknown command kind {kind!r}: use migrate, pause or resume")
    proc = find_process(session=session, workspace_id=workspace_id, process_id=process_id, for_update=True)
    job_rank = is_job_rank(proc)
    if gpus is not None and (job_rank or kind != "migrate" or target not in (None, "")):
        rank = f"; process {process_id!r} is a rank of a job of several: use target or ranks" if job_rank else ""
        raise InvalidRequest(
            f"gpus is for a migrate of one process on several GPUs, without a target: GPU it uses now -> GPU{rank}"
        )
    if job_rank:
        return create_job_commands(
            session=session,
            workspace_id=workspace_id,
            addressed=proc,
            kind=kind,
            target=target,
            ranks=ranks,
            now=now,
            stale_after=stale_after,
            reason=reason,
        )
    if ranks is not None:
        raise InvalidRequest(
            f"ranks is for a rank of a job of several processes; process {process_id!r} is a job of its own: use target"
        )
    if is_stale(proc, now=now, stale_after=stale_after):
        raise Stale(f"process {process_id!r} sent no heartbeat for {now - proc.last_seen:.0f} s; it is not listening")
    active = active_command(session=session, process_pk=proc.pk)
    if active is not None:
        raise Busy(
            f"process {process_id!r} already has command {active.id} ({active.kind}, {active.state}); one at a time",
            detail={"command_id": active.id},
        )
    if proc.state == protocol.FAILED:
        raise InvalidState(f"cannot {kind} process {process_id!r}: an earlier rollback failed; restart the job")
    device: Device | None = None
    gpu_moves: dict[str, str] | None = None
    if kind == "migrate":
        if proc.state != "RUNNING":
            hint = "; resume it with a target instead" if proc.state == "PAUSED" else ""
            raise InvalidState(f"cannot migrate process {process_id!r}: it is {proc.state}{hint}")
        require_capability(proc, protocol.CAP_MIGRATION, "migrate")
        if gpus is not None:
            goes_to = resolve_gpu_moves(session=session, proc=proc, gpus=gpus, now=now, stale_after=stale_after)
            gpu_moves = {uuid: dest.uuid for uuid, dest in goes_to.items()}
            device = goes_to.get(proc.gpu_uuid or "")  # where its own device goes, if named
        elif target is None or target == "":
            raise InvalidRequest("migrate needs a target GPU")
        else:
            device = resolve_target(session=session, proc=proc, target=target)
            check_target(proc, device, kind=kind, now=now, stale_after=stale_after)
    elif kind == "pause":
        if proc.state != "RUNNING":
            raise InvalidState(f"cannot pause process {process_id!r}: it is {proc.state}")
        require_capability(proc, protocol.CAP_PAUSE_RESUME, "pause")
        if target is not None:
            raise InvalidRequest("pause takes no target")
    else:
        if proc.state != "PAUSED":
            raise InvalidState(f"cannot resume process {process_id!r}: it is {proc.state}, not PAUSED")
        require_capability(proc, protocol.CAP_PAUSE_RESUME, "resume")
        if target is not None and target != "":
            device = resolve_target(session=session, proc=proc, target=target)
            check_target(proc, device, kind=kind, now=now, stale_after=stale_after)
        else:
            device, chosen_because = _choose_resume_target(session=session, proc=proc, now=now, stale_after=stale_after)
            reason = reason or chosen_because
    row = Command(
        workspace_id=workspace_id,
        process_pk=proc.pk,
        kind=kind,
        state="queued",
        target_uuid=device.uuid if device else None,
        gpu_moves=gpu_moves,
        created_at=now,
        deliveries=0,
        reason=reason,
    )
    session.add(row)
    try:
        session.flush()
    except IntegrityError:
        raise Busy(f"process {process_id!r} already has an active command; one at a time") from None
    return [command_view(row, process_id)]


def create_commands_audited(
    *,
    session: Session,
    workspace_id: int,
    actor: AuthInfo | PolicyActor,
    kind: str,
    process_id: str,
    target: str | int | None = None,
    ranks: dict[str, str | int] | None = None,
    gpus: dict[str, str | int] | None = None,
    now: float,
    stale_after: float,
    reason: str | None = None,
) -> list[wire.CommandInfo]:
    """``create_commands``, and the audit entry of each command in the same transaction (a
    refused one is written on its own: ``storage.audit.record_command_refused``). A person's
    pause or resume takes the job out of the resume-when-free queue: they said what it does now."""
    commands = create_commands(
        session=session,
        workspace_id=workspace_id,
        kind=kind,
        process_id=process_id,
        target=target,
        ranks=ranks,
        gpus=gpus,
        now=now,
        stale_after=stale_after,
        reason=reason,
    )
    if isinstance(actor, AuthInfo) and kind != "migrate":
        proc = find_process(session=session, workspace_id=workspace_id, process_id=process_id)
        cancel_live_wait(
            session=session,
            workspace_id=workspace_id,
            actor=actor,
            proc=proc,
            why=f"replaced by a {kind} sent by {actor.token_name or 'token ' + str(actor.token_id)}",
            now=now,
        )
    return record_commands_created(session=session, workspace_id=workspace_id, actor=actor, commands=commands, now=now)


def _find_command(
    session: Session, *, workspace_id: int, command_id: int, for_update: bool = False
) -> tuple[Command, Process]:
    query = (
        select(Command, Process)
        .join(Process, Process.pk == Command.process_pk)
        .where(Command.id == command_id, Command.workspace_id == workspace_id)
    )
    if for_update:
        query = query.with_for_update()
    row = session.execute(query).first()
    if row is None:
        raise NotFound(f"command {command_id} not found")
    return row[0], row[1]


def get_command(*, session: Session, workspace_id: int, command_id: int) -> wire.CommandInfo:
    cmd, proc = _find_command(session, workspace_id=workspace_id, command_id=command_id)
    return command_view(cmd, proc.process_id)


def list_commands(
    *,
    session: Session,
    workspace_id: int,
    process_id: str | None = None,
    state: str | None = None,
    limit: int = 100,
    before_id: int | None = None,
) -> list[wire.CommandInfo]:
    """Newest first; page with ``before_id`` (the smallest id of the previous page)."""
    query = (
        select(Command, Process.process_id)
        .join(Process, Process.pk == Command.process_pk)
        .where(Command.workspace_id == workspace_id)
    )
    if process_id:
        query = query.where(Process.process_id == process_id)
    if state:
        query = query.where(Command.state == state)
    if before_id:
        query = query.where(Command.id < before_id)
    rows = session.execute(query.order_by(Command.id.desc()).limit(limit))
    return [command_view(cmd, pid) for cmd, pid in rows]


def peek_command(*, session: Session, workspace_id: int, process_id: str) -> tuple[str, int | None]:
    """(the process's host, the id of the command a long-poll would hand out) without writing
    (most polls find none, and a read does not queue behind SQLite's one writer)."""
    row = session.execute(_PEEK, {"ws": workspace_id, "pid": process_id}).first()
    if row is None:
        raise NotFound(f"process {process_id!r} not found")
    return row[0], row[1]


_P = table_of(Process)
_C = table_of(Command)
_PEEK = select(
    _P.c.host,
    select(_C.c.id)
    .where(_C.c.process_pk == _P.c.pk, _C.c.state.in_(protocol.PENDING_COMMAND_STATES))
    .order_by(_C.c.id)
    .limit(1)
    .scalar_subquery(),
).where(_P.c.workspace_id == bindparam("ws"), _P.c.process_id == bindparam("pid"))


def pending_commands(*, session: Session) -> list[tuple[int, str, int]]:
    """(workspace id, process id, command id) of every queued or delivered command."""
    return [
        (ws, pid, cid)
        for ws, pid, cid in session.execute(
            select(_C.c.workspace_id, _P.c.process_id, _C.c.id)
            .join(_P, _P.c.pk == _C.c.process_pk)
            .where(_C.c.state.in_(protocol.PENDING_COMMAND_STATES))
        )
    ]


def next_command(
    *, session: Session, workspace_id: int, process_id: str, now: float
) -> tuple[wire.CommandInfo | None, bool]:
    """The command a long-poll hands out, marked delivered, in one statement; (command or
    None, whether this is its first delivery). None also when the process is unknown: the
    route's ``peek_command`` tells those apart."""
    row = session.execute(_DELIVER, {"ws": workspace_id, "pid": process_id, "now": now}).first()
    if row is None:
        return None, False
    cmd = Command(**{c: getattr(row, c) for c in _COLUMNS})
    return command_view(cmd, process_id), cmd.deliveries == 1


_COLUMNS = [c.name for c in _C.columns]
_DELIVER = (
    update(_C)
    .where(
        _C.c.id
        == select(_C.c.id)
        .join(_P, _P.c.pk == _C.c.process_pk)
        .where(
            _P.c.workspace_id == bindparam("ws"),
            _P.c.process_id == bindparam("pid"),
            _C.c.state.in_(protocol.PENDING_COMMAND_STATES),
        )
        .order_by(_C.c.id)
        .limit(1)
        .scalar_subquery()
    )
    .values(
        state="delivered",
        deliveries=_C.c.deliveries + 1,
        delivered_at=func.coalesce(_C.c.delivered_at, bindparam("now")),
    )
    .returning(*_C.columns)
)


def undo_delivery(*, session: Session, command: wire.CommandInfo) -> None:
    """A delivery whose long-poll's client went away before the answer was sent: as if it had not
    been made (a first delivery leaves the command queued), so the process's next poll hands it out
    as the one it receives. A command the process reported on meanwhile is left as it is."""
    first = command.deliveries == 1
    session.execute(
        update(_C)
        .where(_C.c.id == command.id, _C.c.state == "delivered", _C.c.deliveries == command.deliveries)
        .values(
            state="queued" if first else "delivered",
            deliveries=command.deliveries - 1,
            delivered_at=None if first else _C.c.delivered_at,
        )
    )


def _stored_result(session: Session, result: wire.OperationReport) -> Any:
    """A command's final result as stored. Its state is taken whatever the result's size: a
    final report refused for its size left the job busy for good (the process has moved on and
    never sends it again), so one over the payload bound keeps its summary (where from, where to,
    how long, the error) without its steps and notes, and says it was cut."""
    try:
        return quotas.stored_json(session=session, value=result, what="the command's result")
    except PayloadTooLarge as exc:
        cut = result.model_copy(update={"steps": [], "notes": [f"cut by the server: {exc.message}"]})
        return quotas.stored_json(session=session, value=cut, what="the command's result, cut")


def report_command(
    *, session: Session, workspace_id: int, command_id: int, report: wire.CommandReport, now: float, stale_after: float
) -> tuple[wire.CommandInfo, wire.ProcessInfo | None, bool]:
    """Apply a process's report; returns (command, process after it, changed).

    Repeating a report is harmless (the client retries until the server answers). A report
    on an expired command is accepted: the process did act, and its word is the truth; but where
    a newer command of the process is under way, that one says what state the process is in, and
    the late report only ends its own command.
    """
    state = report.state
    cmd, proc = _find_command(session, workspace_id=workspace_id, command_id=command_id, for_update=True)
    was = proc.state
    if cmd.state == state or (state == "running" and cmd.state in ("succeeded", "failed")):
        return command_view(cmd, proc.process_id), None, False  # a retry, or a late ack
    if cmd.state in ("succeeded", "failed"):
        raise InvalidState(f"command {command_id} already {cmd.state}; it cannot become {state}")
    superseded = cmd.state == "expired" and active_command(session=session, process_pk=proc.pk) is not None
    cmd.state = state
    update = report.process if report.process is not None else wire.ProcessUpdate()
    if superseded or is_older(update.seq, proc.state_seq):
        update = wire.ProcessUpdate()  # a newer command, or a heartbeat built later, already said where it is
    elif update.seq is not None:
        proc.state_seq = update.seq
    if state == "running":
        cmd.started_at = cmd.started_at or now
        if not superseded:
            proc.state = _RUNNING_STATE[cmd.kind]
    else:
        cmd.finished_at = now
        cmd.started_at = cmd.started_at or now
        cmd.result = None if report.result is None else _stored_result(session, report.result)
        cmd.error = report.error
        if not superseded:
            _settle_process(proc, cmd, succeeded=state == "succeeded")
            if state == "succeeded":
                update = _location_after(cmd, update)
                _move_held_by_gpu(proc, cmd)
    apply_process_update(proc, update)
    if proc.state != was:
        Progress.of(proc).after_operation().store(proc)
    if proc.memory_bytes:
        proc.footprint_bytes = (
            max(proc.footprint_bytes, proc.memory_bytes) if proc.state == "PAUSED" else proc.memory_bytes
        )
    proc.last_seen = max(proc.last_seen, now)
    try:
        session.flush()
    except IntegrityError:
        raise Busy(f"process {proc.process_id!r} got another command after {command_id} expired") from None
    if cmd.state in protocol.FINAL_COMMAND_STATES:
        command_ended(session=session, cmd=cmd, proc=proc, now=now)
    active = cmd if cmd.state in protocol.ACTIVE_COMMAND_STATES else None
    return (
        command_view(cmd, proc.process_id),
        shown_process(session=session, row=proc, now=now, stale_after=stale_after, active=active),
        True,
    )


def report_command_audited(
    *,
    session: Session,
    workspace_id: int,
    actor: AuthInfo,
    command_id: int,
    report: wire.CommandReport,
    now: float,
    stale_after: float,
) -> tuple[wire.CommandInfo, wire.ProcessInfo | None, bool]:
    """``report_command``, and the command's outcome in the audit log when this report ended it."""
    command, process, changed = report_command(
        session=session,
        workspace_id=workspace_id,
        command_id=command_id,
        report=report,
        now=now,
        stale_after=stale_after,
    )
    if changed and command.state in protocol.FINAL_COMMAND_STATES:
        record_command_finished(session=session, workspace_id=workspace_id, actor=actor, command=command, now=now)
    return command, process, changed


def end_command(
    *, session: Session, cmd: Command, proc: Process, state: str, error: str, now: float
) -> wire.CommandInfo:
    """Ends a command nothing will report any more (expired, or failed: its process went silent or
    was forgotten), with what that means to the queue's waits; the command as it is now."""
    cmd.state, cmd.finished_at, cmd.error = state, now, error
    command_ended(session=session, cmd=cmd, proc=proc, now=now)
    return command_view(cmd, proc.process_id)


def _settle_process(proc: Process, cmd: Command, *, succeeded: bool) -> None:
    """The state an operation's outcome leaves the process in (its location is
    ``_location_after``'s)."""
    if cmd.kind == "pause":
        proc.state = "PAUSED" if succeeded else "RUNNING"
        if succeeded:
            proc.footprint_bytes = max(proc.footprint_bytes, proc.memory_bytes)
            proc.memory_bytes = 0
        return
    if cmd.kind == "resume" and not succeeded:
        proc.state = "PAUSED"
        return
    proc.state = "RUNNING"
    if succeeded and cmd.kind == "resume" and not proc.memory_bytes:
        proc.memory_bytes = proc.footprint_bytes


def _location_after(cmd: Command, update: wire.ProcessUpdate) -> wire.ProcessUpdate:
    """The process's own update, saying it is on the GPU a succeeded move sent it to where the
    update says nothing of its GPU (``apply_process_update`` then writes it, once)."""
    if not cmd.target_uuid or "gpu_uuid" in update.model_fields_set:
        return update
    return update.model_copy(update={"gpu_uuid": cmd.target_uuid})


def _move_held_by_gpu(proc: Process, cmd: Command) -> None:
    """A migrate GPU by GPU takes what the process held on each GPU where it went: shown at once,
    before its next device report says the same."""
    if cmd.gpu_moves and proc.gpu_bytes:
        proc.gpu_bytes = {cmd.gpu_moves.get(uuid, uuid): held for uuid, held in proc.gpu_bytes.items()}


def count_commands(*, session: Session) -> dict[str, int]:
    counts = {state: 0 for state in protocol.COMMAND_STATES}
    for state, n in session.execute(select(Command.state, func.count()).group_by(Command.state)):
        counts[state] = n
    return counts


def count_finished(*, session: Session, workspace_id: int, kind: str, state: str, since: float) -> int:
    """Commands of ``kind`` that ended in ``state`` since ``since`` (the dashboard's moves today)."""
    return int(
        session.scalar(
            select(func.count()).where(
                Command.workspace_id == workspace_id,
                Command.kind == kind,
                Command.state == state,
                Command.finished_at >= since,
            )
        )
        or 0
    )
