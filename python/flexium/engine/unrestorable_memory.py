"""Memory the driver's checkpoint cannot bring back: a process holding some is refused a pause or a
move, for its restore would fail and leave it unable to run CUDA again (docs/facts.md fact 26).

That memory is a cuMem allocation located on the host and mapped for the CPU: what NCCL makes for
the host memory its ranks share unless NCCL_CUMEM_HOST_ENABLE=0 (flexium.init() sets it), and
what another library may make the same way. The native layer finds it (csrc/host_cumem_scan.h).
"""

from __future__ import annotations

from typing import Optional

from flexium import _C

MIB = 1 << 20


def problem() -> Optional[str]:
    """Why this process cannot be checkpointed for the memory it holds, with what to do; None: it can."""
    try:
        found = _C.host_cumem_mappings()
    except Exception as exc:  # what cannot be looked at cannot be called safe
        return (
            f"flexium could not look for memory the driver cannot restore ({type(exc).__name__}: {exc}); "
            "a pause or move is refused until it can: report this with `flexium doctor`'s output"
        )
    if not found:
        return None
    total = sum(m.size for m in found)
    places = sorted({m.location for m in found})
    count = "1 mapping" if len(found) == 1 else f"{len(found)} mappings"
    return (
        f"this process holds cuMem memory located on the host ({count}, {total / MIB:.1f} MiB on "
        f"{', '.join(places)}, the first at {found[0].address:#x}): the driver's restore of such memory fails "
        "and leaves the process unable to use CUDA again (docs/facts.md fact 26), so the job "
        "cannot be paused or moved while it holds it. NCCL makes its shared host memory so unless "
        "NCCL_CUMEM_HOST_ENABLE=0 (flexium.init() sets it when the job has not set it: unset it or set it to 0); "
        "memory of another library: have it allocate with cudaHostAlloc (pinned memory), or free it first"
    )
