"""A simulated host for trying flexium where there is no NVIDIA GPU: `flexium demo` runs its
training job on it, so that a newcomer can migrate, pause and resume from the dashboard and the
CLI and see what happens.

It is flexium's own test double of the NVIDIA driver (libcuda and NVML in one library, built with
the package from ``csrc/simulated/driver.c``; the tests drive it as ``tests/support/fake_driver.py``),
loaded by the job's process alone through ``FLEXIUM_LIBCUDA`` / ``FLEXIUM_LIBNVML``. It models
the driver's checkpoint state machine and GPU memory; the job itself computes on the CPU.
Nothing that happens there ran on a GPU, so every GPU it shows is named ``SIMULATED_MODEL``, its
driver ``SIMULATED_DRIVER``, and every move it makes takes the driver path with simulated timings.

Several simulated hosts on one machine (``HOST_ENV``, ``host_name``): a job on the simulated driver
reports the host it is told to, and the driver gives each simulated host GPUs of their own (UUIDs
drawn from the host's name), so that a server sees a fleet where there is one machine. Never on a
real driver: a real GPU is on the host it is on.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

from flexium import protocol

LIBRARY_NAME = "libflexium_simulated_driver.so"
SIMULATED_MODEL = "SIMULATED GPU (flexium demo)"
# What its NVML calls the driver: a real version (580: migration) that says it is none.
SIMULATED_DRIVER = "580.159.04 (simulated)"
GPUS = 2
GPU_MIB = 80 * 1024
# What the demo job holds on its simulated GPU, so that a move shows memory leaving one GPU.
JOB_BYTES = 6 << 30
# The simulated host a job on the simulated driver reports (and whose GPUs the driver shows).
HOST_ENV = "FLEXIUM_SIMULATED_HOST"
# A function only flexium's simulated driver exports: how a library is known to be it.
_SIMULATED_SYMBOL = "fake_set_process_memory"

log = logging.getLogger("flexium")


def library_path() -> Path | None:
    """The simulated driver built with this package, or None (a build without it)."""
    path = Path(__file__).resolve().with_name(LIBRARY_NAME)
    return path if path.exists() else None


def environment(library: Path, host_dir: Path) -> dict[str, str]:
    """What a job's environment needs to run on the simulated host (two GPUs of one model).
    ``host_dir``: where the host's processes say what GPU memory they hold, so that each sees the
    others' as a real host's NVML shows it (the demo job's memory, to a job started beside it)."""
    return {
        "FLEXIUM_LIBCUDA": str(library),
        "FLEXIUM_LIBNVML": str(library),
        "FAKE_CUDA_GPUS": str(GPUS),
        "FAKE_CUDA_MODELS": SIMULATED_MODEL,
        "FAKE_NVML_DRIVER": SIMULATED_DRIVER,
        "FAKE_CUDA_TOTAL_MIB": str(GPU_MIB),
        "FAKE_CUDA_HOST_DIR": str(host_dir),
    }


def active() -> bool:
    """Whether this process runs on the simulated driver."""
    library = library_path()
    return library is not None and os.environ.get("FLEXIUM_LIBCUDA") == str(library)


def drivers_simulated() -> bool:
    """Whether both drivers this process loads (``FLEXIUM_LIBCUDA`` and ``FLEXIUM_LIBNVML``) are a
    build of flexium's simulated driver (the package's, or the tests' ``libfake_cuda.so``)."""
    paths = [os.environ.get("FLEXIUM_LIBCUDA"), os.environ.get("FLEXIUM_LIBNVML")]
    return all(path and _is_simulated(path) for path in paths)


def _is_simulated(path: str) -> bool:
    try:
        return hasattr(ctypes.CDLL(path), _SIMULATED_SYMBOL)
    except OSError:
        return False


def host_name() -> str | None:
    """The simulated host this process reports (``FLEXIUM_SIMULATED_HOST``), None when unset. A
    real driver's process reports its own host whatever the setting says: the setting is ignored
    with a warning, as a GPU cannot be moved to another host by naming one."""
    name = os.environ.get(HOST_ENV, "").strip()
    if not name:
        return None
    if not drivers_simulated():
        log.warning(
            "%s=%s is ignored: it names a simulated host, and this process does not run on flexium's simulated "
            "driver (FLEXIUM_LIBCUDA and FLEXIUM_LIBNVML naming %s); it reports its own host",
            HOST_ENV,
            name,
            LIBRARY_NAME,
        )
        return None
    return name


def hold_job_memory(device: str = "cuda:0", nbytes: int = JOB_BYTES) -> None:
    """Hold ``nbytes`` of simulated GPU memory on ``device`` (the job's ``cuda:N``, as
    ``flexium.auto.get_device()`` gives it), as a job's tensors would: it moves with the job, and every
    process of the simulated host sees it (`flexium devices`, a job placed beside it). The demo job calls
    it; a job of yours on the simulated host may too, to take room on its GPU."""
    library = library_path()
    if library is None or not active():
        raise RuntimeError("this process does not run on flexium's simulated driver")
    try:
        ordinal = protocol.read_target(device).ordinal
    except ValueError:
        ordinal = None
    if ordinal is None:
        raise ValueError(f"hold_job_memory: {device!r} is not a GPU of this process; pass its cuda:N")
    code = ctypes.CDLL(str(library)).fake_set_process_memory(ordinal, ctypes.c_uint64(nbytes))
    if code != 0:
        raise RuntimeError(
            f"the simulated driver refused to hold {nbytes} bytes on {device} (code {code}): the simulated "
            f"host shows {GPUS} GPUs, cuda:0 to cuda:{GPUS - 1}"
        )
