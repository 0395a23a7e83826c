"""The training process of the end-to-end tests: CPU torch, ``flexium.init()``, small optimizer
steps, until SIGTERM or SIGINT (a normal exit: flexium unregisters at exit).

Prints ``init <seconds>`` once flexium.init() has returned and ``step <n> <physical device>``
every ``E2E_PRINT_EVERY`` steps. On the fake driver (FLEXIUM_LIBCUDA set) it holds
``E2E_JOB_MEMORY_MIB`` on its GPU, as a CUDA job would (and ``E2E_JOB_SECOND_GPU_MIB`` on cuda:1:
a process on two GPUs). A file named by ``E2E_CONTROL``, when it appears, is read between steps:
each line ``fail FUNCTION CODE`` arms the fake driver's failure injection in this process (its
only instance of the fake), then the file is removed.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
from job_output import say


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    fake = None
    if os.environ.get("FLEXIUM_LIBCUDA"):
        from support.fake_driver import FakeDriver

        fake = FakeDriver(Path(os.environ["FLEXIUM_LIBCUDA"]))
        fake.set_process_memory(0, int(os.environ.get("E2E_JOB_MEMORY_MIB", "1024")) << 20)
        if os.environ.get("E2E_JOB_SECOND_GPU_MIB"):  # a process on two GPUs (DataParallel, a split model)
            fake.set_process_memory(1, int(os.environ["E2E_JOB_SECOND_GPU_MIB"]) << 20)

    import flexium

    started = time.perf_counter()
    flexium.init()
    say(f"init {time.perf_counter() - started:.3f} {flexium.auto.get_process_id()}")

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    control = Path(os.environ["E2E_CONTROL"]) if os.environ.get("E2E_CONTROL") else None
    every = int(os.environ.get("E2E_PRINT_EVERY", "10"))
    step = 0
    try:
        while True:
            loss = model(torch.randn(8, 32)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % every == 0:
                say(f"step {step} {flexium.auto.get_physical_device()}")
            if control is not None and control.exists() and fake is not None:
                for line in control.read_text().splitlines():
                    word, function, code = line.split()
                    if word == "fail":
                        fake.fail(function, code)
                control.unlink()
                say("control done")
            time.sleep(0.02)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
