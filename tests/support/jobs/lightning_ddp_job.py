"""A PyTorch Lightning job with ``strategy="ddp"`` over two CPU processes (gloo), on the fake
driver, for the end-to-end tests. Rank 0 is the process the test starts; Lightning starts rank 1
itself by running this script again (with LOCAL_RANK=1), so the ranks' parents differ, unlike
torchrun's. Each rank calls ``flexium.init()`` and holds memory on its own GPU, cuda:LOCAL_RANK.

Trains until ``E2E_STEPS`` steps, or until the file ``E2E_STOP`` appears (the ranks agree on the
step with an all-reduce of a flag, which leaves the model alone); then each rank prints one JSON
line: its rank, its loss trace and its physical device.
"""

import json
import os
import time
from pathlib import Path

import torch
from job_output import say


def main() -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if os.environ.get("FLEXIUM_LIBCUDA"):
        from support.fake_driver import FakeDriver

        FakeDriver(Path(os.environ["FLEXIUM_LIBCUDA"])).set_process_memory(local_rank, 256 << 20)

    import flexium

    flexium.init()
    import lightning as L
    import torch.distributed as dist

    torch.set_num_threads(1)
    steps = int(os.environ.get("E2E_STEPS", "0"))
    stop = os.environ.get("E2E_STOP")

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(16, 16)
            self.losses: list[str] = []

        def on_train_start(self) -> None:
            say(f"ready {self.global_rank} {flexium.auto.get_process_id()}")

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            loss = self.net(batch[0]).square().mean()
            self.losses.append(float(loss.item()).hex())
            time.sleep(0.01)
            return loss

        def on_train_batch_end(self, outputs: object, batch: object, index: int) -> None:
            if stop:
                flag = torch.tensor([1.0 if os.path.exists(stop) else 0.0])
                dist.all_reduce(flag)
                if flag.item() > 0:
                    self.trainer.should_stop = True

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    L.seed_everything(0, verbose=False)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 16, generator=torch.Generator().manual_seed(10)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model = Net()
    trainer = L.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=2,
        max_steps=steps or -1,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    say(json.dumps({"rank": trainer.global_rank, "losses": model.losses, "device": flexium.auto.get_physical_device()}))


if __name__ == "__main__":
    main()
