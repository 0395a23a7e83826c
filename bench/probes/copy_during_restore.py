"""Whether a resume can copy a job's bytes back while the driver restores the job (issue 39 item 1):
does another process's host-to-device copy slow the driver's restore of a checkpointed process on
the same GPU, and does the restore slow the copy?

    python bench/probes/copy_during_restore.py [--gb 16] [--job-gb 0.5] [--rounds 3]

The job is a fresh process holding --job-gb GiB (what stays in a fast-paused job's context, outside
its pool) that runs the driver's steps on itself from a thread of its own, as flexium does: lock
and checkpoint, then restore and unlock when told. This process stands for the copier: a context
of its own on the same GPU, --gb GiB of pinned host memory and as much device memory. Each round
measures, with the job checkpointed each time: the copy alone, the restore alone, and both started
together (the job's restore and unlock seconds as it timed them, the copy's seconds, and the wall
time from the order to the later of the two). One table row per round, then the best of each.
Needs a GPU and flexium built.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tables.py in bench/

from children import Talking  # noqa: E402
from tables import print_table  # noqa: E402

GIB = 1 << 30


def job_main(job_gb: float) -> None:
    """The job: holds its bytes, checkpoints itself on 'checkpoint', restores on 'restore', and
    says how each went (seconds as the native steps timed them)."""
    import torch

    from flexium import _C
    from flexium.engine import nvml

    pid = os.getpid()
    held = torch.full((max(1, int(job_gb * GIB) // 4),), 5.0, device="cuda")
    torch.cuda.synchronize()
    nvml.set_frozen(True)  # a checkpointed process must not call NVML itself

    def steps(*kinds: Any) -> dict[str, float | str]:
        outcomes: list[Any] = []
        thread = threading.Thread(
            target=lambda: outcomes.extend(_C.run_steps(pid, [_C.Step(k) for k in kinds], [[] for _ in kinds])),
            daemon=True,
        )
        thread.start()
        thread.join(120)
        if thread.is_alive():
            return {"error": "no return in 120 s"}
        failed = [o for o in outcomes if o.code]
        if failed:
            return {"error": f"{failed[0].step}: {failed[0].error_name} {failed[0].error_text}"}
        return {o.step: round(float(o.seconds), 4) for o in outcomes}

    print(json.dumps({"event": "ready"}), flush=True)
    for line in sys.stdin:
        order = line.strip()
        if order == "checkpoint":
            said = steps(_C.StepKind.LOCK, _C.StepKind.CHECKPOINT)
        elif order == "restore":
            started = time.monotonic()
            said = steps(_C.StepKind.RESTORE, _C.StepKind.UNLOCK)
            said["done_at"] = started + sum(v for v in said.values() if isinstance(v, float))
            said["intact"] = bool(float(held[:: 1 << 20].sum().item()) == 5.0 * len(range(0, held.numel(), 1 << 20)))
        else:
            break
        print(json.dumps({"event": order, **said}), flush=True)
    os._exit(0)


class Job(Talking):
    def __init__(self, job_gb: float) -> None:
        super().__init__([__file__, "--job", str(job_gb)])
        assert self.read()["event"] == "ready"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=16.0, help="GiB the copier copies to the GPU")
    parser.add_argument("--job-gb", type=float, default=0.5, help="GiB the job's context holds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--job", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job is not None:
        job_main(args.job)
        return 0

    import torch

    size = int(args.gb * GIB)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()

    def copy() -> float:
        started = time.monotonic()
        with torch.cuda.stream(stream):
            device.copy_(host, non_blocking=True)
        stream.synchronize()
        return time.monotonic() - started

    copy()  # warm: the first copy maps the pinned pages for the GPU
    job = Job(args.job_gb)
    rows: list[tuple[str, ...]] = []
    best: dict[str, float] = {}

    def keep(name: str, seconds: float) -> str:
        best[name] = min(best.get(name, seconds), seconds)
        return f"{seconds:.3f}"

    try:
        for round_ in range(1, args.rounds + 1):
            job.ask("checkpoint")
            alone_copy = copy()
            alone = job.ask("restore")
            job.ask("checkpoint")
            ordered = time.monotonic()
            job.order("restore")
            together_copy = copy()
            together = job.read()
            if "error" in together:
                raise RuntimeError(f"restore beside the copy: {together['error']}")
            copied_at = ordered + together_copy
            wall = max(copied_at, float(together["done_at"])) - ordered
            rows.append(
                (
                    str(round_),
                    keep("copy alone", alone_copy),
                    keep("restore alone", float(alone["restore"])),
                    f"{alone['unlock']:.3f}",
                    keep("copy beside", together_copy),
                    keep("restore beside", float(together["restore"])),
                    keep("both, wall", wall),
                    "yes" if alone["intact"] and together["intact"] else "NO",
                )
            )
            print(
                json.dumps({"round": round_, "alone": alone, "together": together, "copy": together_copy}), flush=True
            )
    finally:
        job.end()
    print(f"\n{args.gb:g} GiB host -> GPU copied by this process; the job's context holds {args.job_gb:g} GiB")
    print_table(
        (
            "round",
            "copy alone s",
            "restore alone s",
            "unlock s",
            "copy beside s",
            "restore beside s",
            "both, wall s",
            "job intact",
        ),
        rows,
    )
    print("best: " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in best.items()))
    print(
        f"copy rate alone {args.gb * GIB / best['copy alone'] / 1e9:.1f} GB/s, beside the restore "
        f"{args.gb * GIB / best['copy beside'] / 1e9:.1f} GB/s; sequential would take "
        f"{best['copy alone'] + best['restore alone']:.3f} s, together {best['both, wall']:.3f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
