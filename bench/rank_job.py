"""One rank of the benchmark's torchrun job (bench/job_moves.py runs it): DDP (or FSDP2's
fully_shard, --model fsdp2) over NCCL (or gloo, every rank on cuda:0) with AdamW and a ballast
that brings the rank's training state to --gb GiB, training on data of its own seed; a control
thread per rank gives the engine its share of each planned whole-job operation, as the server's
commands would. At the end every rank writes its step end times, its operations' results and its
reserved memory to --out/rank-N.json.

    torchrun --standalone --nproc-per-node 2 bench/rank_job.py --gb 16 --plan 20:pause --plan 20:resume --out /tmp/ranks
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import flexium
from flexium.api import runtime as flexium_runtime

RANK = int(os.environ["RANK"])
WIDTH = 4096
BATCH = 256
LAYERS = 4


def control(plan: list[str], done_steps: list[float], hold: float, world: int, ops: list[dict[str, Any]]) -> None:
    from flexium.engine.distributed.job_operation import JobOperation
    from flexium.engine.operations import OperationKind
    from flexium.errors import FlexiumError

    current = flexium_runtime.current()
    engine = None if current is None else current.engine
    assert engine is not None, "flexium's engine is not running in this rank"
    for index, item in enumerate(plan):
        step, kind, *rest = item.split(":", 2)
        targets = dict(pair.split("=") for pair in rest[0].split(",")) if rest else {}
        while len(done_steps) < int(step):
            time.sleep(0.001)
        gpu = targets.get(str(RANK))
        target = None if gpu is None else next(g.uuid for g in engine.gpus if g.nvml_index == int(gpu))
        op = JobOperation(index + 1, OperationKind(kind), RANK, world, target=target)
        try:
            result = engine.run_job_operation(op)
            ops.append({"kind": kind, "ok": True, **_result(result)})
        except FlexiumError as exc:
            failed = getattr(exc, "result", None)
            ops.append({"kind": kind, "ok": False, "error": str(exc), **(_result(failed) if failed else {})})
        if kind == "pause":
            time.sleep(hold)


def _checksum(ballast: torch.Tensor) -> float:
    # By chunks: a whole double copy would stay reserved and count as training state.
    return sum(float(chunk.double().sum().item()) for chunk in ballast.split(1 << 24))


def _result(result: Any) -> dict[str, Any]:
    return {
        "path": result.path,
        "seconds": result.seconds,
        "steps": [[s.step, s.seconds] for s in result.steps if not s.rollback],
        "bytes_moved": result.bytes_moved,
        "notes": list(result.notes),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=2.0, help="GiB of training state per rank")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--plan", action="append", default=[])
    parser.add_argument("--hold", type=float, default=1.0, help="seconds each pause lasts")
    parser.add_argument("--out", required=True, help="folder for each rank's rank-N.json")
    parser.add_argument("--model", choices=("ddp", "fsdp2"), default="ddp", help="DDP, or FSDP2's fully_shard")
    parser.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default="nccl",
        help="gloo: every rank on cuda:0 (gloo allows it, NCCL does not), for a machine with one GPU",
    )
    args = parser.parse_args()

    if args.backend == "gloo":
        os.environ["GPU_DEVICE"] = "cuda:0"
    flexium.init()
    device = torch.cuda.current_device()
    if args.backend == "nccl":
        dist.init_process_group("nccl", device_id=torch.device("cuda", device))
    else:
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]
    model: torch.nn.Module = torch.nn.Sequential(*layers).cuda()
    if args.model == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device])
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # FSDP2's parameters are DTensors: this rank holds its shard only.
    params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters())
    ballast_bytes = max(0, int(args.gb * (1 << 30)) - 4 * params)  # weights, grads, two AdamW moments
    data = torch.Generator(device="cuda").manual_seed(10 + RANK)
    ballast = torch.empty(ballast_bytes // 4, device="cuda").normal_(generator=data)
    checksum = _checksum(ballast)

    ends: list[float] = []
    ops: list[dict[str, Any]] = []
    thread = threading.Thread(target=control, args=(args.plan, ends, args.hold, world, ops), daemon=True)
    thread.start()
    for _ in range(args.steps):
        x = torch.randn(BATCH, WIDTH, device="cuda", generator=data)
        loss = model(x).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        ends.append(time.perf_counter())
    thread.join(timeout=600)
    intact = _checksum(ballast) == checksum
    reserved = int(torch.cuda.memory_reserved())
    done = {"event": "done", "rank": RANK, "ends": ends, "ops": ops, "reserved": reserved, "ballast_ok": intact}
    with open(os.path.join(args.out, f"rank-{RANK}.json"), "w") as f:
        json.dump(done, f)
    dist.destroy_process_group()
    flexium.shutdown()


if __name__ == "__main__":
    main()
