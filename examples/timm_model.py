"""timm: a ResNet from `timm.create_model(pretrained=False)` with timm's own optimizer and
learning-rate scheduler, on images made here, with `flexium.init()` first.

    python examples/timm_model.py [--steps N]
"""

import argparse

import timm
import torch
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2

import flexium


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    flexium.init()
    device = flexium.auto.get_device()
    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10).to(device)
    optimizer = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
    scheduler, _ = create_scheduler_v2(optimizer, sched="cosine", num_epochs=args.steps, warmup_epochs=0)
    data = torch.Generator(device=device).manual_seed(0)
    for step in range(args.steps):
        x = torch.randn(32, 3, 64, 64, device=device, generator=data)
        y = torch.randint(0, 10, (32,), device=device, generator=data)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step_update(step + 1)
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  on {flexium.auto.get_physical_device()}", flush=True)


if __name__ == "__main__":
    main()
