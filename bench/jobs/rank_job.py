"""The torchrun job of the benchmark and the GPU tests: every rank trains DDP (or FSDP2's fully_shard,
--model fsdp2) over NCCL (or gloo) with AdamW beside a ballast, on data of its own seed, and prints
one JSON line per event, with its rank, on stdout.

    torchrun --standalone --nproc-per-node 2 bench/jobs/rank_job.py --model ddp --steps 60 \\
        --plan 10:pause --plan 10:resume --plan 30:migrate:0=1,1=0
    torchrun --standalone --nproc-per-node 2 bench/jobs/rank_job.py --gb 16 --width 4096 --batch 256 \\
        --no-amp --step-sleep 0 --steps 80 --plan 20:pause --plan 20:resume   (bench/job_moves.py)

--model ddp: DistributedDataParallel, under fp16 autocast and a GradScaler unless --no-amp;
--model fsdp2: fully_shard, without them unless --amp. Each rank prints its loss bit-exactly
(float.hex), so two runs compare bit for bit. Size: --ballast-gb B, a ballast of B GiB beside the
model, or --gb G, the rank's whole training state (parameters, gradients, AdamW moments, ballast).

Without FLEXIUM_SERVER a control thread in every rank stands in for the server: it gives the
engine the rank's share of each planned whole-job operation (the same operation id in every rank,
as the server's commands carry) once the rank has passed that step; a job of one rank is one
process to the server, which sends it the one-process operations. --hold S keeps a pause for S
seconds before the next operation; while paused every rank reads NVML for what it holds.

--backend gloo puts every rank on cuda:0 (gloo allows it). --ranks-share-gpu puts every rank on
cuda:0 with NCCL too, so that a machine with one GPU runs the protocol with NCCL. NCCL refuses two
ranks of one host on one GPU unless told: "sockets", each rank names a host of its own
(NCCL_HOSTID) and NCCL connects them by its socket transport over the loopback (any NCCL); "ipc",
NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL 2.30+), and NCCL shares its buffers between the ranks as CUDA
IPC, as between ranks on GPUs of their own (what a checkpoint cannot restore unless NCCL is
suspended, fact `nccl-buffers-not-restorable`).

Events: capabilities (what the rank reports to a server), ready, step (its loss, and when it ended
on the perf_counter clock), op (each operation: its path, seconds, the optimizer step the job
stopped at, each of its steps' seconds, its notes, what the rank holds on each GPU and what every
process uses there, by NVML), paused (the same readings while paused), done (whether the ballast
came through intact, what the rank holds and PyTorch reserves).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flexium  # noqa: E402
import job_plan  # noqa: E402
from flexium.api import runtime as flexium_runtime  # noqa: E402
from job_events import emit  # noqa: E402
from job_plan import PlanItem, Progress, rank_map  # noqa: E402

LAYERS = 4


def shared_gpu_env(how: str, rank: int) -> dict[str, str]:
    """What tells NCCL to let ranks share a GPU (--ranks-share-gpu)."""
    if how == "sockets":
        return {"NCCL_HOSTID": f"flexium-test-rank-{rank}", "NCCL_SOCKET_IFNAME": "lo"}
    return {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}


def held_by(pids: list[int]) -> dict[str, int]:
    """What these processes hold on each GPU, by UUID."""
    from flexium.engine import nvml

    return {gpu.uuid: sum(gpu.used_by(pid) or 0 for pid in pids) for gpu in nvml.host_gpus()}


def used_now() -> dict[str, int]:
    """Each GPU's memory used by every process, by UUID: a GPU the job left must be back to its
    idle reading (no copier context, no NCCL buffer left there)."""
    from flexium.engine import nvml

    return {gpu.uuid: gpu.memory_used for gpu in nvml.host_gpus()}


def unretired_collectives() -> dict[str, int] | None:
    """How many collectives of each process group torch's NCCL watchdog still lists (enqueued,
    not yet seen completed), from its flight recorder's status (host memory only, so it can be
    read while the rank is checkpointed); None where the recorder is off
    (TORCH_NCCL_TRACE_BUFFER_SIZE unset)."""
    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_nccl_trace_json", None) or getattr(c10d, "_dump_fr_trace_json", None)
    if dump is None or not os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        return None
    status = json.loads(dump(includeCollectives=False))["pg_status"]
    return {pg: int(s["last_enqueued_collective"]) - int(s["last_completed_collective"]) for pg, s in status.items()}


def described(result: Any) -> dict[str, Any]:
    """An operation's result as the op event carries it: each step's seconds (a step that ran more
    than once, summed), and the optimizer step the job stopped at for a pause or a migration."""
    from flexium.engine.distributed.job_operation import STOPPED_AT

    steps: dict[str, float] = {}
    for step in result.steps:
        if not step.rollback:
            steps[step.step] = steps.get(step.step, 0.0) + step.seconds
    found = [re.search(rf"{STOPPED_AT} (\d+)", note) for note in result.notes]
    return {
        "path": result.path,
        "seconds": result.seconds,
        "stopped_at": next((int(m.group(1)) for m in found if m), None),
        "steps": steps,
        "bytes_moved": result.bytes_moved,
        "notes": list(result.notes),
    }


def one_process_operation(engine: Any, op: Any) -> Any:
    if op.kind == "pause":
        return engine.pause()
    if op.kind == "resume":
        return engine.resume(op.target)
    return engine.migrate(op.target)


def control(plan: list[PlanItem], progress: Progress, hold: float, rank: int, world: int) -> None:
    from flexium.client.reports import ProcessReporter
    from flexium.engine.distributed.job_operation import JobOperation
    from flexium.engine.operations import OperationKind
    from flexium.errors import FlexiumError

    current = flexium_runtime.current()
    assert current is not None and current.engine is not None, "flexium's engine is not running in this rank"
    engine = current.engine
    capabilities = ProcessReporter(current).capabilities()
    emit("capabilities", rank=rank, **capabilities.model_dump(include={"job_operations", "problems"}))
    for index, item in enumerate(plan):
        progress.wait_for_item(item)
        gpu = rank_map(item).get(rank)
        op = JobOperation(
            operation_id=index + 1,
            kind=OperationKind(item.op),
            rank=rank,
            world_size=world,
            target=None if gpu is None else next(g.uuid for g in engine.gpus if g.nvml_index == gpu),
        )
        try:
            # A job of one rank is one process to the server, which sends it the one-process commands.
            result = engine.run_job_operation(op) if world > 1 else one_process_operation(engine, op)
        except FlexiumError as exc:
            failed = getattr(exc, "result", None)
            emit("op", rank=rank, kind=item.op, ok=False, error=str(exc), **(described(failed) if failed else {}))
            continue
        emit("op", rank=rank, kind=item.op, ok=True, **described(result), held=held_by([os.getpid()]), used=used_now())
        if item.op == "pause":
            time.sleep(hold / 2)
            emit("paused", rank=rank, held=held_by([os.getpid()]), used=used_now(), unretired=unretired_collectives())
            time.sleep(hold / 2)


def build(model_kind: str, device: int, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(LAYERS)]
    body: list[torch.nn.Module] = []
    for layer in layers:
        body += [layer, torch.nn.GELU()]
    model: torch.nn.Module = torch.nn.Sequential(*body).cuda()
    if model_kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device])
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def capture_all_reduce() -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph holding an NCCL all-reduce of a tensor of its own (warmed up on a side
    stream first, as capturing a collective needs)."""
    value = torch.ones(1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            dist.all_reduce(value)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(value)
    return graph, value


def checksum(ballast: torch.Tensor) -> float:
    # By chunks: a whole double copy would stay reserved and count as training state.
    return sum(float(chunk.double().sum().item()) for chunk in ballast.split(1 << 24))


def arguments() -> tuple[argparse.Namespace, list[PlanItem]]:
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=job_plan.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument(
        "--amp", action=argparse.BooleanOptionalAction, help="fp16 autocast and a GradScaler (default: with ddp)"
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--ballast-gb", type=float, default=1.0, help="GiB of ballast per rank beside the model")
    size.add_argument("--gb", type=float, help="GiB of training state per rank in all: model, AdamW, ballast")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--plan", action="append", default=[], help="STEP:OP[:RANK=GPU,...], repeatable (below)")
    parser.add_argument("--hold", type=float, default=2.0, help="seconds each pause lasts")
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl", help="gloo: every rank on cuda:0")
    parser.add_argument("--ranks-share-gpu", choices=("sockets", "ipc"), help="every rank on cuda:0, and how (above)")
    parser.add_argument(
        "--graph-all-reduce", action="store_true", help="capture a CUDA graph of an all-reduce and replay it each step"
    )
    args = parser.parse_args()
    try:
        plan = job_plan.parse_rank_plan(args.plan)
    except ValueError as exc:
        parser.error(str(exc))
    if args.amp is None:
        args.amp = args.model == "ddp"
    return args, plan


def main() -> None:
    args, plan = arguments()
    rank = int(os.environ["RANK"])
    if args.backend == "gloo" or args.ranks_share_gpu:
        os.environ["GPU_DEVICE"] = "cuda:0"
    if args.ranks_share_gpu:
        os.environ.update(shared_gpu_env(args.ranks_share_gpu, rank))

    flexium.init()  # before the process group: cuda:LOCAL_RANK, and NCCL set up to be movable
    device = torch.cuda.current_device()
    if args.backend == "nccl":
        dist.init_process_group("nccl", device_id=torch.device("cuda", device))
    else:
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    model, optimizer = build(args.model, device, args.width)
    scaler = torch.amp.GradScaler("cuda") if args.amp else None
    data = torch.Generator(device="cuda").manual_seed(10 + rank)
    if args.gb is not None:
        # FSDP2's parameters are DTensors: this rank holds its shard only. Weights, grads, two AdamW moments.
        params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters())
        ballast_bytes = max(0, int(args.gb * (1 << 30)) - 4 * params)
    else:
        ballast_bytes = int(args.ballast_gb * (1 << 30))
    ballast = torch.randn(ballast_bytes // 4, device="cuda", generator=data)
    ballast_sum = checksum(ballast)

    graph = capture_all_reduce() if args.graph_all_reduce else None

    progress = Progress()
    thread: threading.Thread | None = None
    if plan and not os.environ.get("FLEXIUM_SERVER"):
        thread = threading.Thread(target=control, args=(plan, progress, args.hold, rank, world), daemon=True)
        thread.start()
    emit("ready", rank=rank, pid=os.getpid(), device=str(torch.cuda.current_device()))
    for step in range(args.steps):
        x = torch.randn(args.batch, args.width, device="cuda", generator=data)
        with torch.autocast("cuda", dtype=torch.float16, enabled=scaler is not None):
            loss = model(x).float().square().mean()
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()  # whole-job operations run here, at the safe point
        if graph is not None:
            graph[0].replay()
        value = float(loss.item())
        torch.cuda.synchronize()
        emit("step", rank=rank, step=step, loss=value.hex(), end=time.perf_counter())
        progress.advance(step)
        time.sleep(args.step_sleep)
    if thread is not None:
        thread.join(timeout=600)
    current = flexium_runtime.current()
    keeper = current.engine._keeper if current is not None and current.engine is not None else None
    from flexium.engine.fast import pinned_budget

    emit(
        "done",
        rank=rank,
        ballast_intact=checksum(ballast) == ballast_sum,
        uuid=str(torch.cuda.get_device_properties(device).uuid),
        held=held_by([os.getpid()]),
        reserved=int(torch.cuda.memory_reserved()),
        # What the keeper of a kept-ready pause did last, and the host memory this rank keeps pinned
        # for one in flexium's budget (what `flexium doctor` lists).
        keeper_note=keeper.note if keeper is not None else None,
        kept_pinned=sum(h.bytes for h in pinned_budget.holders() if h.pid == os.getpid()),
    )
    dist.destroy_process_group()
    flexium.shutdown()


if __name__ == "__main__":
    main()
