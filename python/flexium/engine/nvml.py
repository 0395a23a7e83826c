"""The host's view of its GPUs through NVML. NVML names physical GPUs by UUID and, unlike the
CUDA driver inside a migrated process (DESIGN.md fact 5), stays true after a migration."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

log = logging.getLogger("flexium")

_lock = threading.Lock()
_state: dict[str, Any] = {"initialized": False, "error": None}


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: Optional[int]


@dataclass(frozen=True)
class HostGpu:
    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    memory_free: int
    utilization_percent: Optional[int]
    temperature_c: Optional[int]
    health: str  # "ok", "ecc_errors", or "unknown" where NVML cannot tell
    processes: tuple[GpuProcess, ...]

    def used_by(self, pid: int) -> Optional[int]:
        for process in self.processes:
            if process.pid == pid:
                return process.used_bytes
        return None


def _pynvml() -> Any:
    import pynvml  # nvidia-ml-py; a dependency, imported late so a bad install fails only here

    return pynvml


def _ensure_initialized() -> bool:
    with _lock:
        if _state["initialized"]:
            return True
        if _state["error"] is not None:
            return False
        try:
            pynvml = _pynvml()
            override = os.environ.get("FLEXIUM_LIBNVML")
            if override and pynvml.nvmlLib is None:
                # The tests' fake driver also serves NVML; pynvml loads nothing when nvmlLib is set.
                pynvml.nvmlLib = ctypes.CDLL(override)
            pynvml.nvmlInit()
            _state["initialized"] = True
            return True
        except Exception as exc:  # NVMLError, ImportError, OSError: all mean "no NVML here"
            _state["error"] = f"NVML unavailable: {exc}"
            log.debug(_state["error"])
            return False


def available() -> bool:
    return _ensure_initialized()


def unavailable_reason() -> Optional[str]:
    _ensure_initialized()
    return _state["error"]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def driver_version() -> Optional[str]:
    """The NVIDIA driver version, e.g. "580.159.04", or None without NVML."""
    if not _ensure_initialized():
        return None
    return _text(_pynvml().nvmlSystemGetDriverVersion())


def _optional(call: Any, *args: Any) -> Any:
    try:
        return call(*args)
    except Exception:  # a counter this GPU or driver does not support
        return None


def _health(pynvml: Any, handle: Any) -> str:
    errors = _optional(
        pynvml.nvmlDeviceGetTotalEccErrors,
        handle,
        pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        pynvml.NVML_VOLATILE_ECC,
    )
    if errors is None:
        return "ok" if _optional(pynvml.nvmlDeviceGetEccMode, handle) is None else "unknown"
    return "ecc_errors" if errors > 0 else "ok"


def _read(pynvml: Any, index: int) -> HostGpu:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    utilization = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
    processes = _optional(pynvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
    return HostGpu(
        index=index,
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_total=int(memory.total),
        memory_used=int(memory.used),
        memory_free=int(memory.free),
        utilization_percent=None if utilization is None else int(utilization.gpu),
        temperature_c=_optional(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU),
        health=_health(pynvml, handle),
        processes=tuple(
            GpuProcess(pid=int(p.pid), used_bytes=None if p.usedGpuMemory is None else int(p.usedGpuMemory))
            for p in processes
        ),
    )


def host_gpus() -> list[HostGpu]:
    """Every GPU of this host (CUDA_VISIBLE_DEVICES does not apply to NVML), or [] without NVML."""
    if not _ensure_initialized():
        return []
    pynvml = _pynvml()
    return [_read(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]


def gpu_by_uuid(uuid: str) -> Optional[HostGpu]:
    if not _ensure_initialized():
        return None
    pynvml = _pynvml()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid.encode() if isinstance(uuid, str) else uuid)
        return _read(pynvml, int(pynvml.nvmlDeviceGetIndex(handle)))
    except pynvml.NVMLError:
        return None
