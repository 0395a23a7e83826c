"""Draining a GPU, or every GPU of a host (``flexium drain HOST[:GPU]``): each job on it is migrated to
the GPU of its host with the most room (``choose_gpu``), or, where none has room (or its migrate
fails), paused and queued to resume when free; a job that can be neither (a job of several ranks
that cannot move together, a silent one, one whose pause fails) is named with its reason and the
drain goes on with the others. The drained GPU takes nothing until it is undrained: the target
rules refuse it (``storage.drains.drain_refusal``), so neither the queue, nor making room, nor a
person's command sends a job there.

``run_drains`` is a pass over the live drains, run when one is made, when a command of its host
ends (a move done, failed, or a job no longer busy) and at every sweep; it acts on a job once its
last move ended, reads the drains it acts on locked (another server's are skipped), and every job
has one active command at most: two servers never move a job twice."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from sqlalchemy.orm import Session

from flexium import wire
from flexium.server.errors import ApiError
from flexium.server.models import Command, Drain, DrainMove, Process
from flexium.server.policies.choose_gpu import choose_gpu, gpu_label
from flexium.server.policies.room import HostRoom
from flexium.server.storage.audit import PolicyActor, given_why, record_commands_created
from flexium.server.storage.commands import create_commands
from flexium.server.storage.devices import held_by_gpu
from flexium.server.storage.drains import (
    create_drain,
    drain_label,
    drain_view,
    drained_gpus,
    holders_on,
    latest_moves,
    live_drains,
    record_move,
)
from flexium.server.storage.jobs import is_job_rank
from flexium.server.storage.processes import active_command
from flexium.server.storage.reservations import lock_hosts
from flexium.server.storage.staleness import is_stale
from flexium.server.storage.waits import cancel_live_wait, queue_wait
from flexium.server.storage.workspaces import AuthInfo
from flexium.units import gib

ACTOR = PolicyActor("drain")


@dataclass(frozen=True)
class DrainOutcome:
    commands: tuple[tuple[int, wire.CommandInfo], ...] = ()  # (workspace id, command) sent
    drains: tuple[tuple[int, wire.DrainInfo], ...] = ()  # (workspace id, drain) that acted


def start_drain(
    *, session: Session, workspace_id: int, actor: AuthInfo, request: wire.DrainRequest, now: float, stale_after: float
) -> tuple[wire.DrainInfo, DrainOutcome]:
    """``flexium drain HOST[:GPU]``: the drain, and its first pass in the same transaction."""
    row = create_drain(session=session, workspace_id=workspace_id, actor=actor, request=request, now=now)
    outcome = run_drains(session=session, now=now, stale_after=stale_after, workspace_id=workspace_id, host=row.host)
    return drain_view(session=session, row=row, now=now, stale_after=stale_after), outcome


def run_drains(
    *, session: Session, now: float, stale_after: float, workspace_id: int | None = None, host: str | None = None
) -> DrainOutcome:
    """Acts on every job on a live drain's GPUs whose last move ended (all hosts by default)."""
    unlocked = live_drains(session=session, workspace_id=workspace_id, host=host)
    locked = {(d.workspace_id, d.host) for d in unlocked}
    lock_hosts(session=session, hosts=locked)
    # A drain made on another host since the hosts were read waits for the next pass: its host is not locked.
    drains = [
        d
        for d in live_drains(session=session, workspace_id=workspace_id, host=host, for_update=True)
        if (d.workspace_id, d.host) in locked
    ]
    commands: list[tuple[int, wire.CommandInfo]] = []
    acted: list[tuple[int, wire.DrainInfo]] = []
    for (ws, on_host), group in itertools.groupby(drains, key=lambda d: (d.workspace_id, d.host)):
        mine = {d.id for d in group}
        covered = {uuid: d for uuid, d in drained_gpus(session=session, workspace_id=ws, host=on_host).items()}
        room = HostRoom.read(session=session, workspace_id=ws, host=on_host, now=now)
        units = holders_on(
            session=session, workspace_id=ws, host=on_host, gpus=set(covered), now=now, stale_after=stale_after
        )
        latest = {d_id: latest_moves(session=session, drain_id=d_id) for d_id in mine}
        changed: dict[int, Drain] = {}
        for key, members in units.items():
            drain = next(covered[u] for p in members for u in _held(p) if u in covered)
            if drain.id not in mine:
                continue  # another server holds that drain
            sent = _act(
                session=session,
                drain=drain,
                members=members,
                last=latest[drain.id].get(key),
                covered=set(covered),
                room=room,
                now=now,
                stale_after=stale_after,
            )
            if sent is not None:
                changed[drain.id] = drain
                commands += [(ws, command) for command in sent]
        acted += [(ws, drain_view(session=session, row=d, now=now, stale_after=stale_after)) for d in changed.values()]
    return DrainOutcome(commands=tuple(commands), drains=tuple(acted))


def _held(proc: Process) -> list[str]:
    return list(held_by_gpu(proc.gpu_uuid, proc.memory_bytes, proc.gpu_bytes))


def _act(
    *,
    session: Session,
    drain: Drain,
    members: list[Process],
    last: DrainMove | None,
    covered: set[str],
    room: HostRoom,
    now: float,
    stale_after: float,
) -> list[wire.CommandInfo] | None:
    """One job on the drain's GPUs: what it sent (an empty list: it named the job as refused), or
    None when there is nothing to do now (busy, or given up on)."""
    lead = members[0]
    if any(active_command(session=session, process_pk=p.pk) is not None for p in members):
        return None  # its move, or a person's command, is under way: looked at again when it ends
    previous = None if last is None or last.command_id is None else session.get(Command, last.command_id)
    if last is not None and last.action == "refused":
        return None
    if last is not None and last.action == "pause":
        if previous is not None and previous.state == "succeeded":
            return None  # paused there, and running there again since: a person's, not the drain's
        outcome = "forgotten" if previous is None else f"{previous.state}: {previous.error or 'no reason given'}"
        return _refuse(session, drain, lead, f"its pause, command {last.command_id}, {outcome}", now)
    if any(is_stale(p, now=now, stale_after=stale_after) for p in members):
        return None  # a rank silent for now (a lost heartbeat, a server restart): moved once all are heard again
    if last is not None and last.action == "migrate" and (previous is None or previous.state != "succeeded"):
        outcome = "forgotten" if previous is None else f"{previous.state}: {previous.error or 'no reason given'}"
        return _pause(
            session, drain, members, f"its migrate, command {last.command_id}, {outcome}", room, now, stale_after
        )
    return _migrate(session, drain, members, covered, room, now, stale_after)


def _migrate(
    session: Session,
    drain: Drain,
    members: list[Process],
    covered: set[str],
    room: HostRoom,
    now: float,
    stale_after: float,
) -> list[wire.CommandInfo]:
    """Each process (rank) on a drained GPU to the GPU with the most room; paused where one fits nowhere."""
    lead = members[0]
    if len(_held(lead)) > 1:
        return _pause(
            session,
            drain,
            members,
            "it uses several GPUs (a person moves such a job GPU by GPU)",
            room,
            now,
            stale_after,
        )
    job = is_job_rank(lead)
    staying = {p.gpu_uuid for p in members if p.gpu_uuid is not None and p.gpu_uuid not in covered}
    moves: dict[Process, str] = {}
    for proc in members:
        if proc.gpu_uuid not in covered:
            continue
        need = max(proc.footprint_bytes, proc.memory_bytes)
        choice = choose_gpu(
            proc=proc,
            need=need,
            room=room,
            avoid=staying | set(moves.values()) if job else (),
            now=now,
            stale_after=stale_after,
        )
        if choice.uuid is None:
            why = f"no other GPU of host {drain.host!r} can take process {proc.process_id!r}: {choice.why_none()}"
            return _pause(session, drain, members, why, room, now, stale_after)
        moves[proc] = choice.uuid
    where = ", ".join(f"{p.process_id} to {gpu_label(room, uuid)}" for p, uuid in moves.items())
    reason = (
        f"drain of {drain_label(drain)} by {drain.requested_by}: moving {where}, the GPU with the most room"
        + given_why(drain.reason)
    )
    try:
        with session.begin_nested():
            commands = create_commands(
                session=session,
                workspace_id=drain.workspace_id,
                kind="migrate",
                process_id=lead.process_id,
                target=None if job else moves[lead],
                ranks={str(p.job_rank): uuid for p, uuid in moves.items()} if job else None,
                now=now,
                stale_after=stale_after,
                reason=reason,
            )
    except ApiError as exc:
        return _pause(session, drain, members, f"it cannot be migrated: {exc.message}", room, now, stale_after)
    record_commands_created(session=session, workspace_id=drain.workspace_id, actor=ACTOR, commands=commands, now=now)
    for proc, uuid in moves.items():
        room.arriving(uuid, max(proc.footprint_bytes, proc.memory_bytes))
    first = next(iter(moves.values()))
    record_move(
        session=session,
        drain=drain,
        proc=lead,
        action="migrate",
        note=f"moving {where}",
        now=now,
        command_id=commands[0].id,
        target_uuid=first,
    )
    return commands


def _pause(
    session: Session,
    drain: Drain,
    members: list[Process],
    why: str,
    room: HostRoom,
    now: float,
    stale_after: float,
) -> list[wire.CommandInfo]:
    """The job paused and queued to resume when free (on a GPU not drained); refused where it cannot pause."""
    lead = members[0]
    priority = max(p.priority for p in members)
    label, why_given = drain_label(drain), given_why(drain.reason)
    reason = f"drain of {label} by {drain.requested_by}: {why}; paused to resume when free{why_given}"
    try:
        with session.begin_nested():
            commands = create_commands(
                session=session,
                workspace_id=drain.workspace_id,
                kind="pause",
                process_id=lead.process_id,
                now=now,
                stale_after=stale_after,
                reason=reason,
            )
            cancel_live_wait(
                session=session,
                workspace_id=drain.workspace_id,
                actor=ACTOR,
                proc=lead,
                why="paused by a drain",
                now=now,
            )
            queue_wait(
                session=session,
                workspace_id=drain.workspace_id,
                actor=ACTOR,
                holder=lead,
                gpu_uuid=None,
                priority=priority,
                reason=f"paused by the drain of {drain_label(drain)}: resumes when free on a GPU not drained",
                now=now,
            )
    except ApiError as exc:
        return _refuse(session, drain, lead, f"{why}; and it cannot be paused: {exc.message}", now)
    record_commands_created(session=session, workspace_id=drain.workspace_id, actor=ACTOR, commands=commands, now=now)
    needed = sum(max(p.footprint_bytes, p.memory_bytes) for p in members)
    record_move(
        session=session,
        drain=drain,
        proc=lead,
        action="pause",
        note=f"{why}; pausing it ({gib(needed)}) to resume when free",
        now=now,
        command_id=commands[0].id,
    )
    return commands


def _refuse(session: Session, drain: Drain, lead: Process, why: str, now: float) -> list[wire.CommandInfo]:
    record_move(session=session, drain=drain, proc=lead, action="refused", note=f"left where it is: {why}", now=now)
    return []
