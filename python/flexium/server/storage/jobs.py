"""Jobs of several ranks (torchrun): the processes that registered with one job key are one job,
and a pause, resume or migrate of any of them is a job operation: one command per rank, written
together or not at all, so that every rank stops at the same step (docs/design.md,
"Distributed jobs").

Refused before anything is written, each with what is wrong and what to do: a rank missing or
silent, a rank busy, FAILED, or in a state the operation does not start from, a rank whose
flexium cannot take part (``capabilities.job_operations``), and a placement the job cannot
have: a target the rank does not see (fact `target-must-be-visible`), two ranks on one GPU after the
move, ranks of an NCCL job on one GPU for a pause or a resume (fact `nccl-ranks-sharing-gpu-fail`), nothing that moves.
Each target is judged by ``target_refusal`` for the rank that goes there, counting the memory
the operation's other ranks take off it (a swap)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server.errors import (
    ApiError,
    Busy,
    CapabilityMissing,
    InvalidRequest,
    InvalidState,
    NotFound,
    Stale,
    TargetRefused,
)
from flexium.server.models import Command, Device, JobOperation, Process
from flexium.server.storage.devices import host_devices
from flexium.server.storage.processes import active_command, list_processes
from flexium.server.storage.staleness import is_stale
from flexium.server.storage.targets import check_target, require_capability, resolve_target, target_refusal
from flexium.server.storage.views import command_view, stored_capabilities

Target = str | int


def is_job_rank(proc: Process) -> bool:
    """Whether commands to ``proc`` act on a job of several ranks (a job of one is a process)."""
    return proc.job_key is not None and (proc.job_world_size or 1) > 1


def create_job_commands(
    *,
    session: Session,
    workspace_id: int,
    addressed: Process,
    kind: str,
    target: Target | None,
    ranks: dict[str, Target] | None,
    now: float,
    stale_after: float,
    reason: str | None = None,
) -> list[wire.CommandInfo]:
    """The commands of a job operation on ``addressed``'s job, the addressed rank's first.
    ``target`` moves the addressed rank alone, ``ranks`` maps ranks (as text) to targets; both
    are read in the addressed rank's numbering (``resolve_target``). ``reason``: why a policy of
    the server sends them."""
    key = addressed.job_key or ""
    world = addressed.job_world_size or 1
    job = f"job {key!r}"
    if target == "":
        target = None
    if target is not None and ranks:
        raise InvalidRequest(
            f"give target (where rank {addressed.job_rank} goes) or ranks (a GPU for each rank that moves), not both"
        )
    if kind == "pause" and (target is not None or ranks):
        raise InvalidRequest(f"pause takes no target: it pauses every rank of {job} where it is")
    wanted = _wanted(ranks, world=world, job=job) if ranks else {}
    if target is not None:
        wanted[addressed.job_rank or 0] = target
    if kind == "migrate" and not wanted:
        raise InvalidRequest(
            f"migrate needs a target GPU (for rank {addressed.job_rank} alone) or ranks, a GPU for each rank that "
            'moves (a swap of two: {"0": "cuda:1", "1": "cuda:0"})'
        )
    members = job_ranks(
        session=session, workspace_id=workspace_id, addressed=addressed, kind=kind, now=now, stale_after=stale_after
    )
    devices = {r: _resolve_rank_target(session, addressed, r, t, named=bool(ranks)) for r, t in wanted.items()}
    moves = _moves(members=members, devices=devices, kind=kind, job=job)
    _check_placement(
        session=session,
        ranks=members,
        devices=devices,
        moves=moves,
        kind=kind,
        host=addressed.host,
        now=now,
        stale_after=stale_after,
    )
    operation = JobOperation(
        workspace_id=workspace_id,
        job_key=key,
        kind=kind,
        world_size=world,
        moves={str(r): uuid for r, uuid in sorted(moves.items())},
        created_at=now,
    )
    session.add(operation)
    session.flush()
    rows: list[tuple[Command, Process]] = []
    for rank, proc in sorted(members.items()):
        share = wire.JobCommandInfo(
            operation_id=operation.id, job_key=key, rank=rank, world_size=world, moves=operation.moves
        )
        row = Command(
            workspace_id=workspace_id,
            process_pk=proc.pk,
            kind=kind,
            state="queued",
            target_uuid=moves.get(rank),
            created_at=now,
            deliveries=0,
            operation_id=operation.id,
            job=share.model_dump(mode="json"),
            reason=reason,
        )
        session.add(row)
        rows.append((row, proc))
    try:
        session.flush()
    except IntegrityError:
        raise Busy(f"a rank of {job} got another command meanwhile; one at a time") from None
    rows.sort(key=lambda pair: pair[1].pk != addressed.pk)
    return [command_view(row, proc.process_id) for row, proc in rows]


def job_ranks(
    *, session: Session, workspace_id: int, addressed: Process, kind: str, now: float, stale_after: float
) -> dict[int, Process]:
    """Rank -> its one live process of ``addressed``'s job, read locked, once every rank is
    registered and alive, free, able to take part, and in the state ``kind`` starts from."""
    key, world = addressed.job_key or "", addressed.job_world_size or 1
    registered = _registered(session=session, workspace_id=workspace_id, key=key, world=world, kind=kind)
    return _check_ranks(
        session=session,
        registered=registered,
        world=world,
        kind=kind,
        job=f"job {key!r}",
        now=now,
        stale_after=stale_after,
    )


def _resolve_rank_target(session: Session, addressed: Process, rank: int, target: Target, *, named: bool) -> Device:
    """``resolve_target``, whose refusal says which rank's target it is when ``ranks`` named several."""
    try:
        return resolve_target(session=session, proc=addressed, target=target)
    except ApiError as exc:
        if not named:
            raise
        raise type(exc)(f"ranks: rank {rank}: {exc.message}", detail=exc.detail) from None


def _wanted(ranks: dict[str, Target], *, world: int, job: str) -> dict[int, Target]:
    wanted: dict[int, Target] = {}
    for text, target in ranks.items():
        rank = protocol.ascii_number(text.strip())
        if rank is None or rank >= world:
            raise InvalidRequest(f"ranks: {text!r} is not a rank of {job} (its ranks are 0..{world - 1})")
        if rank in wanted:
            raise InvalidRequest(f"ranks: rank {rank} is given twice")
        if target == "" or isinstance(target, bool):
            raise InvalidRequest(f"ranks: rank {rank} has no target GPU (cuda:N, an index or a UUID)")
        wanted[rank] = target
    return wanted


def _registered(*, session: Session, workspace_id: int, key: str, world: int, kind: str) -> dict[int, list[Process]]:
    """Rank -> the processes registered as it (several only when a rank was restarted under the
    same key and its old entry lingers), read locked."""
    rows = session.scalars(
        select(Process)
        .where(Process.workspace_id == workspace_id, Process.job_key == key)
        .order_by(Process.job_rank, Process.pk)
        .with_for_update()
    )
    registered: dict[int, list[Process]] = {}
    for row in rows:
        if row.job_world_size != world:
            raise InvalidState(
                f"cannot {kind} job {key!r}: its processes disagree on its size (process {row.process_id!r} "
                f"says {row.job_world_size} ranks, others {world}); forget the entries of an earlier run"
            )
        registered.setdefault(row.job_rank or 0, []).append(row)
    return registered


def _check_ranks(
    *,
    session: Session,
    registered: dict[int, list[Process]],
    world: int,
    kind: str,
    job: str,
    now: float,
    stale_after: float,
) -> dict[int, Process]:
    """Rank -> its one live process, once every rank is registered and alive, free, able to take
    part, and in the state ``kind`` starts from."""
    chosen: dict[int, Process] = {}
    for rank in range(world):
        entries = registered.get(rank, [])
        live = [p for p in entries if not is_stale(p, now=now, stale_after=stale_after)]
        if not entries:
            raise InvalidState(
                f"cannot {kind} {job}: rank {rank} of {world} has not registered; every rank must run "
                "flexium.init() and be attached before the job can be moved"
            )
        if not live:
            silent = entries[-1]
            raise Stale(
                f"cannot {kind} {job}: rank {rank} of {world} (process {silent.process_id!r}) is stale: no "
                f"heartbeat for {now - silent.last_seen:.0f} s; a job moves only with every rank listening"
            )
        if len(live) > 1:
            names = ", ".join(repr(p.process_id) for p in live)
            raise InvalidState(
                f"cannot {kind} {job}: rank {rank} is registered by several live processes ({names}); "
                "forget the ones that do not belong to this run"
            )
        chosen[rank] = live[0]
    for rank, proc in chosen.items():
        active = active_command(session=session, process_pk=proc.pk)
        if active is not None:
            raise Busy(
                f"cannot {kind} {job}: rank {rank} (process {proc.process_id!r}) already has command "
                f"{active.id} ({active.kind}, {active.state}); one at a time",
                detail={"command_id": active.id},
            )
    for rank, proc in chosen.items():
        if proc.state == protocol.FAILED:
            raise InvalidState(
                f"cannot {kind} {job}: rank {rank} (process {proc.process_id!r}) is FAILED: an earlier "
                "rollback failed; restart the job"
            )
    need = "PAUSED" if kind == "resume" else "RUNNING"
    if any(proc.state != need for proc in chosen.values()):
        states = ", ".join(f"rank {rank} is {proc.state}" for rank, proc in sorted(chosen.items()))
        paused = all(p.state == "PAUSED" for p in chosen.values())
        hint = "; resume it with ranks instead" if kind == "migrate" and paused else ""
        raise InvalidState(f"cannot {kind} {job}: every rank must be {need}; {states}{hint}")
    for rank, proc in sorted(chosen.items()):
        caps = stored_capabilities(proc)
        if caps.job_operations is not True:
            why = "; ".join(p for p in caps.problems if p) or (
                "its flexium does not say it can take part in a job operation; upgrade flexium in the job"
            )
            raise CapabilityMissing(
                f"cannot {kind} {job}: rank {rank} (process {proc.process_id!r}) cannot take part: {why}"
            )
        require_capability(proc, protocol.CAP_PAUSE_RESUME, kind)
    return chosen


def _moves(*, members: dict[int, Process], devices: dict[int, Device], kind: str, job: str) -> dict[int, str]:
    """Rank -> target GPU UUID for every rank whose GPU changes."""
    moves = {r: dev.uuid for r, dev in devices.items() if dev.uuid != members[r].gpu_uuid}
    if kind == "migrate" and not moves:
        where = ", ".join(f"rank {r} is already on {dev.uuid}" for r, dev in sorted(devices.items()))
        raise TargetRefused(f"nothing to move in {job}: {where}")
    return moves


def _check_placement(
    *,
    session: Session,
    ranks: dict[int, Process],
    devices: dict[int, Device],
    moves: dict[int, str],
    kind: str,
    host: str,
    now: float,
    stale_after: float,
) -> None:
    after = {rank: moves.get(rank, proc.gpu_uuid) for rank, proc in ranks.items()}
    # A pause or a resume restores every rank (a move onto another rank's GPU is refused below,
    # whatever the backend).
    if kind != "migrate" and any(stored_capabilities(proc).nccl for proc in ranks.values()):
        refusal = protocol.nccl_ranks_on_one_gpu(after, restored=set(after))
        if refusal is not None:
            raise TargetRefused(refusal)
    for rank, uuid in sorted(moves.items()):
        proc = ranks[rank]
        if proc.host != host:
            raise TargetRefused(
                f"rank {rank} (process {proc.process_id!r}) is on host {proc.host!r}, GPU {uuid} on {host!r}: "
                "ranks move only between GPUs of their own host"
            )
        if uuid not in (proc.visible_gpus or []):
            raise TargetRefused(
                f"rank {rank} (process {proc.process_id!r}) cannot see GPU {uuid}: a job moves only to GPUs it "
                "sees (fact `target-must-be-visible` in docs/facts.md); launch it with CUDA_VISIBLE_DEVICES naming "
                "every GPU it may use"
            )
        shared = sorted(other for other, there in after.items() if other != rank and there == uuid)
        if shared:
            other = shared[0]
            raise TargetRefused(
                f"rank {rank} would share GPU {uuid} with rank {other}: each rank needs a GPU of its own; "
                f'move rank {other} too (a swap: ranks {{"{rank}": ..., "{other}": ...}})'
            )
        if kind == "migrate":
            require_capability(proc, protocol.CAP_MIGRATION, "migrate")
        freed = sum(ranks[o].memory_bytes for o in moves if o != rank and ranks[o].gpu_uuid == uuid)
        check_target(proc, devices[rank], kind=kind, now=now, stale_after=stale_after, freed=freed)
    if kind != "resume":
        return
    for rank, proc in sorted(ranks.items()):
        if rank in moves or proc.gpu_uuid is None:
            continue
        home = host_devices(session=session, workspace_id=proc.workspace_id, host=proc.host).get(proc.gpu_uuid)
        reason = (
            None
            if home is None
            else target_refusal(proc=proc, dev=home, kind="resume", now=now, stale_after=stale_after, room=False)
        )
        if reason is not None:
            raise TargetRefused(
                f"rank {rank} (process {proc.process_id!r}) cannot resume where it paused, GPU {proc.gpu_uuid}: "
                f"{reason}; give it another GPU with ranks"
            )


# --- reading --------------------------------------------------------------------------------


def operation_view(row: JobOperation, commands: list[wire.CommandInfo]) -> wire.JobOperationInfo:
    commands = sorted(commands, key=lambda c: c.job.rank if c.job is not None else 0)
    states = [c.state for c in commands]
    finished_at: float | None = None
    if any(s in protocol.ACTIVE_COMMAND_STATES for s in states):
        state = "queued" if all(s == "queued" for s in states) else "running"
    else:
        state = "succeeded" if all(s == "succeeded" for s in states) else "failed"
        finished_at = max((c.finished_at or row.created_at for c in commands), default=row.created_at)
    return wire.JobOperationInfo.model_validate(
        {
            "id": row.id,
            "job_key": row.job_key,
            "kind": row.kind,
            "world_size": row.world_size,
            "moves": row.moves or {},
            "created_at": row.created_at,
            "state": state,
            "finished_at": finished_at,
            "commands": commands,
        }
    )


def get_operation(*, session: Session, workspace_id: int, operation_id: int) -> wire.JobOperationInfo:
    row = session.scalar(
        select(JobOperation).where(JobOperation.id == operation_id, JobOperation.workspace_id == workspace_id)
    )
    if row is None:
        raise NotFound(f"job operation {operation_id} not found")
    commands = [
        command_view(cmd, process_id)
        for cmd, process_id in session.execute(
            select(Command, Process.process_id)
            .join(Process, Process.pk == Command.process_pk)
            .where(Command.operation_id == row.id)
        )
    ]
    return operation_view(row, commands)


def job_state(ranks: list[wire.ProcessInfo], missing: list[int]) -> str:
    """The ranks' states taken together (``wire.JobSummary.state``)."""
    states = {p.state for p in ranks}
    if missing:
        return "INCOMPLETE"
    for state in (protocol.FAILED, protocol.STALE, "MIGRATING", "PAUSING", "RESUMING"):
        if state in states:
            return state
    return states.pop() if len(states) == 1 else "MIXED"


def list_jobs(*, session: Session, workspace_id: int, now: float, stale_after: float) -> list[wire.JobSummary]:
    """Every job of several ranks in the workspace, in the order their first rank registered."""
    return summarize_jobs(list_processes(session=session, workspace_id=workspace_id, now=now, stale_after=stale_after))


def summarize_jobs(processes: list[wire.ProcessInfo]) -> list[wire.JobSummary]:
    """The jobs of several ranks among ``processes`` (listed oldest first), each with its ranks."""
    grouped: dict[str, list[wire.ProcessInfo]] = {}
    for process in processes:
        if process.job is not None and process.job.world_size > 1:
            grouped.setdefault(process.job.key, []).append(process)
    jobs = []
    for key, ranks in grouped.items():
        ranks.sort(key=lambda p: (p.job.rank if p.job else 0, p.registered_at))
        world = max(p.job.world_size for p in ranks if p.job)
        missing = sorted(set(range(world)) - {p.job.rank for p in ranks if p.job})
        active = [p.active_command.job.operation_id for p in ranks if p.active_command and p.active_command.job]
        jobs.append(
            wire.JobSummary.model_validate(
                {
                    "key": key,
                    "world_size": world,
                    "state": job_state(ranks, missing),
                    "ranks": ranks,
                    "missing_ranks": missing,
                    "active_operation_id": max(active) if active else None,
                }
            )
        )
    return jobs
