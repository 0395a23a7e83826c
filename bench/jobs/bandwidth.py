"""This machine's copy bandwidths, the floors of bench/migrate.py's rows: GPU0 -> GPU1 peer copy (with
2+ GPUs) and pinned host copies, plain torch (no flexium), best of --repeats. One JSON line:
{"event": "bandwidth", "peer_gbps", "peer_back_gbps", "d2h_gbps", "h2d_gbps", ...}.

    python bench/jobs/bandwidth.py [--peer-gb 4] [--host-gb 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import faulthandler
import time
from collections.abc import Callable
from typing import Any

from job_events import emit

GIB = 1 << 30


def measure(peer_gb: float, host_gb: float, repeats: int) -> dict[str, Any]:
    import torch

    def best(copy: Callable[[], Any], devices: tuple[int, ...], nbytes: int) -> tuple[float, list[float]]:
        copy()  # warm-up (enables peer access)
        rates = []
        for _ in range(repeats):
            for d in devices:
                torch.cuda.synchronize(d)
            started = time.perf_counter()
            copy()
            for d in devices:
                torch.cuda.synchronize(d)
            rates.append(nbytes / (time.perf_counter() - started) / 1e9)
        return max(rates), rates

    result: dict[str, Any] = {}
    peer = int(peer_gb * GIB)
    host = int(host_gb * GIB)
    src = torch.empty(peer, dtype=torch.uint8, device="cuda:0")
    if torch.cuda.device_count() >= 2:
        dst = torch.empty(peer, dtype=torch.uint8, device="cuda:1")
        result["peer_gbps"], result["peer_runs"] = best(lambda: dst.copy_(src), (0, 1), peer)
        result["peer_back_gbps"], result["peer_back_runs"] = best(lambda: src.copy_(dst), (0, 1), peer)
        result["can_access_peer"] = bool(torch.cuda.can_device_access_peer(0, 1))
        del dst
    pinned = torch.empty(host, dtype=torch.uint8, pin_memory=True)
    part = src[:host]
    result["d2h_gbps"], result["d2h_runs"] = best(lambda: pinned.copy_(part, non_blocking=True), (0,), host)
    result["h2d_gbps"], result["h2d_runs"] = best(lambda: part.copy_(pinned, non_blocking=True), (0,), host)
    result.update(peer_bytes=peer, host_bytes=host, repeats=repeats, device_count=torch.cuda.device_count())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-gb", type=float, default=4.0)
    parser.add_argument("--host-gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hang-seconds", type=float, default=900, help="dump every thread's stack and exit")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.hang_seconds, exit=True)
    emit("bandwidth", **measure(args.peer_gb, args.host_gb, args.repeats))


if __name__ == "__main__":
    main()
