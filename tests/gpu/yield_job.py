"""The job's memory comes first: `python yield_job.py` prints one JSON line ("result").

The job trains until flexium keeps its pause ready (the copier process holding the host staging
pinned, with a context on the job's GPU), then fills the GPU but 256 MiB and asks for 512 MiB
more: that allocation can only succeed if the copier gives its context's memory back, which the
allocator makes it do (csrc/gpu_memory_yield.h). Then the job is paused and resumed, and its
tensors are checked.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time

import torch

import flexium
from flexium import _C
from flexium.api import runtime as flexium_runtime
from flexium.engine import nvml

KEEP_WAIT_S = 60.0
HANG_S = 100.0  # every thread's stack to stderr, and exit, well before the test's time limit


def stage(what: str) -> None:
    print(f"[yield_job] {what}", file=sys.stderr, flush=True)


def copier_gpu_bytes(pid: int) -> int:
    return sum(gpu.used_by(pid) or 0 for gpu in nvml.host_gpus())


def main() -> int:
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    flexium.init()
    device = flexium.auto.get_device()
    engine = flexium_runtime.current().engine
    fast = engine._ctx.fast
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 2048).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(256, 2048, device=device)

    def step() -> None:
        loss = model(data).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize(device)

    deadline = time.monotonic() + KEEP_WAIT_S
    while not (fast.keeping and fast._copier is not None and fast._copier.awake_on) and time.monotonic() < deadline:
        step()
        time.sleep(0.01)
    stage(f"kept: {fast.keeping}")
    result: dict[str, object] = {"event": "result", "kept": bool(fast.keeping), "pid": os.getpid()}
    copier = fast._copier.pid if fast._copier is not None else None
    result["copier_bytes_before"] = copier_gpu_bytes(copier) if copier else None
    yields = _C.gpu_memory_yields()
    free, _total = torch.cuda.mem_get_info(device)
    fill = torch.empty(free - (256 << 20), dtype=torch.uint8, device=device)
    stage(f"filled {fill.numel() >> 20} MiB; asking for 512 MiB more")
    try:
        extra = torch.empty(512 << 20, dtype=torch.uint8, device=device)
        extra.fill_(3)
        result["extra_ok"] = bool(extra[:: 1 << 20].eq(3).all().item())
        del extra
    except torch.cuda.OutOfMemoryError as exc:
        result["extra_ok"] = False
        result["error"] = str(exc)[:500]
    result["yields"] = _C.gpu_memory_yields() - yields
    stage(f"extra ok: {result['extra_ok']}, yields {result['yields']}")
    result["copier_bytes_after"] = copier_gpu_bytes(copier) if copier else None
    del fill

    # Still pausable: a pause from another thread (as flexium's server connection asks) while training goes on.
    expected = [p.detach().clone() for p in model.parameters()]
    outcome: dict[str, object] = {}

    def pause_and_resume() -> None:
        try:
            stage("pausing")
            outcome["pause"] = engine.pause().path
            stage("paused")
            time.sleep(0.5)
            outcome["resume"] = engine.resume().path
            stage("resumed")
        except Exception as exc:
            outcome["error"] = f"{type(exc).__name__}: {exc}"

    optimizer.zero_grad(set_to_none=True)  # steps without gradients leave the parameters as they are
    control = threading.Thread(target=pause_and_resume)
    control.start()
    while control.is_alive():
        data.add_(0)
        torch.cuda.synchronize(device)
        optimizer.step()  # a safe point
        time.sleep(0.01)
    control.join()
    result.update(outcome)
    result["intact"] = all(torch.equal(a, b) for a, b in zip(expected, model.parameters(), strict=True))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
