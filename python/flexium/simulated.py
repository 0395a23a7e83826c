"""A simulated host for trying flexium where there is no NVIDIA GPU: `flexium demo` runs its
training job on it, so that a newcomer can migrate, pause and resume from the dashboard and the
CLI and see what happens.

It is flexium's own test double of the NVIDIA driver (libcuda and NVML in one library, built with
the package from ``csrc/simulated/driver.c``; the tests drive it as ``tests/support/fake_driver.py``),
loaded by the job's process alone through ``FLEXIUM_LIBCUDA`` / ``FLEXIUM_LIBNVML``. It models
the driver's checkpoint state machine and GPU memory; the job itself computes on the CPU.
Nothing that happens there ran on a GPU, so every GPU it shows is named ``SIMULATED_MODEL``, its
driver ``SIMULATED_DRIVER``, and every move it makes takes the driver path with simulated timings.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

LIBRARY_NAME = "libflexium_simulated_driver.so"
SIMULATED_MODEL = "SIMULATED GPU (flexium demo)"
# What its NVML calls the driver: a real version (580: migration) that says it is none.
SIMULATED_DRIVER = "580.159.04 (simulated)"
GPUS = 2
GPU_MIB = 80 * 1024
# What the demo job holds on its simulated GPU, so that a move shows memory leaving one GPU.
JOB_BYTES = 6 << 30


def library_path() -> Path | None:
    """The simulated driver built with this package, or None (a build without it)."""
    path = Path(__file__).resolve().with_name(LIBRARY_NAME)
    return path if path.exists() else None


def environment(library: Path) -> dict[str, str]:
    """What a job's environment needs to run on the simulated host (two GPUs of one model)."""
    return {
        "FLEXIUM_LIBCUDA": str(library),
        "FLEXIUM_LIBNVML": str(library),
        "FAKE_CUDA_GPUS": str(GPUS),
        "FAKE_CUDA_MODELS": SIMULATED_MODEL,
        "FAKE_NVML_DRIVER": SIMULATED_DRIVER,
        "FAKE_CUDA_TOTAL_MIB": str(GPU_MIB),
    }


def active() -> bool:
    """Whether this process runs on the simulated driver."""
    library = library_path()
    return library is not None and os.environ.get("FLEXIUM_LIBCUDA") == str(library)


def hold_job_memory(nbytes: int = JOB_BYTES) -> None:
    """The simulated GPU memory this process holds on its device (it moves with the job)."""
    library = library_path()
    if library is None or not active():
        raise RuntimeError("this process does not run on flexium's simulated driver")
    code = ctypes.CDLL(str(library)).fake_set_process_memory(0, ctypes.c_uint64(nbytes))
    if code != 0:
        raise RuntimeError(f"the simulated driver refused to hold {nbytes} bytes (code {code})")
