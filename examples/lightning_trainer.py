"""PyTorch Lightning: a `LightningModule` trained by `Trainer`, with `flexium.init()` first.

    python examples/lightning_trainer.py [--steps N]

`devices=1`: the job uses one GPU (flexium keeps the others visible so it can move there).
"""

import argparse

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import flexium


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()

    flexium.init()
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
    trainer = L.Trainer(max_steps=args.steps, accelerator="auto", devices=1, logger=False, enable_checkpointing=False)
    trainer.fit(Classifier(), DataLoader(data, batch_size=64, shuffle=True))
    print(f"done: {trainer.global_step} steps, loss {trainer.callback_metrics['loss'].item():.4f}")


if __name__ == "__main__":
    main()
