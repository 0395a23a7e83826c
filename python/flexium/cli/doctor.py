"""`flexium doctor`: this machine's capability check, with what to do about each problem."""

from __future__ import annotations

import json
import os
from typing import Any

from flexium.engine import nvml
from flexium.engine.capabilities import Capabilities, cuda_text, detect
from flexium.torch_import import import_torch

GIB = 1 << 30
LABEL_WIDTH = 20  # the longest label, "pinned host memory", and two blanks


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


def _pinned_host_memory() -> dict[str, Any]:
    """The pinned host memory budget (engine/fast/pinned_budget.py) and who keeps what of it now."""
    from flexium.engine.fast import pinned_budget
    from flexium.errors import ConfigError

    try:
        limit = pinned_budget.budget()
    except ConfigError as exc:
        return {"problem": str(exc)}
    holders = pinned_budget.holders()
    return {
        "budget_bytes": limit.bytes,
        "setting": limit.setting,
        "source": limit.source,
        "kept_bytes": sum(h.bytes for h in holders),
        "kept_by": [{"pid": h.pid, "bytes": h.bytes, "gpu": h.gpu} for h in holders],
    }


def _describe_pinned(pinned: dict[str, Any]) -> list[tuple[str, str]]:
    if "problem" in pinned:
        return [("pinned host memory", f"! {pinned['problem']}")]
    budget, kept = pinned["budget_bytes"], pinned["kept_bytes"]
    if budget == 0:
        head = "none kept between pauses: each pause prepares its own staging (FLEXIUM_PINNED_HOST_MEMORY=0)"
    else:
        head = (
            f"{budget / GIB:.1f} GiB for pauses kept ready (FLEXIUM_PINNED_HOST_MEMORY={pinned['setting']}, "
            f"{pinned['source']}); {kept / GIB:.1f} GiB kept now"
        )
    rows = [("pinned host memory", head)]
    for holder in pinned["kept_by"]:
        rows.append(("", f"process {holder['pid']}  {holder['bytes'] / GIB:.1f} GiB  for GPU {holder['gpu']}"))
    if budget:
        rows.append(("", "(a job whose pause does not fit prepares its staging when paused: seconds more per 16 GiB)"))
    return rows


def _torchrun_jobs(caps: Capabilities, nccl_found: str, jobs_problem: str | None) -> str:
    """Whether a torchrun job here moves as a whole: claimed only where a rank could be paused."""
    if not caps.pause_resume:
        return "not movable: pause / resume is not available"
    if jobs_problem is not None:
        return f"not movable: {jobs_problem}"
    if nccl_found.startswith("none"):
        return "gloo jobs movable as a whole (no NCCL)"
    return "movable as a whole"


def run(*, as_json: bool) -> int:
    import_torch()
    caps = detect()
    gpus = nvml.host_gpus()
    fast_problem = _fast_path_problem() if caps.pause_resume else "pause / resume is not available"
    nccl_found, jobs_problem = _distributed_jobs()
    pinned = _pinned_host_memory()
    if as_json:
        print(
            json.dumps(
                {
                    "capabilities": caps.to_dict(),
                    "fast_path": {"available": fast_problem is None, "problem": fast_problem},
                    "distributed_jobs": {
                        "nccl": nccl_found,
                        "movable": caps.pause_resume and jobs_problem is None,
                        "problem": jobs_problem if caps.pause_resume else "pause / resume is not available",
                    },
                    "pinned_host_memory": pinned,
                    "gpus": [g.__dict__ | {"processes": len(g.processes)} for g in gpus],
                }
            )
        )
        return 0
    yes_no = {True: "yes", False: "no"}
    driver = "not found" if caps.driver_version is None and not caps.cuda_version else caps.driver_version or "?"
    if caps.cuda_version:
        driver += f"  (CUDA {cuda_text(caps.cuda_version)})"
    rows = [
        ("NVIDIA driver", driver),
        ("checkpoint API", yes_no[caps.checkpoint_api]),
        ("torch with CUDA", yes_no[caps.torch_cuda]),
        ("pause / resume", yes_no[caps.pause_resume]),
        ("GPU migration", yes_no[caps.migration]),
        ("fast path", "yes" if fast_problem is None else "no: " + fast_problem),
        ("NCCL", nccl_found),
        ("torchrun jobs", _torchrun_jobs(caps, nccl_found, jobs_problem)),
        *_describe_pinned(pinned),
    ]
    for label, value in rows:
        print(f"{label:<{LABEL_WIDTH}}{value}")
    for gpu in gpus:
        memory = f"{gpu.memory_used >> 20} / {gpu.memory_total >> 20} MiB"
        print(f"  GPU {gpu.index}  {gpu.name}  {gpu.uuid}  {memory}  {gpu.health}")
    for problem in caps.problems:
        print(f"! {problem}")
    return 0
