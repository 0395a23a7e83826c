"""A process the driver cannot restore (docs/facts.md fact 26): it holds a cuMem allocation on the
host NUMA node mapped for the GPU and the CPU (as NCCL makes its shared host memory unless
NCCL_CUMEM_HOST_ENABLE=0), reached by a kernel, and runs flexium's locked section on itself from a
thread. Prints {"event": "ready"} before the locked section and {"event": "returned", "steps":
[[step, CUresult], ...]} should it end; while the restore has not returned, flexium's native layer
says so on stderr."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the probe that measured fact 26

import torch  # noqa: E402

from flexium import _C  # noqa: E402
from shared_gpu_probe import _DeviceView, _mapped_host_memory  # noqa: E402


def main() -> None:
    torch.ones(1, device="cuda").sum().item()
    device, _host, keep = _mapped_host_memory("cumem-host", 4 << 20)
    view = torch.as_tensor(_DeviceView(device, 1 << 20), device="cuda")
    view.fill_(1.0)  # a kernel has reached it, as NCCL's do (fact 26's probe)
    assert view.sum().item() == 1 << 20
    pid = os.getpid()
    steps = [
        _C.Step(_C.StepKind.LOCK, timeout_ms=10_000),
        _C.Step(_C.StepKind.CHECKPOINT),
        _C.Step(_C.StepKind.RESTORE),
        _C.Step(_C.StepKind.UNLOCK),
    ]

    def locked_section() -> None:
        outcomes = _C.run_steps(pid, steps, [[], [], [], []])
        print(json.dumps({"event": "returned", "steps": [[o.step, o.code] for o in outcomes]}), flush=True)

    print(json.dumps({"event": "ready", "pid": pid}), flush=True)
    threading.Thread(target=locked_section, daemon=True).start()
    time.sleep(600)  # no CUDA call here: it would wait for the unlock
    del keep


if __name__ == "__main__":
    main()
