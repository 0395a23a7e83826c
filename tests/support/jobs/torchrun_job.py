"""One rank of the end-to-end tests' torchrun job: CPU torch, gloo, ``flexium.init()`` before
the process group, on the fake driver (each rank holds memory on its own GPU, cuda:LOCAL_RANK).

Trains until ``E2E_STEPS`` steps, or until the file ``E2E_STOP`` appears (the ranks agree on the
step with an all-reduce of a flag, which leaves the model alone); then prints one JSON line:
its rank, its loss trace and its physical device.
"""

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from job_output import say


def main() -> None:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if os.environ.get("FLEXIUM_LIBCUDA"):
        from support.fake_driver import FakeDriver

        FakeDriver(Path(os.environ["FLEXIUM_LIBCUDA"])).set_process_memory(local_rank, 256 << 20)

    import flexium

    flexium.init()
    dist.init_process_group("gloo")
    say(f"ready {rank} {flexium.auto.get_process_id()}")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(10 + rank)
    steps = int(os.environ.get("E2E_STEPS", "0"))
    stop = os.environ.get("E2E_STOP")
    losses: list[str] = []
    while True:
        loss = model(torch.randn(8, 16, generator=data)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        losses.append(float(loss.item()).hex())
        if steps and len(losses) >= steps:
            break
        if stop:
            flag = torch.tensor([1.0 if os.path.exists(stop) else 0.0])
            dist.all_reduce(flag)
            if flag.item() > 0:
                break
        time.sleep(0.01)
    line = {"rank": rank, "losses": losses, "device": flexium.auto.get_physical_device()}
    say(json.dumps(line))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
