"""The training job of the benchmark and the GPU tests: an MLP with AdamW beside a ballast of random
data, moved by a plan of operations (job_plan.py, below) while it trains; one JSON line per event
on stdout.

    python bench/jobs/train_job.py --ballast-gb 4 --steps 60 --plan 10:migrate:cuda:1 \\
        --plan 20:pause@fast --plan 20:resume:cuda:0
    python bench/jobs/train_job.py --gb 16 --no-flexium --plan 10:handmove:cuda:1 --warmup 5 --tail-steps 5
    python bench/jobs/train_job.py --device cpu --ballast-gb 0.01 --width 64 --plan 5:pause --plan 5:resume

Size: --ballast-gb B, a ballast of B GiB beside an MLP 2048 wide (the GPU tests), or --gb G, the
whole training state (parameters, gradients, AdamW moments and ballast) about G GiB, the width from
G (the benchmark). Seeded and deterministic (torch.use_deterministic_algorithms): two runs with the
same flags give the same loss trace bit for bit (printed as float.hex). Feature flags make the job
use what real training jobs use, each deterministically: --amp (fp16 autocast + GradScaler),
--checkpointing (activation checkpointing of a block), --side-stream, --dataloader, --cuda-graph
(training_features.py). --stall-at N --stall-seconds S keeps step N from its optimizer step (the
safe point) for S seconds; --hold-memory KIND:STEP holds memory the checkpoint cannot carry until
step STEP (held_memory.py). --device cpu trains on CPU torch (flexium on the fake driver:
tests/unit/test_train_job.py).

It trains --steps steps, or with --tail-steps T on past them until the plan is done, then T more.
Every step is timed (perf_counter at its start and its end; each ends with loss.item(), so its GPU
work is done). Events: ready (after --warmup steps, when the plan starts: the state's bytes, the
pool), op_start and op (each operation: t0 when the control thread made the call, t1 when it
returned, its OperationResult as a dict, an NVML reading of where the job's memory is), first_step,
memory_held / memory_freed, occupied / armed / vacated, control_done, done (the loss trace, the
step times and each operation's downtime on the step clock, step_analysis.py). It exits 0 when it
trained to the end, whatever the plan's operations did.
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import sys
import time
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.utils.checkpoint  # noqa: E402

import flexium  # noqa: E402
import job_plan  # noqa: E402
from job_control import Control  # noqa: E402
from job_events import emit, physical_device, placement_snapshot, pool_status  # noqa: E402
from job_plan import PATHS, PlanItem, Progress  # noqa: E402
from step_analysis import analyse  # noqa: E402
from training_state import Training, build, hand_move  # noqa: E402

FEATURES = ("amp", "checkpointing", "side_stream", "dataloader", "cuda_graph")


def arguments() -> tuple[argparse.Namespace, list[PlanItem]]:
    parser = argparse.ArgumentParser(
        description=__doc__, epilog=job_plan.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--ballast-gb", type=float, default=2.0, help="GiB of ballast beside the model")
    size.add_argument("--gb", type=float, help="GiB of training state in all: model, AdamW, ballast")
    parser.add_argument("--width", type=int, help="MLP width (default: 2048, or from --gb)")
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--chunk-mb", type=float, default=0, help="ballast tensors of this many MiB (0: one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="where the job trains (default: flexium's device; cpu: CPU torch)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=0, help="steps before ready (and before the plan starts)")
    parser.add_argument("--tail-steps", type=int, help="train on past --steps until the plan is done, then this many")
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--plan", action="append", default=[], help="[+]STEP:OP[:ARG][@PATH], repeatable (below)")
    parser.add_argument("--path", choices=PATHS, default="auto", help="path for migrate and pause")
    parser.add_argument("--pause-seconds", type=float, default=1.0, help="how long a pause lasts before the next item")
    parser.add_argument("--settle-steps", type=int, default=0, help="steps between an operation and the next")
    parser.add_argument("--step-sleep", type=float, default=0.02, help="keeps the loop from outrunning the plan")
    parser.add_argument("--no-flexium", action="store_true", help="flexium.init(disabled=True): no pool, no engine")
    parser.add_argument("--hang-seconds", type=float, default=300, help="dump every thread's stack and exit")
    parser.add_argument("--amp", action="store_true", help="fp16 autocast and a GradScaler")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of the first block")
    parser.add_argument("--side-stream", action="store_true", help="a second CUDA stream feeds the forward")
    parser.add_argument("--dataloader", action="store_true", help="input from a DataLoader with 2 workers")
    parser.add_argument("--batch-delay", type=float, default=0.0, help="seconds a DataLoader worker takes per batch")
    parser.add_argument("--cuda-graph", action="store_true", help="a CUDA graph captured before training")
    parser.add_argument("--stall-at", type=int, default=-1, help="this step sleeps before its optimizer step")
    parser.add_argument("--stall-seconds", type=float, default=0.0)
    parser.add_argument(
        "--hold-memory",
        metavar="KIND:STEP",
        help="hold 4 MiB that the checkpoint cannot carry (host-cumem, managed or cuda-ipc; facts "
        "`cumem-host-memory-unrestorable`, `managed-memory-refused` and `ipc-import-unrestorable` in docs/facts.md) "
        "from before training until this step",
    )
    parser.add_argument(
        "--alloc-before-init",
        type=float,
        default=0.0,
        metavar="MB",
        help="allocate this many MB on cuda:0 before flexium.init() (kept alive)",
    )
    args = parser.parse_args()
    try:
        plan = job_plan.parse_plan(args.plan)
    except ValueError as exc:
        parser.error(str(exc))
    cuda_only = [*(name for name in FEATURES if getattr(args, name)), *(["hold_memory"] if args.hold_memory else [])]
    if args.device == "cpu" and (cuda_only or args.alloc_before_init):
        parser.error(f"--device cpu: {', '.join(cuda_only) or 'alloc_before_init'} need CUDA")
    if any(item.op == "handmove" for item in plan) and any(getattr(args, name) for name in FEATURES):
        parser.error("a handmove moves the model, the AdamW state and the ballast: no feature flags")
    return args, plan


def main() -> int:
    args, plan = arguments()
    faulthandler.dump_traceback_later(args.hang_seconds, exit=True)
    torch.use_deterministic_algorithms(True)
    early: torch.Tensor | None = None
    if args.alloc_before_init > 0:
        early = torch.full((int(args.alloc_before_init * (1 << 20)) // 4,), 1.5, dtype=torch.float32, device="cuda:0")
        torch.cuda.synchronize()
    if args.no_flexium:
        flexium.init(disabled=True)
    else:
        flexium.init()
    device = args.device or flexium.auto.get_device()
    on_cuda = torch.device(device).type == "cuda"
    hand = {item.step: item for item in plan if item.op == "handmove"}
    for item in hand.values():  # the target's context exists before the timed move
        torch.zeros(1, device=item.arg)
    training = build(
        device, gb=args.gb, ballast_gb=args.ballast_gb, width=args.width, chunk_mb=args.chunk_mb, seed=args.seed
    )
    checksum = training.checksum()
    width = training.width
    first_block, head = training.model[:2], training.model[2]

    from training_features import Batches, Graph, SideStream

    features = [name for name in FEATURES if getattr(args, name)]
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=8) if args.amp else None
    side = SideStream(width, device) if args.side_stream else None
    graph = Graph(width, device) if args.cuda_graph else None
    batches = Batches(width, args.batch, device, args.batch_delay) if args.dataloader else None

    def forward(inp: torch.Tensor) -> torch.Tensor:
        if args.checkpointing:
            hidden = torch.utils.checkpoint.checkpoint(first_block, inp, use_reentrant=False)
            return head(hidden)
        return training.model(inp)

    progress = Progress()
    control = Control(
        [item for item in plan if item.op != "handmove"],
        progress,
        path=args.path,
        pause_seconds=args.pause_seconds,
        settle_steps=args.settle_steps,
    )

    def start_plan(step_seconds: float | None) -> None:
        if on_cuda:
            torch.cuda.synchronize()
        state_bytes, allocated_bytes = training.held_bytes()
        emit(
            "ready",
            pid=os.getpid(),
            device=device,
            uuid=str(torch.cuda.get_device_properties(device).uuid) if on_cuda else None,
            migration=flexium.auto.is_migration_enabled(),
            process_id=flexium.auto.get_process_id(),
            gb=args.gb,
            width=width,
            flexium=not args.no_flexium,
            state_bytes=state_bytes,
            allocated_bytes=allocated_bytes,
            ballast_bytes=training.ballast_bytes,
            ballast_tensors=len(training.ballast),
            model_params=sum(p.numel() for p in training.model.parameters()),
            step_seconds=step_seconds,
            nvml=placement_snapshot(),
            features=features,
            requested_path=args.path,
            **pool_status(),
        )
        if control.plan:
            control.start()

    if args.warmup == 0:
        start_plan(None)
    held_kind, _, held_until = (args.hold_memory or "").partition(":")
    held = None
    if held_kind:
        from held_memory import HeldMemory

        held = HeldMemory(held_kind)

    hand_records: list[dict[str, Any]] = []
    starts: list[float] = []
    ends: list[float] = []
    losses: list[float] = []
    last = time.perf_counter()
    max_gap = 0.0
    last_planned = max((item.step for item in plan if not item.relative), default=-1)
    tail_from: int | None = None
    step = 0
    while True:
        if args.tail_steps is None and step >= args.steps:
            break
        if args.tail_steps is not None and step >= args.steps and step > last_planned + 1:
            if (not control.plan or control.finished.is_set()) and tail_from is None:
                tail_from = step
            if tail_from is not None and step >= tail_from + args.tail_steps:
                break
        if step >= args.max_steps:
            emit("warning", message=f"stopped at --max-steps {args.max_steps} before the plan finished")
            break
        starts.append(time.perf_counter())
        if step in hand:
            hand_records.append(move_by_hand(training, hand[step], step))
        if batches is not None:
            x = batches.next()
        else:
            x = torch.randn(args.batch, width, device=training.device, generator=training.generator)
        inp = side(x) if side is not None else x
        if scaler is not None:
            with torch.autocast("cuda", dtype=torch.float16):
                out = forward(inp)
            loss = (out.float() - x).pow(2).mean()
        else:
            loss = (forward(inp) - x).pow(2).mean()
        if graph is not None:
            loss = loss + 1e-3 * graph(x)
        training.optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if step == args.stall_at:
            emit("stall", step=step, seconds=args.stall_seconds)
            time.sleep(args.stall_seconds)
        if scaler is not None:  # engine operations run inside the optimizer step, at the safe point
            scaler.step(training.optimizer)
            scaler.update()
        else:
            training.optimizer.step()
        losses.append(loss.item())
        now = time.perf_counter()
        ends.append(now)
        max_gap = max(max_gap, now - last)
        last = now
        if held is not None and step == int(held_until):
            emit("memory_freed", step=step, intact=held.free(), **kept_for_a_pause())
            held = None
        if step + 1 == args.warmup:
            start_plan(ends[-1] - starts[-1])
        progress.advance(step)
        if step == 0:
            emit("first_step")  # a command from now on finds its safe point
        time.sleep(args.step_sleep)
        step += 1
    if control.is_alive():
        control.join(timeout=600)
    intact = training.checksum() == checksum
    summary = analyse(sorted([*hand_records, *control.records], key=lambda r: r["t0"]), starts, ends, args.warmup)
    extra: dict[str, object] = {}
    if early is not None:
        extra["early_ok"] = early.double().sum().item() == early.numel() * 1.5
    if scaler is not None:
        extra["amp_scale"] = scaler.get_scale()
    if batches is not None:
        batches.close()
    emit(
        "done",
        losses=[value.hex() for value in losses],
        losses_finite=all(math.isfinite(value) for value in losses),
        first_loss=losses[0] if losses else None,
        last_loss=losses[-1] if losses else None,
        ballast_ok=intact,
        max_gap=max_gap,
        steps=len(ends),
        step_starts=starts,
        step_ends=ends,
        median_step=summary["median_step"],
        normal_steps=summary["normal_steps"],
        ops=summary["ops"],
        engine_state=control.engine_state,
        physical=physical_device(),
        nvml=placement_snapshot(),
        **extra,
        **pool_status(),
    )
    flexium.shutdown()
    return 0


def move_by_hand(training: Training, item: PlanItem, step: int) -> dict[str, Any]:
    """A handmove, on the training thread at the start of its step; its record, printed as an "op"."""
    assert item.arg is not None
    t0 = time.perf_counter()
    moved = hand_move(training, item.arg)
    t1 = time.perf_counter()
    record = {
        "op": "handmove",
        "requested_path": "hand",
        "target": item.arg,
        "at_step": item.step,
        "t0": t0,
        "t1": t1,
        "ok": True,
        "ran_in_step": step,
        "physical": item.arg,
        "result": {
            "path": "hand",
            "ok": True,
            "seconds": t1 - t0,
            "bytes_moved": moved,
            "steps": [{"step": "copy", "seconds": t1 - t0, "ok": True, "rollback": False, "error": None}],
            "notes": [],
        },
    }
    emit("op", **record)
    return record


def kept_for_a_pause() -> dict[str, object]:
    """What the keeper of a kept-ready pause did while the job held memory it cannot checkpoint,
    and the host memory this process kept pinned for a pause meanwhile (none: its pause would be
    refused)."""
    from flexium.api import runtime
    from flexium.engine.fast import pinned_budget

    current = runtime.current()
    keeper = current.engine._keeper if current is not None and current.engine is not None else None
    return {
        "keeper_note": keeper.note if keeper is not None else None,
        "kept_pinned": sum(h.bytes for h in pinned_budget.holders() if h.pid == os.getpid()),
    }


if __name__ == "__main__":
    sys.exit(main())
