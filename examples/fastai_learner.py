"""fastai: a `Learner` trained with `fit_one_cycle` on data made here, with `flexium.init()`
first.

    python examples/fastai_learner.py [--steps N]
"""

import argparse

import torch
from fastai.callback.schedule import fit_one_cycle  # noqa: F401  (adds Learner.fit_one_cycle)
from fastai.data.core import DataLoaders
from fastai.learner import Learner
from fastai.losses import CrossEntropyLossFlat
from torch.utils.data import TensorDataset

import flexium


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300, help="one epoch of this many batches")
    args = parser.parse_args()

    flexium.init()
    device = torch.device(flexium.auto.get_device())
    torch.manual_seed(0)
    count = args.steps * 64
    train = TensorDataset(torch.randn(count, 64), torch.randint(0, 10, (count,)))
    valid = TensorDataset(torch.randn(256, 64), torch.randint(0, 10, (256,)))
    dls = DataLoaders.from_dsets(train, valid, bs=64, device=device)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    learn = Learner(dls, model, loss_func=CrossEntropyLossFlat())
    learn.fit_one_cycle(1, lr_max=1e-3)
    print(f"done: {learn.train_iter} steps on {flexium.auto.get_physical_device()}")


if __name__ == "__main__":
    main()
