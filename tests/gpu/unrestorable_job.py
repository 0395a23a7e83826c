"""A process the driver cannot restore (docs/facts.md fact 26): it holds a cuMem allocation on the
host NUMA node mapped for the GPU and the CPU (as NCCL makes its shared host memory unless
NCCL_CUMEM_HOST_ENABLE=0), reached by a kernel, and runs flexium's native steps on itself from a
thread: lock, checkpoint, restore; then, what is left: a second restore, an unlock, the driver's
state of the process, and whether a CUDA call returns within 10 s. Prints {"event": "ready"}, then
{"event": "outcome", ...} with each call's CUresult."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "probes"))  # the probe of fact 26

import torch  # noqa: E402

from flexium import _C  # noqa: E402
from host_memory_restore import DeviceView, mapped_host_memory  # noqa: E402

CUDA_CALL_WAIT_S = 10.0


def codes(outcomes: list[_C.StepOutcome]) -> list[list[object]]:
    return [[o.step, o.code] for o in outcomes]


def main() -> None:
    torch.ones(1, device="cuda").sum().item()
    device, _host, keep = mapped_host_memory("cumem-host", 4 << 20)
    view = torch.as_tensor(DeviceView(device, 1 << 20), device="cuda")
    view.fill_(1.0)  # a kernel has reached it, as NCCL's do (fact 26's probe)
    assert view.sum().item() == 1 << 20
    pid = os.getpid()
    outcome: dict[str, object] = {}

    def locked_section() -> None:  # no CUDA call on the thread that locks: it would wait for the unlock
        steps = [_C.Step(_C.StepKind.LOCK, timeout_ms=10_000), _C.Step(_C.StepKind.CHECKPOINT)]
        outcome["first"] = codes(_C.run_steps(pid, [*steps, _C.Step(_C.StepKind.RESTORE)], [[], [], []]))
        outcome["again"] = codes(_C.run_steps(pid, [_C.Step(_C.StepKind.RESTORE)], [[]]))
        outcome["unlock"] = codes(_C.run_steps(pid, [_C.Step(_C.StepKind.UNLOCK)], [[]]))
        outcome["state"] = _C.process_state(pid).name

    print(json.dumps({"event": "ready", "pid": pid}), flush=True)
    section = threading.Thread(target=locked_section, daemon=True)
    section.start()
    section.join()
    summed: list[float] = []
    call = threading.Thread(target=lambda: summed.append(view.sum().item()), daemon=True)
    started = time.perf_counter()
    call.start()
    call.join(CUDA_CALL_WAIT_S)
    waited = time.perf_counter() - started
    outcome["cuda_call"] = f"returned {summed[0]:g}" if summed else f"no return in {waited:.0f} s"
    print(json.dumps({"event": "outcome", **outcome}), flush=True)
    del keep
    os._exit(0)  # the CUDA call still waits: no interpreter shutdown


if __name__ == "__main__":
    main()
