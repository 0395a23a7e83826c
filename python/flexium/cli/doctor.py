"""`flexium doctor`: this machine's capability check, with what to do about each problem."""

from __future__ import annotations

import json

from flexium.engine import nvml
from flexium.engine.capabilities import detect


def run(*, as_json: bool) -> int:
    caps = detect()
    gpus = nvml.host_gpus()
    if as_json:
        print(json.dumps({"capabilities": caps.to_dict(), "gpus": [g.__dict__ | {"processes": len(g.processes)} for g in gpus]}))
        return 0
    yes_no = {True: "yes", False: "no"}
    print(f"NVIDIA driver     {caps.driver_version or 'not found'}  (CUDA {caps.cuda_version // 1000}.{caps.cuda_version % 1000 // 10})")
    print(f"checkpoint API    {yes_no[caps.checkpoint_api]}")
    print(f"torch with CUDA   {yes_no[caps.torch_cuda]}")
    print(f"pause / resume    {yes_no[caps.pause_resume]}")
    print(f"GPU migration     {yes_no[caps.migration]}")
    for gpu in gpus:
        print(f"  GPU {gpu.index}  {gpu.name}  {gpu.uuid}  {gpu.memory_used >> 20} / {gpu.memory_total >> 20} MiB  {gpu.health}")
    for problem in caps.problems:
        print(f"! {problem}")
    return 0
