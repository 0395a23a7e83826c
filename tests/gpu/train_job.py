"""A real training job for the GPU tests and the benchmark: one JSON line per event on stdout.

    python train_job.py --ballast-gb 4 --steps 60 --plan 10:migrate:cuda:1 --plan 20:pause --plan 20:resume:cuda:0

A control thread (standing in for flexium's server connection) runs each planned operation once
the training loop has passed that step, and reports its result with an NVML reading of where the
job's memory is. The loss trace is printed bit-exactly (float.hex) for comparison between runs.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import threading
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

import flexium  # noqa: E402
from flexium.api import session as flexium_session  # noqa: E402
from flexium.engine import nvml  # noqa: E402


def emit(event: str, **data: object) -> None:
    print(json.dumps({"event": event, **data}), flush=True)


def placement_snapshot() -> dict[str, object]:
    pid = os.getpid()
    return {
        gpu.uuid: {"index": gpu.index, "ours": gpu.used_by(pid) or 0, "used": gpu.memory_used}
        for gpu in nvml.host_gpus()
    }


class Control(threading.Thread):
    def __init__(self, plan: list[tuple[int, str, str | None]], pause_seconds: float, progress: "Progress") -> None:
        super().__init__(daemon=True, name="test-control")
        self.plan = plan
        self.pause_seconds = pause_seconds
        self.progress = progress

    def run(self) -> None:
        engine = flexium_session.current().engine
        for at_step, op, target in self.plan:
            self.progress.wait_for(at_step)
            started = time.perf_counter()
            emit("op_start", op=op, target=target, at_step=at_step, step=self.progress.step)
            try:
                if op == "migrate":
                    result = engine.migrate(target)
                elif op == "pause":
                    result = engine.pause()
                else:
                    result = engine.resume(target)
                emit("op", op=op, target=target, ok=True, wall=time.perf_counter() - started,
                     result=result.to_dict(), nvml=placement_snapshot(),
                     physical=flexium.auto.get_physical_device(), logical=flexium.auto.get_device())
                if op == "pause":
                    time.sleep(self.pause_seconds)
            except Exception as exc:  # reported, and training must go on
                emit("op", op=op, target=target, ok=False, error_type=type(exc).__name__, error=str(exc),
                     step=getattr(exc, "step", None), state=engine.state.value, nvml=placement_snapshot())
        emit("control_done")


class Progress:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.step = -1

    def advance(self, step: int) -> None:
        with self._cond:
            self.step = step
            self._cond.notify_all()

    def wait_for(self, step: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.step >= step)


def parse_plan(items: list[str]) -> list[tuple[int, str, str | None]]:
    plan = []
    for item in items:
        step, op, *rest = item.split(":", 2)
        plan.append((int(step), op, rest[0] if rest else None))
    return plan


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ballast-gb", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--plan", action="append", default=[])
    parser.add_argument("--pause-seconds", type=float, default=1.0)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--step-sleep", type=float, default=0.02, help="keeps the loop from outrunning the plan")
    parser.add_argument("--no-flexium", action="store_true")
    parser.add_argument("--hang-seconds", type=float, default=300, help="dump every thread's stack and exit")
    args = parser.parse_args()

    faulthandler.dump_traceback_later(args.hang_seconds, exit=True)
    torch.use_deterministic_algorithms(True)
    if args.no_flexium:
        flexium.init(disabled=True)
    else:
        flexium.init()
    device = flexium.auto.get_device()

    torch.manual_seed(0)
    generator = torch.Generator(device=device)
    generator.manual_seed(1)
    ballast = torch.empty(int(args.ballast_gb * (1 << 30)) // 4, dtype=torch.float32, device=device)
    ballast.normal_(generator=generator)
    checksum = ballast[::4097].double().sum().item()
    width = args.width
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cuda.synchronize()
    emit("ready", pid=os.getpid(), device=device, uuid=str(torch.cuda.get_device_properties(device).uuid),
         migration=flexium.auto.is_migration_enabled(), process_id=flexium.auto.get_process_id(),
         reserved=torch.cuda.memory_reserved(), nvml=placement_snapshot())

    progress = Progress()
    control = Control(parse_plan(args.plan), args.pause_seconds, progress)
    if args.plan:
        control.start()
    losses = []
    last = time.perf_counter()
    max_gap = 0.0
    for step in range(args.steps):
        x = torch.randn(1024, width, device=device, generator=generator)
        loss = (model(x) - x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        value = loss.item()
        losses.append(value.hex())
        now = time.perf_counter()
        max_gap = max(max_gap, now - last)
        last = now
        progress.advance(step)
        time.sleep(args.step_sleep)
    if args.plan:
        control.join(timeout=600)
    intact = ballast[::4097].double().sum().item() == checksum
    emit("done", losses=losses, ballast_ok=intact, max_gap=max_gap,
         physical=flexium.auto.get_physical_device(), nvml=placement_snapshot())
    flexium.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
