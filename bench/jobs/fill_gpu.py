"""Occupies a GPU from another process until stdin closes, as a job handed the GPU of a paused one
would (train_job.py's occupy and arm, tests/gpu's gpu_filler):

    python bench/jobs/fill_gpu.py INDEX LEAVE_FREE_GIB [--armed]

Prints {"filled": INDEX, "held": BYTES, "free_after": BYTES} once it holds all but LEAVE_FREE_GIB.
Armed, it makes its context, says so ({"armed": INDEX}), and fills only when a line arrives on
stdin, within milliseconds (to take the memory while another job is being checkpointed)."""

from __future__ import annotations

import argparse
import json
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("index", type=int, help="the GPU, in this process's CUDA numbering")
    parser.add_argument("leave_free_gib", type=float)
    parser.add_argument("--armed", action="store_true", help="fill only when a line arrives on stdin")
    args = parser.parse_args()
    import torch

    index = args.index
    torch.cuda.set_device(index)
    torch.ones(1, device=f"cuda:{index}").sum().item()
    if args.armed:
        print(json.dumps({"armed": index}), flush=True)
        sys.stdin.readline()
    free, _ = torch.cuda.mem_get_info(index)
    hold = torch.empty(max(0, free - int(args.leave_free_gib * (1 << 30))), dtype=torch.uint8, device=f"cuda:{index}")
    torch.cuda.synchronize(index)
    free_after, _ = torch.cuda.mem_get_info(index)
    print(json.dumps({"filled": index, "held": hold.numel(), "free_after": free_after}), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
