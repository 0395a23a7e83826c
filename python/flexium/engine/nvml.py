"""The host's view of its GPUs through NVML. NVML names physical GPUs by UUID and stays true
after a migration.

NVML calls made inside a process that is locked or checkpointed block until it runs again
(seen on driver 580: nvmlDeviceGetCount hung in the control thread of a paused job). While the
engine has the process frozen, queries therefore go to a reader process the engine starts with
the job (this file run by its path with --serve: NVML initialised once, a read per line of its
stdin), else to a short-lived child run by path, not as a package module (importing flexium was
most of its time). A resume's room check runs while the job is still checkpointed
(fact `nvml-reader-process` has the timings).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import select
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("flexium")

_lock = threading.Lock()
_state: dict[str, Any] = {"initialized": False, "error": None}
_frozen = threading.Event()


def is_frozen() -> bool:
    return _frozen.is_set()


def set_frozen(frozen: bool) -> None:
    """The engine says when this process is (about to be) locked, until it runs again."""
    if frozen:
        _frozen.set()
    else:
        _frozen.clear()


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int | None


@dataclass(frozen=True)
class HostGpu:
    """One GPU as NVML reads it. Its memory leaves out what the driver keeps for itself (NVML's v1
    figures count that reserve as used: 615 MiB of an idle H200), so that an idle GPU shows 0 used,
    as nvidia-smi shows it, and `total - used` is still what is free."""

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    memory_free: int
    utilization_percent: int | None
    temperature_c: int | None
    health: str  # "ok", "ecc_errors", or "unknown" where NVML cannot tell
    processes: tuple[GpuProcess, ...]

    def used_by(self, pid: int) -> int | None:
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


def unavailable_reason() -> str | None:
    _ensure_initialized()
    error: str | None = _state["error"]
    return error


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def driver_version() -> str | None:
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


def _reserved(pynvml: Any, handle: Any) -> int:
    """What the driver keeps of the GPU for itself (NVML's v2 memory info); 0 where NVML cannot say."""
    version = getattr(pynvml, "nvmlMemory_v2", None)
    info = None if version is None else _optional(pynvml.nvmlDeviceGetMemoryInfo, handle, version)
    return int(getattr(info, "reserved", 0) or 0)


def _read(pynvml: Any, index: int) -> HostGpu:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    reserved = min(_reserved(pynvml, handle), int(memory.used))
    utilization = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
    processes = _optional(pynvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
    return HostGpu(
        index=index,
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        memory_total=int(memory.total) - reserved,
        memory_used=int(memory.used) - reserved,
        memory_free=int(memory.free),
        utilization_percent=None if utilization is None else int(utilization.gpu),
        temperature_c=_optional(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU),
        health=_health(pynvml, handle),
        processes=tuple(
            GpuProcess(pid=int(p.pid), used_bytes=None if p.usedGpuMemory is None else int(p.usedGpuMemory))
            for p in processes
        ),
    )


def _read_here() -> list[HostGpu]:
    if not _ensure_initialized():
        return []
    pynvml = _pynvml()
    return [_read(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]


class _Reader:
    """The reader process: one JSON line of every GPU per line written to it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )

    def read(self, timeout: float) -> list[dict[str, Any]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the NVML reader gave no answer within {timeout:g} s")
        return list(json.loads(line))

    def stop(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


_reader_lock = threading.Lock()
_reader: _Reader | None = None


def start_reader() -> None:
    """Starts the reader process that answers while this process is frozen (engine start)."""
    global _reader
    with _reader_lock:
        if _reader is None and available():
            try:
                _reader = _Reader()
            except OSError as exc:
                log.warning("could not start the NVML reader process (%s); frozen reads start a child each", exc)


def stop_reader() -> None:
    global _reader
    with _reader_lock:
        reader, _reader = _reader, None
    if reader is not None:
        reader.stop()


def _let_go_after_fork() -> None:
    """A forked child (a DataLoader worker) closes its copies of the reader's pipes: the reader
    must see the job's end of them close when the job goes, and belongs to the job alone."""
    global _reader, _reader_lock
    _reader_lock = threading.Lock()  # another thread may have held it at the fork
    reader, _reader = _reader, None
    if reader is None:
        return
    # The pipes' fds are pointed at /dev/null rather than closed: the file objects may hold a
    # request buffered at the fork, and flush it when they go.
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for pipe in (reader.proc.stdin, reader.proc.stdout):
            if pipe is not None:
                os.dup2(null, pipe.fileno())
    finally:
        os.close(null)
    reader.proc.returncode = 0  # not this process's child: never waited for here


os.register_at_fork(after_in_child=_let_go_after_fork)


def _from_reader(timeout: float) -> list[dict[str, Any]] | None:
    global _reader
    with _reader_lock:
        if _reader is None:
            return None
        try:
            return _reader.read(timeout)
        except (OSError, ValueError, RuntimeError) as exc:
            log.warning("the NVML reader process failed (%s); a child process reads instead", exc)
            reader, _reader = _reader, None
    reader.proc.kill()
    reader.proc.wait()
    return None


@contextlib.contextmanager
def reader_pipes() -> Iterator[tuple[int, int] | None]:
    """The reader process's (stdin, stdout) fds for a native caller that asks it "free UUID" while
    this process is locked (csrc/room_check.h), held for it alone until the block ends; None when
    there is no reader."""
    with _reader_lock:
        reader = _reader
        if reader is None or reader.proc.stdin is None or reader.proc.stdout is None:
            yield None
            return
        yield reader.proc.stdin.fileno(), reader.proc.stdout.fileno()


def _free_line(request: str) -> str:
    """The reader's answer to "free UUID": the GPU's free bytes, or -1 where NVML cannot tell. One
    GPU's memory reading only: it runs inside a move's locked section."""
    parts = request.split()
    if len(parts) != 2 or not _ensure_initialized():
        return "-1"
    pynvml = _pynvml()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(parts[1])
        return str(int(pynvml.nvmlDeviceGetMemoryInfo(handle).free))
    except Exception:  # any NVML failure (an unknown GPU included): cannot tell
        return "-1"


def _read_in_child(timeout: float = 30.0) -> list[HostGpu]:
    raw = _from_reader(timeout)
    if raw is not None:
        return _parse(raw)
    try:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("NVML query in a child process failed: %s", exc)
        return []
    if proc.returncode != 0:
        log.warning("NVML query in a child process failed: %s", proc.stderr.strip()[-500:])
        return []
    return _parse(json.loads(proc.stdout))


def _parse(raw: list[dict[str, Any]]) -> list[HostGpu]:
    return [HostGpu(**{**gpu, "processes": tuple(GpuProcess(**p) for p in gpu["processes"])}) for gpu in raw]


def host_gpus() -> list[HostGpu]:
    """Every GPU of this host (CUDA_VISIBLE_DEVICES does not apply to NVML), or [] without NVML."""
    return _read_in_child() if _frozen.is_set() else _read_here()


def gpu_by_uuid(uuid: str) -> HostGpu | None:
    for gpu in host_gpus():
        if gpu.uuid.lower() == uuid.lower():
            return gpu
    return None


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        for request in sys.stdin:  # until the job closes the pipe
            if request.startswith("free "):
                print(_free_line(request), flush=True)
            else:
                print(json.dumps([asdict(gpu) for gpu in _read_here()]), flush=True)
    else:
        print(json.dumps([asdict(gpu) for gpu in _read_here()]))
