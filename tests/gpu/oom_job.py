"""Out-of-memory retry inside flexium's memory pool: `oom_job.py [FIRST_FRACTION SECOND_FRACTION]`.

After flexium.init() a tensor of FIRST_FRACTION (default 0.6) of the GPU's free memory is made
and deleted, so its block stays cached in the pool; then one of SECOND_FRACTION (0.7) is asked
for. Both do not fit at once: the allocation succeeds only if PyTorch frees the cached block
(oversize, thanks to max_split_size_mb) and retries. Prints one JSON line ("result").
"""

from __future__ import annotations

import json
import sys

import torch

import flexium
from flexium.api import runtime as flexium_runtime


def main() -> int:
    first_fraction = float(sys.argv[1]) if len(sys.argv) > 1 else 0.6
    second_fraction = float(sys.argv[2]) if len(sys.argv) > 2 else 0.7
    flexium.init()
    device = flexium.auto.get_device()
    pool = flexium_runtime.current().memory_pool
    free, total = torch.cuda.mem_get_info(device)  # after the context exists
    first, second = int(free * first_fraction), int(free * second_fraction)

    held = torch.empty(first, dtype=torch.uint8, device=device)
    held.fill_(1)
    torch.cuda.synchronize()
    del held
    reserved_cached = torch.cuda.memory_reserved(device)
    error = None
    first_attempt_ok = True
    big = None
    for attempt in range(2):
        try:
            big = torch.empty(second, dtype=torch.uint8, device=device)
            break
        except torch.cuda.OutOfMemoryError as exc:
            # PyTorch's retry inside a routed pool frees oversize cached blocks, but retries only
            # when they cover the request; a second attempt then finds the memory free.
            first_attempt_ok = False
            error = f"attempt {attempt + 1}: {type(exc).__name__}: {str(exc)[:1500]}"
    if big is not None:
        big.fill_(7)
        torch.cuda.synchronize()
        success = bool(big[:: 1 << 20].eq(7).all().item())
    else:
        success = False
    reserved_after = torch.cuda.memory_reserved(device)
    pool_bytes = None
    try:
        from flexium import _C

        pool_bytes = int(_C.vmm_bytes_on(int(str(device).split(":")[1])))
    except Exception:  # informative only
        pass
    print(
        json.dumps(
            {
                "event": "result",
                "success": success,
                "first_attempt_ok": first_attempt_ok,
                "error": error,
                "free": free,
                "total": total,
                "first": first,
                "second": second,
                "reserved_cached": reserved_cached,
                "reserved_after": reserved_after,
                "pool_bytes": pool_bytes,
                "pool_active": bool(pool is not None and pool.active),
                "pool_reason": pool.reason_off if pool is not None else "no memory pool in the session",
            }
        ),
        flush=True,
    )
    del big
    flexium.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
