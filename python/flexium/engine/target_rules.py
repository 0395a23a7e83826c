"""The engine's last word on where the job may go: one statement of the target rules, serving
migrate, resume, a rank's part in a whole-job operation and the GPUs `recoverable()` may choose
(`candidates`). The server ruled first (`target_refusal` in server/storage); here the engine looks
again at what may have changed since, before anything is touched.

A move goes to another GPU of the same model with room for the job: what NVML reports free there,
with what the process already holds there (it goes to the source in a swap), against what the job
holds plus a margin for the driver's bookkeeping on the target. A resume needs its own room rule
(`check_resume`): a paused job holds nothing on any GPU. A pause needs host memory for what it
stages (`check_host_room`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from flexium import simulated
from flexium.engine import nvml
from flexium.engine.host_memory import host_memory_available
from flexium.engine.identity import MovePlan, Target
from flexium.engine.operations import EngineState, GpuIdentity
from flexium.engine.transactions.context import OperationContext
from flexium.errors import TargetRefusedError
from flexium.units import gib

# Restore needs some room beyond the process's own bytes (driver bookkeeping on the target).
DEFAULT_MEMORY_MARGIN_BYTES = 512 << 20
# Host memory a pause leaves free beside what it stages.
HOST_MEMORY_MARGIN_BYTES = 1 << 30

# What a refused resume of a paused job says before its advice (what to do next), which the engine's shutdown,
# exiting at once, leaves out.
STAYS_PAUSED = "it stays paused"


@dataclass(frozen=True)
class TargetCandidate:
    gpu: GpuIdentity
    free_bytes: int


@dataclass(frozen=True)
class Room:
    """A GPU's room for a move of this process there (the module docstring says what counts)."""

    available: int
    needed: int
    margin: int

    @classmethod
    def on(cls, host: nvml.HostGpu, *, pid: int, needed: int, margin: int) -> Room:
        return cls(host.memory_free + (host.used_by(pid) or 0), needed, margin)

    @property
    def enough(self) -> bool:
        return self.available >= self.needed + self.margin


def candidates(ctx: OperationContext, *, margin: int) -> list[TargetCandidate]:
    """GPUs this job could move to now: same model, room for it; most free memory first."""
    source = ctx.source
    # One NVML reading for all GPUs: while frozen each reading is a child process.
    on_host = {gpu.uuid: gpu for gpu in nvml.host_gpus()}
    if ctx.state == EngineState.PAUSED:
        needed = ctx.paused_bytes
    else:
        source_host = on_host.get(source.uuid)
        needed = (source_host.used_by(ctx.pid) or 0) if source_host is not None else 0
    found = []
    for gpu in ctx.identity.gpus:
        host = on_host.get(gpu.uuid)
        if host is None or _model_refusal(source, gpu) is not None:
            continue
        room = Room.on(host, pid=ctx.pid, needed=needed, margin=margin)
        if room.enough:
            found.append(TargetCandidate(gpu=gpu, free_bytes=room.available))
    return sorted(found, key=lambda c: -c.free_bytes)


def bytes_on(ctx: OperationContext, gpu: GpuIdentity) -> int | None:
    """What this process holds on `gpu`; None where NVML cannot tell."""
    host = nvml.gpu_by_uuid(gpu.uuid)
    if host is None:
        return None
    return host.used_by(ctx.pid) or 0


def check_move(
    ctx: OperationContext, source: GpuIdentity, dest: GpuIdentity, *, needed: int | None, margin: int
) -> tuple[str, ...]:
    """Refuses a move of `needed` bytes from `source` to `dest` that breaks the rules; the notes of
    what could not be checked."""
    refusal = _model_refusal(source, dest)
    if refusal is not None:
        raise TargetRefusedError(refusal)
    host = nvml.gpu_by_uuid(dest.uuid)
    if host is None or needed is None:
        return ("free memory on the target not checked: NVML unavailable",)
    room = Room.on(host, pid=ctx.pid, needed=needed, margin=margin)
    if not room.enough:
        raise TargetRefusedError(
            f"{dest.device} ({dest.name}, nvidia-smi index {host.index}) has {gib(room.available, 2)} free; "
            f"the job needs {gib(needed, 2)} plus {gib(margin, 2)} headroom: "
            "free memory there or choose another GPU"
        )
    return ()


def check_moves(ctx: OperationContext, moves: Mapping[str, Target], *, margin: int) -> tuple[MovePlan, tuple[str, ...]]:
    """The plan of a migration named GPU by GPU (a process on several GPUs), each move checked
    as a move of that device's own share of the process's memory; with the notes."""
    identity = ctx.identity
    targets: dict[int, GpuIdentity] = {}
    notes: list[str] = []
    for now, after in moves.items():
        source, dest = identity.resolve(now), identity.resolve(after)
        logical = identity.logical_on(source.uuid)
        held = bytes_on(ctx, source)
        if logical is None or held == 0:
            raise TargetRefusedError(
                f"{source.device} ({source.uuid}) holds nothing of this process: moves name the GPUs it uses"
            )
        notes.extend(check_move(ctx, source, dest, needed=held, margin=margin))
        if dest in targets.values():
            raise TargetRefusedError(f"two devices of the process cannot both go to {dest.device} ({dest.uuid})")
        targets[logical] = dest
    if not targets:
        raise TargetRefusedError("moves names no GPU: give the GPU each moving device is on and where it goes")
    plan = identity.plan(targets)
    if len(targets) > 1:
        moved = ", ".join(f"{m.source.device} -> {m.target.device}" for m in plan.moves)
        notes.append(f"moved GPU by GPU: {moved}")
    return plan, tuple(dict.fromkeys(notes))


def check_resume(
    ctx: OperationContext, source: GpuIdentity, dest: GpuIdentity, *, in_place: bool, margin: int, can_migrate: bool
) -> None:
    """Same model, and room on every GPU the resume puts the job's memory on for what it held
    when it was paused (a paused job holds nothing on any GPU, so the free memory NVML reports
    is what it can have). A process on several GPUs needs each GPU's share on the GPU where
    the restore puts it. Back where it was, on a GPU no other process uses, a share needs no
    headroom (a job that filled its GPU comes back to it); beside other processes it does, as
    they may take more before the restore, and a restore without room loses the job
    (fact `restore-without-room-loses-process`). `can_migrate`: whether the advice may offer another GPU."""
    if dest.name != source.name:
        raise TargetRefusedError(
            f"{dest.device} is a {dest.name}, the job was paused on a {source.name}: resume needs the same model"
        )
    goes_to = dict(ctx.plan_to(dest).pairs)  # empty in place: every GPU maps to itself
    held = ctx.paused_by_gpu or {source.uuid: ctx.paused_bytes}
    # After a fast pause the pool comes back by flexium's own copies, which pause the job again
    # when they find no room: the headroom guards only what the driver restores.
    in_host = ctx.fast.waiting_bytes() if ctx.fast is not None else 0
    for old_uuid, needed in held.items():
        uuid = goes_to.get(old_uuid, old_uuid)
        host = nvml.gpu_by_uuid(uuid)
        if needed == 0 or host is None:
            continue
        moved = uuid != old_uuid
        shared = any(p.pid != ctx.pid for p in host.processes)
        guarded = needed if moved else max(0, needed - in_host)
        required = max(needed, guarded + margin) if moved or shared else needed
        if host.memory_free >= required:
            continue
        extra = required - needed
        if uuid != dest.uuid:
            gpu = next((g for g in ctx.identity.gpus if g.uuid == uuid), None)
            name = gpu.device if gpu is not None else uuid
            raise TargetRefusedError(
                f"{name} has {gib(host.memory_free, 2)} free; the paused job held {gib(needed, 2)} there"
                f"{f' plus {gib(extra, 2)} headroom' if extra else ''} (it uses several GPUs): {STAYS_PAUSED}; "
                "free memory there"
            )
        if not in_place:
            advice = "free memory there or choose another GPU"
        elif can_migrate:
            advice = (
                "free memory there, or resume it with a target, e.g. from the dashboard or `flexium resume JOB cuda:N`"
            )
        else:
            advice = "free memory there (this machine cannot resume it on another GPU)"
        headroom = f" plus {gib(extra, 2)} headroom" if extra else ""
        raise TargetRefusedError(
            f"{dest.device} has {gib(host.memory_free, 2)} free; the paused job needs {gib(needed, 2)}{headroom}: "
            f"{STAYS_PAUSED}; {advice}"
        )


def check_host_room(needed: int, *, fast: bool) -> None:
    """A pause stages the job's memory in host memory: pinned by us (fast) or by the driver. On flexium's
    simulated host the GPU memory a job shows is a count, not bytes (flexium.simulated.hold_job_memory):
    its pause stages nothing, so a small machine can pause a simulated job of any size."""
    if simulated.active():
        return
    available = host_memory_available()
    wanted = needed + HOST_MEMORY_MARGIN_BYTES
    if available is not None and available < wanted:
        what = "host memory to stage the job's pool" if fast else "host memory to hold the job's GPU memory"
        raise TargetRefusedError(
            f"pausing needs {gib(wanted, 2)} of {what} and this machine has {gib(available, 2)} available: "
            "free host memory, or migrate the job instead"
        )


def _model_refusal(source: GpuIdentity, dest: GpuIdentity) -> str | None:
    """Why a move from `source` cannot go to `dest` whatever its memory; None: it can."""
    if dest.uuid == source.uuid:
        return f"the job is already on {dest.device} ({dest.uuid})"
    if dest.name != source.name:
        return f"{dest.device} is a {dest.name}, the job runs on a {source.name}: migration needs the same GPU model"
    return None
