"""The room check before a restore (csrc/room_check.h) against the real driver and NVML, on one GPU:
the process checkpoints itself, asks its NVML reader process how much the GPU has free, and
restores only where that covers what it needs; prints one JSON line per case."""

from __future__ import annotations

import json
import os

import torch

from flexium import _C
from flexium.engine import nvml

pid = os.getpid()
data = torch.arange(256 << 20, dtype=torch.int32, device="cuda:0")  # 1 GiB
expected = int(data[::1009].sum().item())
torch.cuda.synchronize()
uuid = _C.list_devices()[0].uuid
total = next(gpu.memory_total for gpu in nvml.host_gpus() if gpu.uuid == uuid)
print(json.dumps({"case": "gpu", "uuid": uuid, "total": total}), flush=True)
nvml.start_reader()

# More than the GPU has: the restore is not tried and the rollback restores the job where it was.
# Then what it holds: the restore runs.
for case, needed in (("refused", total + (1 << 30)), ("passed", 1 << 30)):
    with nvml.reader_pipes() as pipes:
        assert pipes is not None, "no NVML reader process"
        steps = [
            _C.Step(_C.StepKind.LOCK, timeout_ms=10000),
            _C.Step(_C.StepKind.CHECKPOINT),
            _C.room_check_step(pipes[0], pipes[1], uuid, needed, 2000),
            _C.Step(_C.StepKind.RESTORE),
            _C.Step(_C.StepKind.UNLOCK),
        ]
        rollbacks = [
            [],
            [_C.Step(_C.StepKind.RECOVER)],
            [_C.Step(_C.StepKind.RECOVER)],
            [_C.Step(_C.StepKind.RECOVER)],
            [_C.Step(_C.StepKind.UNLOCK)],
        ]
        outcomes = _C.run_steps(pid, steps, rollbacks)
    print(
        json.dumps(
            {
                "case": case,
                "needed": needed,
                "outcomes": [
                    {
                        "step": o.step,
                        "rollback": o.rollback,
                        "code": o.code,
                        "error": o.error_name,
                        "text": o.error_text,
                        "seconds": o.seconds,
                    }
                    for o in outcomes
                ],
                "state": _C.process_state(pid).name,
                "intact": int(data[::1009].sum().item()) == expected,
            }
        ),
        flush=True,
    )
nvml.stop_reader()
