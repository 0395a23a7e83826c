"""``flexium migrate JOB auto``: the server picks the target, the GPU of the job's host with the most
room it can use that is not drained (``choose_gpu``), and sends the person's migrate there; when
none will do, the refusal says why, GPU by GPU, and nothing changes. A rank of a job of several
moves alone (as a named target moves it), never onto a GPU another rank of its job is on."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.errors import InvalidRequest, InvalidState, TargetRefused
from flexium.server.models import Process
from flexium.server.policies.choose_gpu import choose_gpu, gpu_label
from flexium.server.policies.room import HostRoom
from flexium.server.storage.audit import PolicyActor
from flexium.server.storage.commands import create_commands_audited
from flexium.server.storage.devices import held_by_gpu
from flexium.server.storage.jobs import is_job_rank
from flexium.server.storage.processes import find_process
from flexium.server.storage.reservations import lock_process_host
from flexium.server.storage.targets import require_capability
from flexium.server.storage.workspaces import AuthInfo
from flexium.units import gib


def migrate_auto(
    *,
    session: Session,
    workspace_id: int,
    actor: AuthInfo | PolicyActor,
    process_id: str,
    now: float,
    stale_after: float,
) -> list[wire.CommandInfo]:
    """The migrate of ``process_id`` to the GPU the server picked, audited as ``actor``'s. The host's room
    is counted under its lock, as every policy counts it, so that two picks never promise one room twice."""
    lock_process_host(session=session, workspace_id=workspace_id, process_id=process_id)
    proc = find_process(session=session, workspace_id=workspace_id, process_id=process_id, for_update=True)
    require_capability(proc, protocol.CAP_MIGRATION, "migrate")
    if proc.state != "RUNNING":
        raise InvalidState(f"cannot migrate process {proc.process_id!r}: it is {proc.state}")
    if len(held_by_gpu(proc.gpu_uuid, proc.memory_bytes, proc.gpu_bytes)) > 1:
        raise InvalidRequest(
            f"process {proc.process_id!r} uses several GPUs: name where each goes (flexium migrate "
            f"{proc.process_id} --gpus NOW=AFTER,...); auto picks one GPU for a job on one"
        )
    avoid: set[str] = set()
    if is_job_rank(proc):
        others = session.scalars(
            select(Process.gpu_uuid).where(
                Process.workspace_id == workspace_id, Process.job_key == proc.job_key, Process.pk != proc.pk
            )
        )
        avoid = {uuid for uuid in others if uuid is not None}
    room = HostRoom.read(session=session, workspace_id=workspace_id, host=proc.host, now=now)
    need = max(proc.footprint_bytes, proc.memory_bytes)
    choice = choose_gpu(proc=proc, need=need, room=room, avoid=avoid, now=now, stale_after=stale_after)
    if choice.uuid is None:
        raise TargetRefused(
            f"no GPU of host {proc.host!r} can take process {proc.process_id!r} ({gib(need)}): {choice.why_none()}"
        )
    return create_commands_audited(
        session=session,
        workspace_id=workspace_id,
        actor=actor,
        kind="migrate",
        process_id=proc.process_id,
        target=choice.uuid,
        now=now,
        stale_after=stale_after,
        reason=f"auto: {gpu_label(room, choice.uuid)} had the most room it can use ({gib(choice.free)} free "
        f"for {gib(need)})",
    )
