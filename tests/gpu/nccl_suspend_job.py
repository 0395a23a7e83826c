"""A one-rank NCCL job that suspends its communicator around a flexium pause, as a whole-job
pause does on every rank: prints one JSON line with what it saw. Run with and without an
LD_PRELOADed NCCL that has ncclCommSuspend."""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist

import flexium
from flexium.api import runtime
from flexium.engine import nvml
from flexium.engine.distributed import nccl


def held() -> int:
    return sum(gpu.used_by(os.getpid()) or 0 for gpu in nvml.host_gpus())


def main() -> None:
    flexium.init()
    engine = runtime.current().engine
    assert engine is not None
    rendezvous = os.path.join(tempfile.mkdtemp(), "rendezvous")
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    probe = torch.ones(1, device="cuda")
    dist.all_reduce(probe)
    library = nccl.loaded_library()
    seen: dict[str, object] = {
        "library": None if library is None else library.path,
        "version": None if library is None else library.version_name,
        "can_suspend": None if library is None else library.can_suspend,
        "problem": nccl.suspend_problem(),
    }
    if library is not None and library.can_suspend:
        comms = nccl.communicators()
        seen["communicators"] = [type(c).__name__ for c in comms]
        torch.cuda.synchronize()
        for comm in comms:
            comm.suspend()
        seen["suspended"] = all(comm.is_suspended() for comm in comms)
        pause = engine.pause()
        seen["pause_path"] = pause.path
        seen["held_while_paused"] = held()
        engine.resume()
        for comm in comms:
            comm.resume()
        seen["resumed"] = not any(comm.is_suspended() for comm in comms)
        after = torch.full((1,), 3.0, device="cuda")
        dist.all_reduce(after)
        seen["all_reduce_after"] = float(after.item())
    print(json.dumps({"event": "seen", **seen}), flush=True)
    dist.destroy_process_group()
    flexium.shutdown()


if __name__ == "__main__":
    main()
