"""`flexium doctor` on a machine with NVIDIA GPUs says what this machine allows, as its parts
measure it: the driver's checkpoint API, the fast path, every GPU NVML sees, the pinned host
memory budget, and whether torchrun jobs could move as a whole with the NCCL they would load
(torch's own, and one preloaded with suspend)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from support.gpu import nccl_with_suspend


def doctor(env: dict[str, str] | None = None) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "flexium.cli.main", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        # the machine's default budget, whatever the session set
        env={**{k: v for k, v in os.environ.items() if k != "FLEXIUM_PINNED_HOST_MEMORY"}, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_doctor_says_what_this_machine_allows(host_gpus: list[Any]) -> None:
    import torch

    said = doctor()
    caps = said["capabilities"]
    assert caps["checkpoint_api"] and caps["pause_resume"] and caps["torch_cuda"], caps
    assert caps["migration"] == (caps["driver_major"] >= 580 and caps["cuda_version"] >= 13000), caps
    assert caps["gpu_count"] == len(host_gpus) and caps["problems"] == [], caps
    assert said["fast_path"] == {"available": True, "problem": None}
    assert [g["uuid"] for g in said["gpus"]] == [g.uuid for g in host_gpus]
    pinned = said["pinned_host_memory"]
    assert pinned["budget_bytes"] > 0 and pinned["setting"] == "25%" and pinned["source"] == "the default", pinned

    bundled = torch.cuda.nccl.version()
    version = ".".join(str(part) for part in bundled)
    jobs = said["distributed_jobs"]
    if bundled < (2, 29, 7):  # torch 2.11's NCCL 2.28.9: its jobs are refused, and doctor says how to fix it
        assert jobs["nccl"].startswith(f"{version} (") and jobs["movable"] is False, jobs
        assert jobs["problem"].startswith(f"this job's NCCL is {version} (") and "LD_PRELOAD" in jobs["problem"], jobs
    else:
        assert jobs["movable"] is True, jobs

    preloaded = doctor({"LD_PRELOAD": nccl_with_suspend()})["distributed_jobs"]
    assert preloaded["movable"] is True and preloaded["problem"] is None, preloaded
    _version, _, path = preloaded["nccl"].partition(" (")
    assert os.path.realpath(path.rstrip(")")) == os.path.realpath(nccl_with_suspend()), preloaded
