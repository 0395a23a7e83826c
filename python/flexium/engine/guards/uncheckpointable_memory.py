"""Memory the driver's checkpoint cannot carry: a process holding some is refused a pause or a
move before anything is touched, naming what it holds and what to do.

* managed (UVM) memory, `cudaMallocManaged` (bitsandbytes' paged optimizers make it): the
  checkpoint refuses it (CUDA_ERROR_NOT_SUPPORTED) after the job was stopped, and a fast pause
  would have copied all its memory out and back for nothing (fact `managed-memory-refused`);
* cuMem memory located on the host, what NCCL makes for the host memory its ranks share unless
  NCCL_CUMEM_HOST_ENABLE=0 (flexium.init() sets it), or another library the same way: the restore
  fails and the process never runs CUDA again, which loses the job (fact `cumem-host-memory-unrestorable`);
* CUDA memory imported from another process (torch.multiprocessing receiving a CUDA tensor): the
  restore fails the same way (fact `ipc-import-unrestorable`).

The native layer finds the first two (csrc/uncheckpointable_memory.h), PyTorch's own record the
third (imported_memory.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from flexium import _C
from flexium.engine.guards import imported_memory
from flexium.engine.operations import OperationKind
from flexium.errors import CapabilityError

MIB = 1 << 20


def problem() -> str | None:
    """Why this process cannot be checkpointed for the memory it holds, with what to do; None: it can."""
    try:
        found = _C.uncheckpointable_mappings()
        imports = imported_memory.held_now()
    except Exception as exc:  # what cannot be looked at cannot be called safe
        return (
            f"flexium could not look for memory the driver cannot checkpoint ({type(exc).__name__}: {exc}); "
            "a pause or move is refused until it can: report this with `flexium doctor`'s output"
        )
    managed = [m for m in found if m.kind == "managed"]
    on_host = [m for m in found if m.kind != "managed"]
    reasons = []
    if managed:
        reasons.append(
            f"this process holds managed memory ({_amount(managed)}): the driver's checkpoint refuses it (fact "
            "`managed-memory-refused` in docs/facts.md), so the job cannot be paused or moved while it holds it. It is "
            "made by cudaMallocManaged, e.g. bitsandbytes' paged optimizers: use one without paging (adamw_8bit for "
            "paged_adamw_8bit), or free it first"
        )
    if on_host:
        places = sorted({m.location for m in on_host})
        reasons.append(
            f"this process holds cuMem memory located on the host ({_amount(on_host)} on {', '.join(places)}): the "
            "driver's restore of such memory fails and leaves the process unable to use CUDA again (fact "
            "`cumem-host-memory-unrestorable` in docs/facts.md), so the job cannot be paused or moved while it holds "
            "it. NCCL makes its shared host memory so unless NCCL_CUMEM_HOST_ENABLE=0 (flexium.init() sets it when the "
            "job has not set it: unset it or set it to 0); memory of another library: have it allocate with "
            "cudaHostAlloc (pinned memory), or free it first"
        )
    if imports is not None:
        storages = "1 storage" if imports.storages == 1 else f"{imports.storages} storages"
        reasons.append(
            f"this process holds CUDA memory imported from another process ({storages}, {imports.bytes / MIB:.1f} MiB, "
            f"the first at {imports.first_address:#x}): the driver's restore of such a process fails and leaves it "
            "unable to use CUDA again (fact `ipc-import-unrestorable` in docs/facts.md), so the job cannot be paused "
            "or moved while it holds it. torch.multiprocessing imports so the CUDA tensors another process sends: keep "
            "a copy of your own (tensor.clone()) and let the received tensors go (del), or free them first"
        )
    return "; and ".join(reasons) or None


def refuse(kind: OperationKind) -> None:
    """Refuses an operation that checkpoints this process while it holds such memory;
    locked_section.prepare looks again at the safe point."""
    reason = problem()
    if reason is not None:
        raise CapabilityError(f"cannot {kind.value}: {reason}")


def _amount(mappings: Sequence[_C.UncheckpointableMapping]) -> str:
    count = "1 mapping" if len(mappings) == 1 else f"{len(mappings)} mappings"
    total = sum(m.size for m in mappings)
    return f"{count}, {total / MIB:.1f} MiB, the first at {mappings[0].address:#x}"
