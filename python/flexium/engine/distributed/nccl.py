"""The NCCL communicators of this process and how to suspend and resume them.

NCCL shares its buffers between the ranks of a job as CUDA IPC memory, which the 580 driver's
checkpoint cannot restore (fact `nccl-buffers-not-restorable`). ``ncclCommSuspend(comm, NCCL_SUSPEND_MEM)``
unmaps the peers' buffers and releases NCCL's own, keeping the communicator; after the
checkpoint and restore, ``ncclCommResume`` re-creates them and exchanges the handles again
(fact `nccl-suspend-makes-movable`). Both are collective: every rank of a communicator calls them together. They exist
from NCCL 2.29.7; torch 2.12 and later expose them as ``backend.suspend()`` / ``resume()``.

NVLS (NVLink SHARP) buffers are not released by a suspend, so a job that may move runs with
``NCCL_NVLS_ENABLE=0``; and with ``NCCL_CUMEM_HOST_ENABLE=0``: NCCL otherwise makes the host
memory it shares between ranks (its shared-memory transport, on GPUs without peer access; also
its P2P copy-engine and network proxy buffers) as cuMem allocations on the host, and the
driver's restore of a process holding one fails, and the process never runs CUDA again
(fact `cumem-host-memory-unrestorable`).
``flexium.init()`` sets both when the job has not started NCCL yet.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("flexium")

SUSPEND_FIRST_VERSION = 22907  # NCCL 2.29.7, as ncclGetVersion encodes it
NCCL_SUSPEND_MEM = 0x01
NCCL_STAT_GPU_MEM_SUSPENDED = 1  # ncclCommMemStat_t
NVLS_ENV = "NCCL_NVLS_ENABLE"
CUMEM_HOST_ENV = "NCCL_CUMEM_HOST_ENABLE"
# Torch registers its allocator's memory with NCCL on this hook: registered buffers are not
# released by a suspend either.
REGISTER_HOOK_ENV = "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"


class NcclError(RuntimeError):
    pass


def version_text(code: int) -> str:
    """ncclGetVersion's 22907 -> '2.29.7' (NCCL >= 2.9 encodes major*10000 + minor*100 + patch)."""
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


@dataclass(frozen=True)
class NcclLibrary:
    path: str
    version: int
    can_suspend: bool
    handle: Any  # the ctypes.CDLL of the library this process has loaded

    @property
    def version_name(self) -> str:
        return version_text(self.version)

    def call(self, name: str, *args: Any) -> None:
        code = int(getattr(self.handle, name)(*args))
        if code != 0:
            describe = self.handle.ncclGetErrorString
            describe.restype = ctypes.c_char_p
            text = (describe(code) or b"").decode(errors="replace")
            raise NcclError(f"{name} failed: {text or 'error'} (ncclResult_t {code})")


_library: NcclLibrary | None = None


def loaded_library() -> NcclLibrary | None:
    """The libnccl this process's communicators run on, or None. A job may have two mapped:
    torch loads its own wheel's by path, and an LD_PRELOADed newer one comes first in the
    global scope, where torch's calls resolve."""
    global _library
    if _library is not None:
        return _library
    path = _global_symbol_path("ncclGetVersion") or _mapped_path("libnccl")
    if path is None:
        return None
    try:
        handle = ctypes.CDLL(path)  # already loaded: the same instance torch calls
        version = ctypes.c_int(0)
        if handle.ncclGetVersion(ctypes.byref(version)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    can_suspend = all(hasattr(handle, name) for name in ("ncclCommSuspend", "ncclCommResume", "ncclCommMemStats"))
    _library = NcclLibrary(path=path, version=version.value, can_suspend=can_suspend, handle=handle)
    return _library


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _global_symbol_path(symbol: str) -> str | None:
    """The file that defines `symbol` first in the process's global scope (dlsym(RTLD_DEFAULT)),
    or None when no object loaded globally defines it."""
    try:
        scope = ctypes.CDLL(None)
        address = ctypes.cast(getattr(scope, symbol), ctypes.c_void_p)
        info = _DlInfo()
        if not scope.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
            return None
        name: bytes = info.dli_fname
        return os.path.realpath(name.decode(errors="replace"))
    except (OSError, AttributeError):
        return None


def _mapped_path(name: str) -> str | None:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith(name):
                    return fields[5].strip()
    except OSError:
        pass
    return None


def suspend_problem(environ: Mapping[str, str] | None = None) -> str | None:
    """Why this process's NCCL communicators cannot be suspended, with what to do; None: they
    can. `environ`: the job's environment (default: this process's)."""
    env = os.environ if environ is None else environ
    torch = sys.modules.get("torch")
    if torch is not None and _torch_can_suspend(torch):
        library_ok = True
    else:
        library = loaded_library()
        if library is None:
            return (
                "the job uses NCCL but no libnccl is loaded in this process; flexium cannot reach its "
                "communicators to suspend them"
            )
        library_ok = library.can_suspend
        if not library_ok:
            return (
                f"this job's NCCL is {library.version_name} ({library.path}), which cannot suspend its "
                f"communicators (ncclCommSuspend needs NCCL {version_text(SUSPEND_FIRST_VERSION)} or newer): "
                "install torch 2.12 or newer, or a newer NCCL (the nvidia-nccl wheel of your CUDA, or "
                "LD_PRELOAD a libnccl.so.2 of 2.29.7 or newer) and start the job again"
            )
    if env.get(NVLS_ENV) != "0":
        return (
            f"{NVLS_ENV} is not 0 in this job: NVLink SHARP buffers cannot be suspended; start the job with "
            f"{NVLS_ENV}=0 (flexium.init() sets it when it runs before init_process_group)"
        )
    if env.get(CUMEM_HOST_ENV) != "0":
        return (
            f"{CUMEM_HOST_ENV} is not 0 in this job: NCCL would make the host memory its ranks share as cuMem "
            "host memory, which the driver cannot restore (the restore fails and the process never runs CUDA "
            "again); start the job "
            f"with {CUMEM_HOST_ENV}=0 (flexium.init() sets it when it runs before init_process_group)"
        )
    if env.get(REGISTER_HOOK_ENV, "0") not in ("0", ""):
        return (
            f"{REGISTER_HOOK_ENV} is on: NCCL user-buffer registrations cannot be suspended; start the job without it"
        )
    return None


def movable_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """What a movable job's NCCL needs set before the job starts it, of what `environ` leaves
    unset: a setting the user made is left alone (suspend_problem() then says why the job
    cannot move)."""
    return {name: "0" for name in (NVLS_ENV, CUMEM_HOST_ENV) if name not in environ}


def prepare_environment() -> list[str]:
    """Sets movable_settings() in this process; returns what it set, as NAME=VALUE."""
    settings = movable_settings(os.environ)
    os.environ.update(settings)
    return [f"{name}={value}" for name, value in settings.items()]


def _torch_can_suspend(torch: Any) -> bool:
    nccl_group = getattr(getattr(torch, "distributed", None), "ProcessGroupNCCL", None)
    return nccl_group is not None and hasattr(nccl_group, "suspend") and hasattr(nccl_group, "resume")


class Communicator(Protocol):
    name: str

    def suspend(self) -> None: ...

    def resume(self) -> None: ...

    def is_suspended(self) -> bool: ...


class RawCommunicator:
    """An ncclComm_t reached through torch's ``_comm_ptr()`` (torch up to 2.11)."""

    def __init__(self, library: NcclLibrary, pointer: int, name: str) -> None:
        self.library = library
        self.pointer = ctypes.c_void_p(pointer)
        self.name = name

    def suspend(self) -> None:
        self.library.call("ncclCommSuspend", self.pointer, NCCL_SUSPEND_MEM)

    def resume(self) -> None:
        self.library.call("ncclCommResume", self.pointer)

    def is_suspended(self) -> bool:
        value = ctypes.c_uint64(0)
        self.library.call("ncclCommMemStats", self.pointer, NCCL_STAT_GPU_MEM_SUSPENDED, ctypes.byref(value))
        return value.value != 0


class TorchCommunicator:
    """A ProcessGroupNCCL of torch 2.12 or newer, which suspends its communicators itself."""

    def __init__(self, backend: Any, name: str) -> None:
        self.backend = backend
        self.name = name
        self._suspended = False

    def suspend(self) -> None:
        self.backend.suspend()
        self._suspended = True

    def resume(self) -> None:
        self.backend.resume()
        self._suspended = False

    def is_suspended(self) -> bool:
        return self._suspended


def communicators() -> list[Communicator]:
    """Every NCCL communicator this process's process groups hold now: the default group's and
    every new_group's (torch creates a group's communicator at its first collective; one never
    used has none). Call on the training thread while the process runs (it asks torch for the
    current device)."""
    torch: Any = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return []
    nccl_group = getattr(dist, "ProcessGroupNCCL", None)
    if nccl_group is None:
        return []  # torch without NCCL (a CPU build)
    from torch.distributed import distributed_c10d as c10d

    found: list[Communicator] = []
    groups = list(c10d._world.pg_map.keys())
    for index, group in enumerate(groups):
        try:
            backend = group._get_backend(torch.device("cuda"))
        except (RuntimeError, ValueError):
            continue  # no CUDA backend in this group (gloo only)
        if not isinstance(backend, nccl_group):
            continue
        name = "default group" if group is c10d._get_default_group() else f"group {index}"
        if _torch_can_suspend(torch):
            found.append(TorchCommunicator(backend, name))
            continue
        pointer = int(backend._comm_ptr())
        if pointer == 0:
            continue
        library = loaded_library()
        if library is None or not library.can_suspend:
            raise NcclError(suspend_problem() or "NCCL cannot suspend")
        found.append(RawCommunicator(library, pointer, name))
    return found
