"""Drives flexium._C against the real driver inside one process; prints one JSON line per check."""

from __future__ import annotations

import json
import os

import torch

from flexium import _C
from flexium.engine import nvml


def emit(check: str, **data: object) -> None:
    print(json.dumps({"check": check, **data}), flush=True)


def fields(record: object) -> dict[str, object]:
    """A bound record (DriverStatus) as a dict, for JSON."""
    return {name: getattr(record, name) for name in dir(record) if not name.startswith("_")}


def outcomes(items: list) -> list[dict[str, object]]:
    return [{"step": o.step, "rollback": o.rollback, "code": o.code, "error": o.error_name} for o in items]


def ours() -> dict[str, int]:
    return {gpu.uuid: gpu.used_by(os.getpid()) or 0 for gpu in nvml.host_gpus()}


pid = os.getpid()
devices = _C.list_devices()
emit(
    "devices",
    uuids=[d.uuid for d in devices],
    names=[d.name for d in devices],
    nvml=[g.uuid for g in nvml.host_gpus()],
    status=fields(_C.driver_status()),
)

data = torch.arange(256 << 20, dtype=torch.int32, device="cuda:0")  # 1 GiB
expected = int(data[::1009].sum().item())
torch.cuda.synchronize()
u0, u1 = devices[0].uuid, devices[1].uuid
others = [(d.uuid, d.uuid) for d in devices[2:]]

try:
    _C.unlock(pid)
    emit("unlock_running", raised=False)
except _C.DriverError as exc:
    emit("unlock_running", raised=True, call=exc.call, code=exc.code, name=exc.error_name, message=str(exc))

single = _C.run_steps(
    pid,
    [
        _C.Step(_C.StepKind.LOCK, timeout_ms=10000),
        _C.Step(_C.StepKind.CHECKPOINT),
        _C.Step(_C.StepKind.RESTORE, pairs=[_C.GpuPair(u0, u1)]),
        _C.Step(_C.StepKind.UNLOCK),
    ],
    [[], [_C.Step(_C.StepKind.RECOVER)], [_C.Step(_C.StepKind.RECOVER)], [_C.Step(_C.StepKind.UNLOCK)]],
)
emit(
    "single_pair",
    outcomes=outcomes(single),
    state=_C.process_state(pid).name,
    intact=int(data[::1009].sum().item()) == expected,
    ours=ours(),
)

full = _C.run_steps(
    pid,
    [
        _C.Step(_C.StepKind.LOCK, timeout_ms=10000),
        _C.Step(_C.StepKind.CHECKPOINT),
        _C.Step(
            _C.StepKind.RESTORE, pairs=[_C.GpuPair(u0, u1), _C.GpuPair(u1, u0)] + [_C.GpuPair(a, b) for a, b in others]
        ),
        _C.Step(_C.StepKind.UNLOCK),
    ],
    [[], [_C.Step(_C.StepKind.RECOVER)], [_C.Step(_C.StepKind.RECOVER)], [_C.Step(_C.StepKind.UNLOCK)]],
)
emit(
    "full_pairs",
    outcomes=outcomes(full),
    state=_C.process_state(pid).name,
    intact=int(data[::1009].sum().item()) == expected,
    ours=ours(),
    reported_uuid=_C.list_devices()[0].uuid,
)
