"""Occupies a GPU from another process until stdin closes: `fill_gpu.py INDEX LEAVE_FREE_GIB [armed]`.
Armed, it makes its context, says so ({"armed": INDEX}), and fills only when a line arrives on
stdin, within milliseconds (to take the memory while another job is being checkpointed)."""

import json
import sys

import torch

index, leave_gib = int(sys.argv[1]), float(sys.argv[2])
torch.cuda.set_device(index)
torch.ones(1, device=f"cuda:{index}").sum().item()
if sys.argv[3:] == ["armed"]:
    print(json.dumps({"armed": index}), flush=True)
    sys.stdin.readline()
free, _ = torch.cuda.mem_get_info(index)
hold = torch.empty(max(0, free - int(leave_gib * (1 << 30))), dtype=torch.uint8, device=f"cuda:{index}")
torch.cuda.synchronize(index)
free_after, _ = torch.cuda.mem_get_info(index)
print(json.dumps({"filled": index, "held": hold.numel(), "free_after": free_after}), flush=True)
sys.stdin.read()
