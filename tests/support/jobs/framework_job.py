"""A training job written with one framework, for the GPU framework tests: one JSON line per
event on stdout ("ready" with the flexium process id, "loss" per optimizer step, bit-exact as
float.hex, "done"). Deterministic: two runs give the same loss trace bit for bit.

    python framework_job.py lightning|hf-trainer|accelerate|timm|torchvision|fastai|split|data-parallel \
        --steps 200 --pace 0.03

split and data-parallel are plain PyTorch jobs of one process on two GPUs: a model whose second
half is on cuda:1, and torch.nn.DataParallel over cuda:0 and cuda:1. lightning-ddp is Lightning's
Trainer with strategy="ddp" on two GPUs: this process is rank 0 and Lightning starts rank 1 by
running this script again; lightning-ddp-one-rank is the same on one GPU, a process group of one
rank. accelerate runs as two processes under `accelerate launch
--multi_gpu --num_processes 2`. In a job of several processes every event says its rank.

--pace sleeps after each optimizer step (a hook, the same for every framework), so that a
command line has time to act on the running job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

import flexium  # noqa: E402

FRAMEWORKS = (
    "lightning",
    "hf-trainer",
    "accelerate",
    "timm",
    "torchvision",
    "fastai",
    "split",
    "data-parallel",
    "lightning-ddp",
    "lightning-ddp-one-rank",
)


def rank() -> int:
    """This process's rank: RANK under torchrun and accelerate launch, LOCAL_RANK in the ranks
    Lightning starts (one node), 0 in a process of its own (and in Lightning's rank 0)."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def emit(event: str, **data: Any) -> None:
    # One write per line: the ranks of a job share its stdout.
    sys.stdout.write(json.dumps({"event": event, "rank": rank(), **data}) + "\n")
    sys.stdout.flush()


def report(loss: torch.Tensor) -> None:
    emit("loss", loss=float(loss.detach().float().item()).hex())


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))


def lightning(steps: int, devices: int = 1, strategy: str = "auto") -> None:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch: Any, _index: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            report(loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(steps * 64, 64), torch.randint(0, 10, (steps * 64,)))
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="gpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        deterministic=True,
    )
    trainer.fit(Module(), DataLoader(data, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0)))


def hf_trainer(steps: int) -> None:
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    class Sentences(torch.utils.data.Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, 1000, (steps * 16, 32), generator=g)
            self.labels = torch.randint(0, 2, (steps * 16,), generator=g)

        def __len__(self) -> int:
            return len(self.labels)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.labels[i]}

    class Reporting(Trainer):
        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            report(loss[0] if isinstance(loss, tuple) else loss)
            return loss

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=16,
            learning_rate=1e-4,
            save_strategy="no",
            report_to=[],
            seed=0,
            data_seed=0,
            full_determinism=True,
            disable_tqdm=True,
            logging_strategy="no",
        )
        # One GPU while both stay visible (the Trainer would wrap the model in DataParallel over
        # every GPU it sees): what the Trainer itself does for a model-parallel model.
        _ = args.device
        args._n_gpu = 1
        Reporting(model=model, args=args, train_dataset=Sentences()).train()


def accelerate(steps: int) -> None:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator()
    set_seed(0)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # Each process gets every num_processes-th batch: `steps` batches each.
    samples = steps * 64 * accelerator.num_processes
    data = TensorDataset(torch.randn(samples, 64), torch.randint(0, 10, (samples,)))
    loader = DataLoader(data, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        report(loss)


def timm_model(steps: int) -> None:
    import timm
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2

    torch.manual_seed(0)
    model = timm.create_model("resnet18", pretrained=False, num_classes=10).cuda()
    optimizer = create_optimizer_v2(model, opt="adamw", lr=1e-3, weight_decay=0.05)
    scheduler, _ = create_scheduler_v2(optimizer, sched="cosine", num_epochs=steps, warmup_epochs=2)
    data = torch.Generator(device="cuda").manual_seed(0)
    for step in range(steps):
        x = torch.randn(32, 3, 64, 64, device="cuda", generator=data)
        y = torch.randint(0, 10, (32,), device="cuda", generator=data)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step(step + 1)
        report(loss)


def torchvision_model(steps: int) -> None:
    import torchvision
    from torchvision.transforms import v2

    torch.manual_seed(0)
    transform = v2.Compose(
        [v2.RandomResizedCrop(64), v2.RandomHorizontalFlip(), v2.ToImage(), v2.ToDtype(torch.float32, scale=True)]
    )
    images = torchvision.datasets.FakeData(size=steps * 32, image_size=(3, 80, 80), num_classes=10, transform=transform)
    loader = torch.utils.data.DataLoader(
        images, batch_size=32, shuffle=True, num_workers=2, pin_memory=True, generator=torch.Generator().manual_seed(0)
    )
    model = torchvision.models.resnet18(weights=None, num_classes=10).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in loader:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        report(loss)


def fastai_learner(steps: int) -> None:
    from fastai.callback.core import Callback
    from fastai.callback.schedule import fit_one_cycle  # noqa: F401  (adds Learner.fit_one_cycle)
    from fastai.data.core import DataLoaders
    from fastai.learner import Learner
    from fastai.losses import CrossEntropyLossFlat
    from fastai.torch_core import set_seed
    from torch.utils.data import TensorDataset

    class ReportLoss(Callback):
        def after_batch(self) -> None:
            if self.training:
                report(self.learn.loss)

    set_seed(0, reproducible=True)  # python's, numpy's and torch's generators: fastai shuffles with them
    data = torch.Generator().manual_seed(0)
    count = steps * 64
    train = TensorDataset(torch.randn(count, 64, generator=data), torch.randint(0, 10, (count,), generator=data))
    valid = TensorDataset(torch.randn(256, 64, generator=data), torch.randint(0, 10, (256,), generator=data))
    dls = DataLoaders.from_dsets(train, valid, bs=64, device=torch.device("cuda"))
    learn = Learner(dls, mlp(), loss_func=CrossEntropyLossFlat(), cbs=[ReportLoss()])
    with learn.no_logging(), learn.no_bar():
        learn.fit_one_cycle(1, lr_max=1e-3)


def two_gpu_loop(model: torch.nn.Module, steps: int, first: str, last: str) -> None:
    """AdamW on data made on `first`; the loss is taken on `last`, where the output is."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator(device=first).manual_seed(0)
    for _ in range(steps):
        x = torch.randn(256, 64, device=first, generator=data)
        y = torch.randint(0, 10, (256,), device=first, generator=data)
        loss = torch.nn.functional.cross_entropy(model(x), y.to(last))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        report(loss)


def split_model(steps: int) -> None:
    """A model split over two GPUs: its activations cross from cuda:0 to cuda:1 and back."""

    class Split(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.front = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU()).to("cuda:0")
            self.back = torch.nn.Linear(512, 10).to("cuda:1")

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.back(self.front(x).to("cuda:1"))

    torch.manual_seed(0)
    two_gpu_loop(Split(), steps, "cuda:0", "cuda:1")


def data_parallel(steps: int) -> None:
    """torch.nn.DataParallel over cuda:0 and cuda:1: scatter, replicate and gather every step."""
    torch.manual_seed(0)
    model = torch.nn.DataParallel(mlp().to("cuda:0"), device_ids=[0, 1])
    two_gpu_loop(model, steps, "cuda:0", "cuda:0")


RUNS: dict[str, Callable[[int], None]] = {
    "lightning": lightning,
    "hf-trainer": hf_trainer,
    "accelerate": accelerate,
    "timm": timm_model,
    "torchvision": torchvision_model,
    "fastai": fastai_learner,
    "split": split_model,
    "data-parallel": data_parallel,
    "lightning-ddp": lambda steps: lightning(steps, devices=2, strategy="ddp"),
    "lightning-ddp-one-rank": lambda steps: lightning(steps, devices=1, strategy="ddp"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=FRAMEWORKS)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--pace", type=float, default=0.0)
    args = parser.parse_args()
    flexium.init()
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    if args.pace:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(lambda *_: time.sleep(args.pace))
    emit("ready", pid=os.getpid(), process_id=flexium.auto.get_process_id())
    RUNS[args.framework](args.steps)
    emit("done")
    flexium.shutdown()


if __name__ == "__main__":
    main()
