"""A small training job with flexium: unchanged PyTorch code after `flexium.init()`.

    python examples/plain_pytorch.py [--steps N]

Runs on a GPU when there is one (and is then movable), else on the CPU.
"""

import argparse
import time

import torch

import flexium


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    args = parser.parse_args()

    flexium.init()
    device = flexium.auto.get_device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    model = model.cuda() if device.startswith("cuda") else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        x = torch.randn(128, 256, device=device)
        target = torch.randint(0, 10, (128,), device=device)
        loss = torch.nn.functional.cross_entropy(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}  on {flexium.auto.get_physical_device()}", flush=True)
        time.sleep(args.step_seconds)


if __name__ == "__main__":
    main()
