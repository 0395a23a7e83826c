"""What an NVML read costs the engine while its process is frozen (a resume's room check runs
then), the three ways side by side (flexium/engine/nvml.py):

    python bench/nvml_read.py [--repeats 5]

  child -m      a child process running `python -m flexium.engine.nvml` (before this change)
  child path    a child process running nvml.py by its path (the fallback now)
  reader        the reader process the engine starts with the job (nvml.py --serve)

Runs anywhere; without NVML the reads return no GPUs and measure the processes alone (it says
so). Prints the median and worst of --repeats reads each, and the ratios to "child -m".
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tables.py beside this file

from flexium.engine import nvml  # noqa: E402
from tables import print_table  # noqa: E402


def timed(read: Callable[[], int], repeats: int) -> tuple[list[float], int]:
    seconds = []
    gpus = 0
    for _ in range(repeats):
        started = time.perf_counter()
        gpus = read()
        seconds.append(time.perf_counter() - started)
    return seconds, gpus


def child_module() -> int:
    out = subprocess.run([sys.executable, "-m", "flexium.engine.nvml"], capture_output=True, text=True, check=True)
    return len(json.loads(out.stdout))


def child_path() -> int:
    nvml.stop_reader()  # no reader: the fallback runs
    return len(nvml._read_in_child())


def reader() -> int:
    return len(nvml._read_in_child())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    results = {"child -m": timed(child_module, args.repeats), "child path": timed(child_path, args.repeats)}
    nvml.start_reader()
    if nvml._reader is None:
        print(f"no reader process: NVML is unavailable here ({nvml.unavailable_reason()})")
    else:
        reader()  # the first read waits for the reader to start
        results["reader"] = timed(reader, args.repeats)
        nvml.stop_reader()

    base = statistics.median(results["child -m"][0])
    rows = [
        (
            name,
            f"{statistics.median(s) * 1e3:.2f}",
            f"{max(s) * 1e3:.2f}",
            f"{statistics.median(s) / base:.4f}",
            str(gpus),
        )
        for name, (s, gpus) in results.items()
    ]
    print_table(("way", "median ms", "worst ms", "vs child -m", "GPUs read"), rows)
    if all(gpus == 0 for _s, gpus in results.values()):
        print("(no GPU read: NVML is unavailable here, so this is the cost of the processes alone)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
