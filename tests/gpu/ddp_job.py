"""A torchrun job for the GPU tests: every rank prints one JSON line per event.

    torchrun --standalone --nproc-per-node 2 ddp_job.py --model ddp --steps 60 \\
        --plan 10:pause --plan 10:resume --plan 30:migrate:0=1,1=0

--model ddp: DistributedDataParallel with AdamW under fp16 autocast and a GradScaler;
--model fsdp2: fully_shard (FSDP2) with AdamW. Each rank trains on data of its own seed and
prints its loss bit-exactly (float.hex), so two runs compare bit for bit.

Without FLEXIUM_SERVER a control thread in every rank stands in for the server: it gives the
engine the rank's share of each planned whole-job operation (the same operation id in every
rank, as the server's commands carry) once the rank has passed that step. MAP is rank=GPU
index pairs: where each rank goes (migrate) or resumes (resume). --hold S keeps a pause for S
seconds before the next operation; while paused every rank reads NVML for what it holds.

--ranks-share-gpu puts every rank on cuda:0, so that a machine with one GPU runs the protocol
with NCCL too. NCCL refuses two ranks of one host on one GPU unless told: "sockets", each rank
names a host of its own (NCCL_HOSTID) and NCCL connects them by its socket transport over the
loopback (any NCCL); "ipc", NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL 2.30+), and NCCL shares its
buffers between the ranks as CUDA IPC, as between ranks on GPUs of their own (what a checkpoint
cannot restore unless NCCL is suspended, docs/facts.md fact 13).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from typing import Any, Optional

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flexium  # noqa: E402
from flexium.api import runtime as flexium_runtime  # noqa: E402
from flexium.engine import nvml  # noqa: E402
from flexium.engine.fast import pinned_budget  # noqa: E402

RANK = int(os.environ["RANK"])
WIDTH = 2048
BATCH = 512
SHARED_GPU = {
    "sockets": {"NCCL_HOSTID": f"flexium-test-rank-{RANK}", "NCCL_SOCKET_IFNAME": "lo"},
    "ipc": {"NCCL_MULTI_RANK_GPU_ENABLE": "1"},
}


def emit(event: str, **data: object) -> None:
    # One write per line: the ranks share torchrun's stdout, and a line written at once (under
    # PIPE_BUF) is never split by another rank's.
    sys.stdout.write(json.dumps({"event": event, "rank": RANK, **data}) + "\n")
    sys.stdout.flush()


def held_by(pids: list[int]) -> dict[str, int]:
    """What these processes hold on each GPU, by UUID."""
    return {gpu.uuid: sum(gpu.used_by(pid) or 0 for pid in pids) for gpu in nvml.host_gpus()}


def unretired_collectives() -> Optional[dict[str, int]]:
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


def stopped_at(notes: tuple[str, ...]) -> Optional[int]:
    """The optimizer step the job stopped at for a pause or a migration (the result says it)."""
    from flexium.engine.distributed.job_operation import STOPPED_AT

    found = [re.search(rf"{STOPPED_AT} (\d+)", note) for note in notes]
    return next((int(m.group(1)) for m in found if m), None)


def parse_plan(items: list[str]) -> list[tuple[int, str, dict[int, int]]]:
    plan = []
    for item in items:
        step, kind, *rest = item.split(":", 2)
        targets = {int(r): int(g) for r, g in (pair.split("=") for pair in rest[0].split(","))} if rest else {}
        plan.append((int(step), kind, targets))
    return plan


class Progress:
    def __init__(self) -> None:
        self.step = 0
        self.cond = threading.Condition()

    def advance(self) -> None:
        with self.cond:
            self.step += 1
            self.cond.notify_all()

    def wait_for(self, step: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.step >= step)


def one_process_operation(engine: Any, op: Any) -> Any:
    if op.kind == "pause":
        return engine.pause()
    if op.kind == "resume":
        return engine.resume(op.target)
    return engine.migrate(op.target)


def control(plan: list[tuple[int, str, dict[int, int]]], progress: Progress, hold: float, world: int) -> None:
    from flexium.client.reports import ProcessReporter
    from flexium.engine.distributed.job_operation import JobOperation
    from flexium.engine.operations import OperationKind
    from flexium.errors import FlexiumError

    current = flexium_runtime.current()
    engine = current.engine
    emit("capabilities", **ProcessReporter(current).capabilities().model_dump(include={"job_operations", "problems"}))
    for index, (step, kind, targets) in enumerate(plan):
        progress.wait_for(step)
        gpu = targets.get(RANK)
        op = JobOperation(
            operation_id=index + 1,
            kind=OperationKind(kind),
            rank=RANK,
            world_size=world,
            target=None if gpu is None else next(g.uuid for g in engine.gpus if g.nvml_index == gpu),
        )
        try:
            # A job of one rank is one process to the server, which sends it the one-process commands.
            result = engine.run_job_operation(op) if world > 1 else one_process_operation(engine, op)
        except FlexiumError as exc:
            result = getattr(exc, "result", None)
            emit(
                "op",
                kind=kind,
                ok=False,
                error=str(exc),
                stopped_at=None if result is None else stopped_at(result.notes),
                steps={} if result is None else {s.step: s.seconds for s in result.steps if not s.rollback},
            )
            continue
        emit(
            "op",
            kind=kind,
            ok=True,
            path=result.path,
            seconds=result.seconds,
            stopped_at=stopped_at(result.notes),
            steps={s.step: round(s.seconds, 4) for s in result.steps if not s.rollback},
            held=held_by([os.getpid()]),
        )
        if kind == "pause":
            time.sleep(hold / 2)
            emit("paused", held=held_by([os.getpid()]), unretired=unretired_collectives())
            time.sleep(hold / 2)


def build(model_kind: str, device: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)]
    body: list[torch.nn.Module] = []
    for layer in layers:
        body += [layer, torch.nn.GELU()]
    model = torch.nn.Sequential(*body).cuda()
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("ddp", "fsdp2"), default="ddp")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--plan", action="append", default=[])
    parser.add_argument("--hold", type=float, default=2.0)
    parser.add_argument("--ballast-gb", type=float, default=1.0)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--ranks-share-gpu", choices=SHARED_GPU, help="every rank on cuda:0, and how (see above)")
    parser.add_argument(
        "--graph-all-reduce", action="store_true", help="capture a CUDA graph of an all-reduce and replay it each step"
    )
    args = parser.parse_args()
    if args.ranks_share_gpu:
        os.environ.update(GPU_DEVICE="cuda:0", **SHARED_GPU[args.ranks_share_gpu])

    flexium.init()  # before the process group: cuda:LOCAL_RANK, and NCCL set up to be movable
    device = torch.cuda.current_device()
    if args.backend == "nccl":
        dist.init_process_group("nccl", device_id=torch.device("cuda", device))
    else:
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    model, optimizer = build(args.model, device)
    scaler = torch.amp.GradScaler("cuda") if args.model == "ddp" else None
    data = torch.Generator(device="cuda").manual_seed(10 + RANK)
    ballast = torch.randn(int(args.ballast_gb * (1 << 30)) // 4, device="cuda", generator=data)
    ballast_sum = float(ballast.double().sum().item())

    graph = capture_all_reduce() if args.graph_all_reduce else None

    progress = Progress()
    thread: Optional[threading.Thread] = None
    plan = parse_plan(args.plan)
    if plan and not os.environ.get("FLEXIUM_SERVER"):
        thread = threading.Thread(target=control, args=(plan, progress, args.hold, world), daemon=True)
        thread.start()
    emit("ready", pid=os.getpid(), device=str(torch.cuda.current_device()))
    for step in range(args.steps):
        x = torch.randn(BATCH, WIDTH, device="cuda", generator=data)
        with torch.autocast("cuda", dtype=torch.float16, enabled=scaler is not None):
            loss = model(x).float().square().mean()
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        if graph is not None:
            graph[0].replay()
        emit("step", step=step, loss=float(loss.item()).hex())
        progress.advance()
        time.sleep(args.step_sleep)
    if thread is not None:
        thread.join(timeout=600)
    intact = float(ballast.double().sum().item()) == ballast_sum
    emit(
        "done",
        ballast_intact=intact,
        uuid=str(torch.cuda.get_device_properties(device).uuid),
        held=held_by([os.getpid()]),
        # What the keeper of a kept-ready pause did last, and the host memory this rank keeps pinned
        # for one in flexium's budget (what `flexium doctor` lists).
        keeper_note=keeper.note if (keeper := flexium_runtime.current().engine._keeper) is not None else None,
        kept_pinned=sum(h.bytes for h in pinned_budget.holders() if h.pid == os.getpid()),
    )
    dist.destroy_process_group()
    flexium.shutdown()


if __name__ == "__main__":
    main()
