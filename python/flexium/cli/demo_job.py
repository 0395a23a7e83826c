"""The training job `flexium demo` starts: a small classifier on synthetic data, plain PyTorch
after `flexium.init()`. On a GPU it is movable from the dashboard; on the simulated host
(flexium.simulated, where there is no GPU) it computes on the CPU while flexium moves it between
simulated GPUs holding simulated memory.

    python -m flexium.cli.demo_job [--steps N] [--step-seconds S] [--print-every K]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

# loss.item() waits for the GPU: a few reports a second are plenty for a chart.
REPORT_EVERY = 5


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexium.cli.demo_job")
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (default: never)")
    parser.add_argument("--step-seconds", type=float, default=0.1, help="pause between steps, to stay light")
    parser.add_argument("--print-every", type=int, default=50)
    args = parser.parse_args(argv)
    from flexium.torch_import import import_torch

    torch = import_torch()
    if torch is None:
        print(
            "flexium demo: the demo training job needs PyTorch: pip install torch (a CPU build is enough)",
            file=sys.stderr,
        )
        return 2

    import flexium
    from flexium import simulated

    flexium.init()
    device = flexium.auto.get_device()
    where = ""
    if simulated.active():
        simulated.hold_job_memory(device)
        where = " (simulated)"
    if where or not (device.startswith("cuda") and torch.cuda.is_available()):  # simulated GPUs compute nothing
        device = "cpu"
        torch.set_num_threads(1)
    torch.manual_seed(0)
    features = torch.randn(4096, 64)
    labels = (features[:, :8].sum(dim=1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 2)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = 0
    try:
        while args.steps <= 0 or step < args.steps:
            index = torch.randint(0, features.shape[0], (128,))
            x, y = features[index].to(device), labels[index].to(device)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            torch.autograd.backward(loss)
            optimizer.step()
            step += 1
            if step % REPORT_EVERY == 0 or step == 1:
                flexium.auto.report(loss=loss.item())  # the job page's loss curve
            if step % args.print_every == 0 or step == 1:
                on = flexium.auto.get_physical_device() + where
                print(f"[demo job] step {step:6d}  loss {loss.item():.4f}  on {on}", flush=True)
            time.sleep(args.step_seconds)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # stopped before the training loop began
        sys.exit(0)
