"""A torchrun job with DistributedDataParallel: each rank calls `flexium.init()` before the
process group, and the job is paused, resumed and migrated as a whole (`flexium pause` on any
rank's process acts on every rank; `flexium migrate PROC --ranks 0=cuda:1,1=cuda:0` swaps).

    torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py [--steps N]

NCCL on GPUs (it needs NCCL 2.29.7+ to move: README, "Distributed jobs"), gloo on the CPU.
"""

import argparse
import time

import torch
import torch.distributed as dist

import flexium


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    args = parser.parse_args()

    flexium.init()  # before init_process_group: this rank's GPU, and NCCL set up to be movable
    device = flexium.auto.get_device()
    on_gpu = device.startswith("cuda")
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).to(device)
    model = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[torch.device(device).index] if on_gpu else None
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator(device=device).manual_seed(rank)
    for step in range(args.steps):
        x = torch.randn(128, 256, device=device, generator=data)
        target = torch.randint(0, 10, (128,), device=device, generator=data)
        loss = torch.nn.functional.cross_entropy(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"rank {rank} step {step:4d}  loss {loss.item():.4f}  on {flexium.auto.get_physical_device()}")
        time.sleep(args.step_seconds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
