"""What this machine allows: pause/resume needs the driver's checkpoint API (the cuCheckpointProcess*
functions, CUDA 12.8: driver 570+), migration needs GPU remapping on restore (CUDA 13.0: driver
580+); the thresholds are protocol's, which the server's refusals share."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from flexium.engine import nvml
from flexium.errors import CapabilityError
from flexium.protocol import DRIVER_NEEDS, MIGRATION_MIN_DRIVER, PAUSE_RESUME_MIN_DRIVER

# Where NVML is missing, the CUDA version the driver reports bounds its branch from below.
_MIN_DRIVER_FOR_CUDA = ((13000, 580), (12090, 575), (12080, 570), (12060, 560), (12040, 550), (12000, 525))


@dataclass(frozen=True)
class Capabilities:
    driver_version: str | None  # NVIDIA driver, e.g. "580.159.04"
    driver_major: int | None
    cuda_version: int  # cuDriverGetVersion, e.g. 13000; 0 without a driver
    checkpoint_api: bool
    torch_cuda: bool
    gpu_count: int
    pause_resume: bool
    migration: bool
    problems: tuple[str, ...]  # each: what is missing and what to do

    def require(self, available: bool, feature: str) -> None:
        """Refuses `feature` when this machine lacks it (`available`: the flag that says so), with
        what is missing."""
        if not available:
            why = "; ".join(self.problems) or "the driver does not support it"
            raise CapabilityError(f"{feature} is not available on this machine: {why}")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["problems"] = list(self.problems)
        return data


def cuda_text(version: int) -> str:
    """13000 -> "13.0", as cuDriverGetVersion numbers CUDA releases."""
    return f"{version // 1000}.{version % 1000 // 10}"


def _driver_major(version: str | None, cuda_version: int) -> int | None:
    if version:
        try:
            return int(version.split(".")[0])
        except ValueError:
            pass
    for cuda, driver in _MIN_DRIVER_FOR_CUDA:
        if cuda_version >= cuda:
            return driver
    return None


def _torch_cuda() -> tuple[bool, str | None]:
    try:
        import torch
    except ImportError:
        return False, "PyTorch is not installed: install a CUDA build of torch (pip install torch)"
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda} but no usable GPU"
        return False, f"torch {torch.__version__} is {build}: training runs, migration and pause are off"
    return True, None


def detect(*, check_torch: bool = True) -> Capabilities:
    from flexium import _C

    status = _C.driver_status()
    problems: list[str] = []
    cuda_version = status.cuda_version
    gpu_count = 0
    if not status.loaded:
        problems.append(f"{status.error}; install the NVIDIA driver ({DRIVER_NEEDS})")
    elif status.init_error:
        problems.append(f"the NVIDIA driver failed to initialise ({status.init_error}); check nvidia-smi")
    else:
        gpu_count = len(_C.list_devices())

    driver_version = nvml.driver_version()
    major = _driver_major(driver_version, cuda_version) if status.loaded else None
    checkpoint_api = status.checkpoint_api
    torch_cuda, torch_problem = _torch_cuda() if check_torch else (False, None)
    if torch_problem:
        problems.append(torch_problem)

    driver_ok = status.loaded and not status.init_error
    pause_resume = bool(driver_ok and checkpoint_api and major is not None and major >= PAUSE_RESUME_MIN_DRIVER)
    # GPU pairs on restore arrived with CUDA 13.0 (driver 580): both must say so.
    migration = bool(pause_resume and major is not None and major >= MIGRATION_MIN_DRIVER and cuda_version >= 13000)
    if driver_ok and major is not None:
        shown = driver_version or f"{major}+ (CUDA {cuda_text(cuda_version)})"
        if major < PAUSE_RESUME_MIN_DRIVER:
            problems.append(f"NVIDIA driver {shown} is too old: it needs {DRIVER_NEEDS}; upgrade the driver")
        elif not checkpoint_api:
            problems.append(
                f"NVIDIA driver {shown} lacks the checkpoint API (cuCheckpointProcess*, "
                f"CUDA {cuda_text(_C.CHECKPOINT_API_VERSION)}); upgrade to {MIGRATION_MIN_DRIVER}+"
            )
        elif major < MIGRATION_MIN_DRIVER:
            problems.append(
                f"NVIDIA driver {shown}: pause/resume only; migration to another GPU needs {MIGRATION_MIN_DRIVER}+"
            )
        elif cuda_version < 13000:
            problems.append(
                f"libcuda reports CUDA {cuda_text(cuda_version)} although NVML says driver "
                f"{shown}: GPU remapping on restore needs CUDA 13.0; fix the driver install (mixed versions?)"
            )
    return Capabilities(
        driver_version=driver_version,
        driver_major=major,
        cuda_version=cuda_version,
        checkpoint_api=checkpoint_api,
        torch_cuda=torch_cuda,
        gpu_count=gpu_count,
        pause_resume=pause_resume,
        migration=migration,
        problems=tuple(problems),
    )
