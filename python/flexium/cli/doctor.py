"""`flexium doctor`: this machine's capability check, with what to do about each problem."""

from __future__ import annotations

import json
import os

from flexium.engine import nvml
from flexium.engine.capabilities import detect


def _fast_path_problem() -> str | None:
    """What keeps the fast path (flexium's memory pool) off on this machine, None if nothing."""
    from flexium import _C

    status = _C.driver_status()
    if not status.loaded:
        return "no NVIDIA driver"
    if not status.vmm_api:
        return "the driver lacks the CUDA virtual memory API"
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} has no usable CUDA"
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch._C, "_cuda_beginAllocateToPool"):
        return f"torch {torch.__version__} has no MemPool routing (PyTorch 2.6 or newer has it)"
    return None


def _distributed_jobs() -> tuple[str, str | None]:
    """(the NCCL a torchrun job of this environment would load, why its jobs could not move as
    a whole, or None)."""
    try:
        import torch
    except ImportError:
        return "none (PyTorch is not installed)", None
    if getattr(torch.distributed, "ProcessGroupNCCL", None) is None:
        return f"none (torch {torch.__version__} has no NCCL)", None  # gloo jobs move as a whole
    from flexium.engine.distributed import nccl

    library = nccl.loaded_library()
    found = "not loaded" if library is None else f"{library.version_name} ({library.path})"
    # A job's environment: this one with what flexium.init() sets in a rank.
    job_environ = {**os.environ, **nccl.movable_settings(os.environ)}
    return found, nccl.suspend_problem(job_environ)


def run(*, as_json: bool) -> int:
    caps = detect()
    gpus = nvml.host_gpus()
    fast_problem = _fast_path_problem() if caps.pause_resume else "pause / resume is not available"
    nccl_found, jobs_problem = _distributed_jobs()
    if as_json:
        print(
            json.dumps(
                {
                    "capabilities": caps.to_dict(),
                    "fast_path": {"available": fast_problem is None, "problem": fast_problem},
                    "distributed_jobs": {"nccl": nccl_found, "movable": jobs_problem is None, "problem": jobs_problem},
                    "gpus": [g.__dict__ | {"processes": len(g.processes)} for g in gpus],
                }
            )
        )
        return 0
    yes_no = {True: "yes", False: "no"}
    cuda = f"{caps.cuda_version // 1000}.{caps.cuda_version % 1000 // 10}"
    print(f"NVIDIA driver     {caps.driver_version or 'not found'}  (CUDA {cuda})")
    print(f"checkpoint API    {yes_no[caps.checkpoint_api]}")
    print(f"torch with CUDA   {yes_no[caps.torch_cuda]}")
    print(f"pause / resume    {yes_no[caps.pause_resume]}")
    print(f"GPU migration     {yes_no[caps.migration]}")
    print(f"fast path         {'yes' if fast_problem is None else 'no: ' + fast_problem}")
    print(f"NCCL              {nccl_found}")
    print(f"torchrun jobs     {'movable as a whole' if jobs_problem is None else 'not movable: ' + jobs_problem}")
    for gpu in gpus:
        memory = f"{gpu.memory_used >> 20} / {gpu.memory_total >> 20} MiB"
        print(f"  GPU {gpu.index}  {gpu.name}  {gpu.uuid}  {memory}  {gpu.health}")
    for problem in caps.problems:
        print(f"! {problem}")
    return 0
