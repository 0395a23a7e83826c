"""torchvision: a ResNet-18 (no pretrained weights) fed by a DataLoader with worker processes,
torchvision's transforms and its FakeData images (nothing is downloaded), with `flexium.init()`
first.

    python examples/torchvision_resnet.py [--steps N]
"""

import argparse

import torch
import torchvision
from torchvision.transforms import v2

import flexium


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    flexium.init()
    device = flexium.auto.get_device()
    torch.manual_seed(0)
    transform = v2.Compose(
        [v2.RandomResizedCrop(64), v2.RandomHorizontalFlip(), v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    )
    images = torchvision.datasets.FakeData(
        size=args.steps * 32, image_size=(3, 80, 80), num_classes=10, transform=transform
    )
    loader = torch.utils.data.DataLoader(
        images, batch_size=32, shuffle=True, num_workers=args.workers, pin_memory=device.startswith("cuda")
    )
    model = torchvision.models.resnet18(weights=None, num_classes=10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step, (x, y) in enumerate(loader):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  on {flexium.auto.get_physical_device()}", flush=True)


if __name__ == "__main__":
    main()
