"""Hugging Face Accelerate: a plain loop prepared by `Accelerator`, with `flexium.init()` first.

python examples/accelerate_loop.py [--steps N]                     # one process
accelerate launch --num_processes 2 examples/accelerate_loop.py    # two, moved as one job
"""

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import flexium


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()

    flexium.init()  # before Accelerator(): under `accelerate launch` it starts the process group
    accelerator = Accelerator(cpu=not flexium.auto.get_device().startswith("cuda"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=64, shuffle=True))
    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            step += 1
            if step % 50 == 0 or step == args.steps:
                accelerator.print(f"step {step:4d}  loss {loss.item():.4f}  on {flexium.auto.get_physical_device()}")
            if step == args.steps:
                break


if __name__ == "__main__":
    main()
