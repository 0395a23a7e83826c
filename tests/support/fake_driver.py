"""A test double of the NVIDIA driver (libcuda + NVML) for CPU-only machines.

``build()`` compiles ``csrc/simulated/driver.c`` (the same library ``flexium demo`` runs its
simulated host on, ``flexium.simulated``) into one shared library; ``FakeDriver`` drives it through
ctypes. The library plays two parts at once:

* **libcuda** for ``flexium._C``: set ``FLEXIUM_LIBCUDA`` to ``build()`` before ``_C`` first
  touches the driver (it loads the driver once per process). ``activate()`` does that and checks it.
* **NVML** for pynvml (nvidia-ml-py 13): ``FLEXIUM_LIBNVML`` names the same file. pynvml loads
  ``libnvidia-ml.so.1`` in ``_LoadNvmlLibrary`` only while ``pynvml.nvmlLib is None``, so
  ``pynvml.nvmlLib = ctypes.CDLL(path)`` before ``pynvml.nvmlInit()`` redirects every later call
  (``nvmlInit`` calls ``nvmlInitWithFlags(0)``, found by ``getattr(nvmlLib, name)``). pynvml caches
  function pointers by name in ``pynvml._nvmlGetFunctionPointer_cache``: clear it if a process
  switches libraries after a call. ``FakeDriver.attach_pynvml(pynvml)`` does both.

The dynamic loader keeps one instance of a library per file, so ``_C``'s ``dlopen`` of the path,
pynvml's ``CDLL`` of it and ``FakeDriver``'s ``CDLL`` of it all share one modelled machine.

The machine
-----------
``FAKE_CUDA_GPUS`` GPUs (default 2, at most 16), numbered the same for CUDA and NVML. Each has a
fixed UUID (the same in every run; ``FakeDriver.uuid(i)``), a name from ``FAKE_CUDA_MODELS``
(comma list per GPU, the last repeating; default ``NVIDIA H200``), a size from
``FAKE_CUDA_TOTAL_MIB`` (same form; default 143771) and a PCI bus id.

The process (``getpid()``) has one logical device per GPU, logical ``i`` on physical ``i`` at first.
It holds ``set_process_memory(logical, bytes)`` on each; other processes hold
``set_other_memory(physical, bytes)``. Its checkpoint state machine::

    RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore-> LOCKED -unlock-> RUNNING

Any other transition: ``CUDA_ERROR_ILLEGAL_STATE``, nothing changes. FAILED is reached only through
``force_state`` and left by no transition (what the real driver allows there is unmeasured).

* lock: ``set_lock_delay_ms(ms)`` makes the process take ``ms`` to drain; a lock whose
  ``timeoutMs`` (0: no timeout) is shorter sleeps ``timeoutMs`` and returns ``CUDA_ERROR_TIMEOUT``.
* restore with GPU pairs (``old`` = the physical GPU a logical device is on NOW, ``new`` = where it
  goes) must list every GPU once as old and once as new (fact `restore-pairs-every-gpu`), name GPUs of this
  machine, of the same model, and needs CUDA >= 13000; else ``CUDA_ERROR_INVALID_VALUE``. Each
  destination needs free memory (total - other processes) for what lands on it, else
  ``CUDA_ERROR_OUT_OF_MEMORY``. Any failure leaves the process CHECKPOINTED where it was
  (fact `failed-restore-stays-checkpointed`).
  A restore without pairs (NULL args, or no pairs) restores in place, with the same memory check.
  ``set_failed_restore_poisons(True)`` (the default) models what every restore failure measured but a
  refused argument did (NVIDIA/cuda-checkpoint issue 44, facts `restore-without-room-loses-process`,
  `cumem-host-memory-unrestorable`): after a restore failed for memory, or with an injected code other
  than ``CUDA_ERROR_INVALID_VALUE``, every later restore fails with ``CUDA_ERROR_OPERATING_SYSTEM``.
* while CHECKPOINTED the process holds no GPU memory (NVML shows none; fact `zero-residue`), but for VMM
  memory held only by exported fds (below).
* after a remap ``cuDeviceGetUuid`` names the GPU a logical device is on now, as the driver does, while
  ``cuDeviceGetPCIBusId`` keeps naming the GPU it was on at first, as torch's cached properties do
  (fact `remap-keeps-old-identity`); ``physical_of`` and NVML say where it is.
* reserved fields of the argument structs must be zero, else ``CUDA_ERROR_INVALID_VALUE``.
* any pid other than ``getpid()``: ``CUDA_ERROR_INVALID_VALUE`` from every checkpoint function
  (what tools see from the real driver for a pid with no CUDA state; not measured here).
* fact `locked-process-blocks-cuda`: while the process is not RUNNING, its other CUDA calls (cuInit,
  cuDevice*) and its NVML calls block until it runs again. From the thread that took the lock that never happens (the
  real driver hangs): the fake returns ``CUDA_ERROR_ILLEGAL_STATE`` (NVML: ``NVML_ERROR_TIMEOUT``) at once, counts a
  deadlock and says so on stderr. Another thread waits up to ``set_block_timeout_ms`` (default 5000) and then does the
  same. ``blocked_calls()`` / ``deadlocks()`` count them. cuGetErrorName/String and nvmlErrorString never block, nor
  do the fake's own control functions (``used_bytes`` and the like) and the NVML calls of a thread inside
  ``nvml_of_another_process()``: both stand for NVML read from another process (fact `nvml-reader-process`).
* ``cuGetProcAddress[_v2]`` knows only the functions flexium uses, each from the CUDA version
  of its current ABI; an older version asked: ``VERSION_NOT_SUFFICIENT``; an unknown name, a
  function newer than ``FAKE_CUDA_VERSION`` (default 13000; checkpoint needs 12080), a checkpoint
  function under ``FAKE_CUDA_NO_CHECKPOINT=1`` or a VMM one under ``FAKE_CUDA_NO_VMM=1``:
  ``SYMBOL_NOT_FOUND``. Both return ``CUDA_ERROR_NOT_FOUND``.
* ``FAKE_CUDA_GPUS=0``: ``cuInit`` fails with ``CUDA_ERROR_NO_DEVICE``.

VMM memory (the fast path's allocator, csrc/vmm_*.cpp), modelled on host memory so that tests can
read and write the bytes behind a device address with ctypes:

* ``cuMemCreate``: a memfd of the size (a multiple of ``granularity``, 2 MiB) on the physical GPU
  its device is on now; ``CUDA_ERROR_OUT_OF_MEMORY`` past that GPU's free memory (total - other
  processes - this process, ``set_process_memory`` and VMM alike, the same numbers NVML shows).
* ``cuMemAddressReserve``: a ``PROT_NONE`` range, 2 MiB aligned; ``cuMemMap``: the memfd mapped
  there (``MAP_SHARED|MAP_FIXED``) without access until ``cuMemSetAccess`` grants read/write to
  a device (then ``PROT_READ|PROT_WRITE``); ``cuMemUnmap`` takes exactly one mapped range back to
  a bare reservation; ``cuMemAddressFree`` wants the range as reserved, with nothing mapped in it.
* ``cuMemCreate`` on a host NUMA node (``CUmemLocation`` type ``HOST_NUMA``, as NCCL makes its
  shared host memory): counted on no GPU. ``cuMemRetainAllocationHandle(addr)``: a new handle on the
  allocation mapped at ``addr`` (``CUDA_ERROR_INVALID_VALUE`` for any other address; needs no
  context); ``cuMemGetAllocationPropertiesFromHandle``: its type, handle types and location.
  ``cumem_mapping(size)`` makes such memory.
* ``cuMemAllocManaged`` (``managed_memory(size)``): a shared mapping of a memfd, freed by
  ``cuMemFree``; the checkpoint of a process holding some fails with ``CUDA_ERROR_NOT_SUPPORTED``
  and leaves it LOCKED (fact `managed-memory-refused`). ``cuPointerGetAttribute`` answers
  ``CU_POINTER_ATTRIBUTE_IS_MANAGED`` only: 1 there, 0 in VMM memory, ``CUDA_ERROR_INVALID_VALUE``
  elsewhere.
* ``cuMemExportToShareableHandle``: a dup of the memfd (only for memory created with
  ``requestedHandleTypes = POSIX_FILE_DESCRIPTOR``); ``cuMemImportFromShareableHandle``: a new
  handle on the allocation the fd refers to. An allocation lives while a handle, a mapping or an
  fd of the process refers to it (found in /proc/self/fd): closing the last fd frees it.
  An fd from another process (the copier process imports the job's segments) becomes an
  allocation of its own there, on the current context's GPU, counted for the process that made it.
  An allocation the checkpoint carried comes back from the restore unexportable
  (``CUDA_ERROR_INVALID_VALUE``), as on the H200s with driver 580.
* checkpoint: what the process holds a handle or mapping of rides the image (off every GPU while
  CHECKPOINTED, then onto where its device lands); what only an fd holds stays on its GPU and
  counts there, also against the restore's free memory (fact `exported-fd-survives-checkpoint`).
* copies (``cuMemcpy{DtoD,DtoH,HtoD}Async``) are memcpy, finished when they return; device
  ranges must lie in one mapping that grants the current context's device access
  (``CUDA_ERROR_ILLEGAL_ADDRESS`` otherwise, ``CUDA_ERROR_INVALID_VALUE`` for no mapping).
* contexts: one primary context per device, retained/released with a count
  (``primary_ctx_refcount``), current per thread; copies, streams, events, host registration and
  the VMM calls but the granularity query need an active current context
  (``CUDA_ERROR_INVALID_CONTEXT``).
* ``cuMemHostRegister``/``cuMemHostUnregister``: registrations tracked (``pinned_bytes``), an
  overlapping one refused (``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED``); each checkpoint
  records the pinned bytes it saw (``pinned_at_last_checkpoint``). Events complete when recorded.
* ``FAKE_CUDA_NO_VMM=1``: none of these symbols resolve. VMM objects, registrations, streams, events and
  context counts survive ``reset()`` (they are the process's own); ``vmm_leaks()`` sums them up.

NVML (physical view): memory used = other processes + this process's bytes on that GPU now; other
processes are those ``set_other_memory`` names, plus those of ``FAKE_CUDA_HOST_FILE``: a file of
lines ``PHYSICAL BYTES`` read at each use, which every process of one simulated host shares (a job,
its NVML reader process, a neighbour a test starts and ends: ``write_host_file``), and, where
``FAKE_CUDA_HOST_DIR`` names a directory, every other live process of that directory, each under its
own pid: a process there says what it holds on each GPU (a file named by its pid, rewritten after each
call that may change it, gone when it holds nothing or exits), as ``flexium demo``'s processes do;
compute processes = this pid (when it holds memory there), each process of the host directory that
holds some there, and, for the other memory this process was told of, one process
with pid ``OTHER_PID_BASE + physical`` (above the kernel's pid limit, so never real). This pid's
count leaves out VMM memory it holds only through an import of its own export (a fast move's
target memory until it is the job's own again; fact `nvml-skips-imported-memory`), which memory
used still counts. Driver version ``FAKE_NVML_DRIVER`` (default ``580.159.04``).

Failure injection: ``fail(function, code, nth=1)`` makes the nth next call of ``function`` (any
exported cu*/nvml* name) return ``code`` without doing anything; ``nth=0``: every call, until
``clear_failures()``. ``FAKE_CUDA_FAIL="function:code[:nth],..."`` arms the same at load (nth
defaults to 0 there), for subprocesses. ``set_delay_ms(function, ms)`` makes calls slow;
``FAKE_CUDA_DELAY="function:ms,..."`` arms the same at load (a copier process pinning slowly).
``corrupt_copy(function, nth=1)`` makes the nth next copy of ``function`` (``cuMemcpyDtoDAsync``,
``cuMemcpyDtoHAsync``, ``cuMemcpyHtoDAsync``) flip one bit of what it wrote, the fault a move's
checksum must catch; ``FAKE_CUDA_CORRUPT="function:nth,..."`` arms the same at load (the copier
process's copies).

The moves' checksum kernel (csrc/move_checksum.cpp): ``cuModuleLoadData`` takes flexium's PTX only
(one module per context), ``cuLaunchKernel`` of its function computes the same function on the
host, bit for bit; ``FAKE_CUDA_NO_CHECKSUM=1`` hides these functions (and ``cuMemsetD8``,
``cuMemcpyDtoH``).

Environment, read at load and by ``reset()``: FAKE_CUDA_GPUS, FAKE_CUDA_VERSION,
FAKE_CUDA_NO_CHECKPOINT, FAKE_CUDA_NO_VMM, FAKE_CUDA_NO_CHECKSUM, FAKE_CUDA_MODELS, FAKE_CUDA_TOTAL_MIB,
FAKE_NVML_DRIVER, FAKE_CUDA_FAIL, FAKE_CUDA_CORRUPT, FAKE_CUDA_DELAY, FAKE_CUDA_HOST_FILE,
FAKE_CUDA_HOST_DIR. ``_C`` resolves symbols and reads the CUDA version once, so FAKE_CUDA_VERSION,
FAKE_CUDA_NO_CHECKPOINT, FAKE_CUDA_NO_VMM and FAKE_CUDA_NO_CHECKSUM only matter for a process that
has not loaded the driver yet.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent
SOURCE = REPO_ROOT / "csrc" / "simulated" / "driver.c"
BUILD_DIR = REPO_ROOT / "build" / "fake_driver"
LIBRARY_NAME = "libfake_cuda.so"
CFLAGS = ["-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread"]

OTHER_PID_BASE = 4195304
FAKE_ENV_VARS = (
    "FAKE_CUDA_GPUS",
    "FAKE_CUDA_VERSION",
    "FAKE_CUDA_NO_CHECKPOINT",
    "FAKE_CUDA_NO_VMM",
    "FAKE_CUDA_NO_CHECKSUM",
    "FAKE_CUDA_MODELS",
    "FAKE_CUDA_TOTAL_MIB",
    "FAKE_NVML_DRIVER",
    "FAKE_NVML_RESERVED_MIB",
    "FAKE_CUDA_FAIL",
    "FAKE_CUDA_CORRUPT",
    "FAKE_CUDA_DELAY",
    "FAKE_CUDA_HOST_FILE",
    "FAKE_CUDA_HOST_DIR",
)

CUDA_ERRORS = {
    "CUDA_SUCCESS": 0,
    "CUDA_ERROR_INVALID_VALUE": 1,
    "CUDA_ERROR_OUT_OF_MEMORY": 2,
    "CUDA_ERROR_NOT_INITIALIZED": 3,
    "CUDA_ERROR_DEINITIALIZED": 4,
    "CUDA_ERROR_NO_DEVICE": 100,
    "CUDA_ERROR_INVALID_DEVICE": 101,
    "CUDA_ERROR_INVALID_CONTEXT": 201,
    "CUDA_ERROR_OPERATING_SYSTEM": 304,
    "CUDA_ERROR_INVALID_HANDLE": 400,
    "CUDA_ERROR_ILLEGAL_STATE": 401,
    "CUDA_ERROR_NOT_FOUND": 500,
    "CUDA_ERROR_NOT_READY": 600,
    "CUDA_ERROR_ILLEGAL_ADDRESS": 700,
    "CUDA_ERROR_LAUNCH_FAILED": 719,
    "CUDA_ERROR_NOT_PERMITTED": 800,
    "CUDA_ERROR_NOT_SUPPORTED": 801,
    "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH": 803,
    "CUDA_ERROR_TIMEOUT": 909,
    "CUDA_ERROR_UNKNOWN": 999,
}
NVML_ERRORS = {
    "NVML_SUCCESS": 0,
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_INVALID_ARGUMENT": 2,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_NOT_FOUND": 6,
    "NVML_ERROR_INSUFFICIENT_SIZE": 7,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_TIMEOUT": 10,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_UNKNOWN": 999,
}

# cuGetProcAddress_v2 lookup status
SYMBOL_FOUND = 0
SYMBOL_NOT_FOUND = 1
VERSION_NOT_SUFFICIENT = 2


class ProcessState(enum.IntEnum):
    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


@dataclass(frozen=True)
class Call:
    """One logged CUDA call: ``pairs`` is the gpuPairs count of a restore (0: in place), else -1."""

    function: str
    result: int
    pairs: int
    tid: int


def _error_code(code: int | str) -> int:
    if isinstance(code, int):
        return code
    if code in CUDA_ERRORS:
        return CUDA_ERRORS[code]
    if code in NVML_ERRORS:
        return NVML_ERRORS[code]
    raise ValueError(f"unknown error name {code!r}")


def build(force: bool = False) -> Path:
    """Compiles the simulated driver (when the library is missing or older than the source) and returns
    the library's path. The new file replaces the old one atomically: a process that has the
    old one loaded keeps it, and concurrent builders never see a half-written file."""
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    target = BUILD_DIR / LIBRARY_NAME
    if not force and target.exists() and target.stat().st_mtime >= SOURCE.stat().st_mtime:
        return target
    compiler = os.environ.get("CC", "cc")
    fd, tmp_name = tempfile.mkstemp(prefix=".libfake_cuda.", suffix=".so", dir=BUILD_DIR)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *CFLAGS, "-o", tmp_name, str(SOURCE)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building the fake driver failed ({compiler}):\n{done.stderr}")
        os.chmod(tmp_name, 0o755)
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return target


def subprocess_env(library: Path | None = None, **fake_vars: Any) -> dict[str, str]:
    """The environment for a Python subprocess that should run on the fake: this environment
    without FAKE_* settings, plus FLEXIUM_LIBCUDA / FLEXIUM_LIBNVML, the given FAKE_* variables
    (``FAKE_CUDA_GPUS=4``) and tests/ on PYTHONPATH so that it can import support.fake_driver."""
    env = {k: v for k, v in os.environ.items() if k not in FAKE_ENV_VARS}
    path = str(library if library is not None else build())
    env["FLEXIUM_LIBCUDA"] = path
    env["FLEXIUM_LIBNVML"] = path
    for name, value in fake_vars.items():
        if not name.startswith("FAKE_"):
            raise ValueError(f"{name}: only FAKE_* variables belong here")
        env[name] = str(value)
    tests_dir = str(TESTS_DIR)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH", "")) if p)
    return env


CU_MEM_LOCATION_TYPE_HOST_NUMA = 3


def host_gpus_in_another_process(library: Path, **fake_vars: str) -> dict[int, dict[str, Any]]:
    """The host's GPUs as a process of its own reads them through ``library`` (engine/nvml.py run by
    path, as flexium's reader process is), with these FAKE_* settings: index -> GPU."""
    from flexium.engine import nvml

    env = {**os.environ, "FLEXIUM_LIBNVML": str(library), **fake_vars}
    done = subprocess.run(
        [sys.executable, nvml.__file__], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return {gpu["index"]: gpu for gpu in json.loads(done.stdout)}


def write_host_file(path: Path, others: dict[int, int]) -> None:
    """What other processes hold on each GPU of a simulated host (physical index -> bytes), for every
    process whose FAKE_CUDA_HOST_FILE is ``path`` to see at its next read; written whole, at once."""
    staged = path.with_name(path.name + ".tmp")
    staged.write_text("".join(f"{physical} {held}\n" for physical, held in sorted(others.items())))
    os.replace(staged, path)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp, as csrc/cuda_driver_types.h lays it out
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", ctypes.c_ubyte * 8),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class FakeDriver:
    """ctypes handle on the fake driver's control functions. Every method acts on the one
    instance of the library in this process, the one flexium._C and pynvml use."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else build()
        self._lib = ctypes.CDLL(str(self.path))
        self._declare()

    def _declare(self) -> None:
        lib = self._lib
        c_int, c_uint, c_ull, c_long = ctypes.c_int, ctypes.c_uint, ctypes.c_ulonglong, ctypes.c_long
        signatures: dict[str, tuple[Any, list[Any]]] = {
            "fake_reset": (None, []),
            "fake_gpu_count": (c_int, []),
            "fake_uuid": (c_int, [c_int, ctypes.c_char_p, c_int]),
            "fake_set_process_memory": (c_int, [c_int, c_ull]),
            "fake_set_peer_access": (None, [c_int]),
            "fake_set_other_memory": (c_int, [c_int, c_ull]),
            "fake_set_gpu_activity": (c_int, [c_int, c_uint, c_uint, c_uint, c_ull]),
            "fake_fail": (c_int, [ctypes.c_char_p, c_int, c_int]),
            "fake_corrupt_copy": (c_int, [ctypes.c_char_p, c_int]),
            "fake_clear_failures": (None, []),
            "fake_pending_failures": (c_int, []),
            "fake_set_delay_ms": (c_int, [ctypes.c_char_p, c_uint]),
            "fake_set_lock_delay_ms": (None, [c_uint]),
            "fake_set_block_timeout_ms": (None, [c_uint]),
            "fake_set_failed_restore_poisons": (None, [c_int]),
            "fake_state": (c_int, []),
            "fake_force_state": (c_int, [c_int]),
            "fake_physical_of": (c_int, [c_int]),
            "fake_process_bytes_on": (c_ull, [c_int]),
            "fake_used_bytes": (c_ull, [c_int]),
            "fake_set_nvml_for_another_process": (None, [c_int]),
            "fake_call_count": (c_int, [ctypes.c_char_p]),
            "fake_last_pairs_count": (c_int, []),
            "fake_last_pair": (c_int, [c_int, ctypes.POINTER(c_int), ctypes.POINTER(c_int)]),
            "fake_log_size": (c_int, []),
            "fake_log_dropped": (c_long, []),
            "fake_log_entry": (
                c_int,
                [
                    c_int,
                    ctypes.POINTER(ctypes.c_char_p),
                    ctypes.POINTER(c_int),
                    ctypes.POINTER(c_int),
                    ctypes.POINTER(c_long),
                ],
            ),
            "fake_clear_log": (None, []),
            "fake_blocked_calls": (c_int, []),
            "fake_deadlocks": (c_int, []),
            "fake_restore_thread_id": (c_int, []),
            "fake_nvml_refcount": (c_int, []),
            "fake_cuda_version": (c_int, []),
            "fake_vmm_allocations": (c_int, []),
            "fake_vmm_handles": (c_int, []),
            "fake_vmm_mappings": (c_int, []),
            "fake_vmm_reservations": (c_int, []),
            "fake_vmm_bytes_on": (c_ull, [c_int]),
            "fake_pinned_bytes": (c_ull, []),
            "fake_pinned_at_last_checkpoint": (c_ull, []),
            "fake_live_events": (c_int, []),
            "fake_live_streams": (c_int, []),
            "fake_primary_ctx_refcount": (c_int, [c_int]),
            "fake_current_context": (c_int, []),
            "fake_vmm_granularity": (c_ull, []),
        }
        for name, (restype, argtypes) in signatures.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes

    @property
    def library(self) -> ctypes.CDLL:
        """The library itself, for calling its cu*/nvml* functions directly."""
        return self._lib

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise ValueError(f"fake driver refused {what}")

    # -- configuration -------------------------------------------------------------------------

    def reset(self) -> None:
        """Back to the start: RUNNING, logical i on physical i, no memory anywhere, no failures,
        delays or log; re-reads the FAKE_* environment. NVML's init count and cuInit survive."""
        self._lib.fake_reset()

    def set_process_memory(self, logical: int, nbytes: int) -> None:
        """Bytes this process holds on logical device ``logical`` (it moves with the device)."""
        self._check(self._lib.fake_set_process_memory(logical, nbytes), f"logical device {logical}")

    def set_peer_access(self, allowed: bool) -> None:
        """Whether cuDeviceCanAccessPeer lets distinct GPUs reach each other (until reset)."""
        self._lib.fake_set_peer_access(int(allowed))

    def set_other_memory(self, physical: int, nbytes: int) -> None:
        """Bytes other processes hold on physical GPU ``physical``."""
        self._check(self._lib.fake_set_other_memory(physical, nbytes), f"GPU {physical}")

    def set_gpu_activity(
        self,
        physical: int,
        *,
        utilization: int = 0,
        memory_utilization: int = 0,
        temperature_c: int = 35,
        ecc_uncorrected: int = 0,
    ) -> None:
        """What NVML reports as utilization, temperature and uncorrected ECC errors of a GPU."""
        rc = self._lib.fake_set_gpu_activity(physical, utilization, memory_utilization, temperature_c, ecc_uncorrected)
        self._check(rc, f"GPU {physical}")

    def fail(self, function: str, code: int | str, nth: int = 1) -> None:
        """The ``nth`` next call of ``function`` returns ``code`` (an int or a CUDA_ERROR_* /
        NVML_ERROR_* name) and does nothing else; ``nth=0``: every call until clear_failures()."""
        self._check(self._lib.fake_fail(function.encode(), nth, _error_code(code)), f"fail({function!r}, nth={nth})")

    def corrupt_copy(self, function: str, nth: int = 1) -> None:
        """The ``nth`` next call of the copy ``function`` (cuMemcpyDtoDAsync, cuMemcpyDtoHAsync,
        cuMemcpyHtoDAsync) flips one bit of what it wrote; clear_failures() disarms it."""
        self._check(self._lib.fake_corrupt_copy(function.encode(), nth), f"corrupt_copy({function!r}, nth={nth})")

    def clear_failures(self) -> None:
        self._lib.fake_clear_failures()

    def pending_failures(self) -> int:
        """Injected failures not fired yet (every-call ones count until cleared)."""
        return int(self._lib.fake_pending_failures())

    def set_delay_ms(self, function: str, ms: int) -> None:
        """Each call of ``function`` sleeps ``ms`` first (outside the fake's lock)."""
        self._check(self._lib.fake_set_delay_ms(function.encode(), ms), f"delay of {function!r}")

    def set_lock_delay_ms(self, ms: int) -> None:
        """cuCheckpointProcessLock takes ``ms`` to drain the process; shorter timeouts fail with
        CUDA_ERROR_TIMEOUT after sleeping the timeout."""
        self._lib.fake_set_lock_delay_ms(ms)

    def set_block_timeout_ms(self, ms: int) -> None:
        """How long a CUDA call from another thread waits for a locked process to run again."""
        self._lib.fake_set_block_timeout_ms(ms)

    def set_failed_restore_poisons(self, on: bool) -> None:
        """Whether a restore that failed for anything but its arguments (memory, an injected code other
        than CUDA_ERROR_INVALID_VALUE) leaves every later restore failing (on at each reset)."""
        self._lib.fake_set_failed_restore_poisons(1 if on else 0)

    def force_state(self, state: ProcessState | int) -> None:
        """Puts the process in ``state`` at once, bypassing the checkpoint API's rules."""
        self._check(self._lib.fake_force_state(int(state)), f"state {state}")

    # -- observation ---------------------------------------------------------------------------

    @property
    def gpu_count(self) -> int:
        return int(self._lib.fake_gpu_count())

    @property
    def cuda_version(self) -> int:
        return int(self._lib.fake_cuda_version())

    def uuid(self, physical: int) -> str:
        """The "GPU-..." UUID of a physical GPU, as NVML and CUDA report it."""
        buf = ctypes.create_string_buffer(64)
        self._check(self._lib.fake_uuid(physical, buf, len(buf)), f"GPU {physical}")
        return buf.value.decode()

    def uuids(self) -> list[str]:
        return [self.uuid(i) for i in range(self.gpu_count)]

    def state(self) -> ProcessState:
        return ProcessState(self._lib.fake_state())

    def physical_of(self, logical: int) -> int:
        """The physical GPU logical device ``logical`` is on now (-1: no such device)."""
        return int(self._lib.fake_physical_of(logical))

    def placement(self) -> list[int]:
        return [self.physical_of(i) for i in range(self.gpu_count)]

    def process_bytes_on(self, physical: int) -> int:
        """This process's bytes on a physical GPU now (0 while checkpointed): where its memory is,
        memory NVML leaves out of its count for the process included."""
        return int(self._lib.fake_process_bytes_on(physical))

    def used_bytes(self, physical: int) -> int:
        """NVML's memory used of a physical GPU: other processes + this process."""
        return int(self._lib.fake_used_bytes(physical))

    @contextlib.contextmanager
    def nvml_of_another_process(self) -> Iterator[None]:
        """Within the block this thread's NVML calls stand for another process's, the engine's NVML
        reader (fact `nvml-reader-process`), whose reads a test answers here because no other process
        sees the machine it set up: they do not block while this process is frozen."""
        self._lib.fake_set_nvml_for_another_process(1)
        try:
            yield
        finally:
            self._lib.fake_set_nvml_for_another_process(0)

    def call_count(self, function: str) -> int:
        """Calls of an exported cu*/nvml* function since the last reset()/clear_log()."""
        return int(self._lib.fake_call_count(function.encode()))

    def last_pairs_count(self) -> int:
        """gpuPairsCount of the last cuCheckpointProcessRestore (0: in place; -1: none yet)."""
        return int(self._lib.fake_last_pairs_count())

    def last_pairs(self) -> list[tuple[int, int]]:
        """The last restore's pairs as (old, new) physical indexes; -1 for a UUID not of this machine."""
        pairs = []
        old, new = ctypes.c_int(), ctypes.c_int()
        for i in range(max(self.last_pairs_count(), 0)):
            if self._lib.fake_last_pair(i, ctypes.byref(old), ctypes.byref(new)) != 0:
                break
            pairs.append((old.value, new.value))
        return pairs

    def calls(self, prefix: str = "cu") -> list[Call]:
        """Logged CUDA calls, oldest first (the log keeps the last 4096), filtered by name prefix."""
        out = []
        name, result, pairs, tid = ctypes.c_char_p(), ctypes.c_int(), ctypes.c_int(), ctypes.c_long()
        for i in range(self._lib.fake_log_size()):
            if (
                self._lib.fake_log_entry(
                    i, ctypes.byref(name), ctypes.byref(result), ctypes.byref(pairs), ctypes.byref(tid)
                )
                != 0
            ):
                break
            function = (name.value or b"").decode()
            if function.startswith(prefix):
                out.append(Call(function, result.value, pairs.value, tid.value))
        return out

    def checkpoint_calls(self) -> list[str]:
        """Names of the checkpoint API calls in order, without the cuCheckpointProcess prefix
        ("Lock", "Checkpoint", "Restore", "Unlock", "GetState", "GetRestoreThreadId")."""
        prefix = "cuCheckpointProcess"
        return [c.function[len(prefix) :] for c in self.calls(prefix)]

    def log_dropped(self) -> int:
        return int(self._lib.fake_log_dropped())

    def clear_log(self) -> None:
        """Forgets the call log, counters, last pairs and blocked/deadlock counts."""
        self._lib.fake_clear_log()

    def blocked_calls(self) -> int:
        """CUDA calls made while the process was not RUNNING (the real driver blocks them: fact
        `locked-process-blocks-cuda`)."""
        return int(self._lib.fake_blocked_calls())

    def deadlocks(self) -> int:
        """Of those, calls that would never return on a real driver."""
        return int(self._lib.fake_deadlocks())

    def restore_thread_id(self) -> int:
        """The tid cuCheckpointProcessGetRestoreThreadId reports (the thread that ran cuInit)."""
        return int(self._lib.fake_restore_thread_id())

    def nvml_refcount(self) -> int:
        return int(self._lib.fake_nvml_refcount())

    # -- VMM memory, pinned memory, streams, contexts -------------------------------------------

    @property
    def granularity(self) -> int:
        """What cuMemGetAllocationGranularity reports (minimum and recommended alike)."""
        return int(self._lib.fake_vmm_granularity())

    def vmm_allocations(self) -> int:
        """cuMemCreate allocations alive: held by a handle, a mapping or an exported fd."""
        return int(self._lib.fake_vmm_allocations())

    def vmm_handles(self) -> int:
        return int(self._lib.fake_vmm_handles())

    def vmm_mappings(self) -> int:
        return int(self._lib.fake_vmm_mappings())

    def vmm_reservations(self) -> int:
        return int(self._lib.fake_vmm_reservations())

    def vmm_bytes_on(self, physical: int) -> int:
        """VMM bytes on a physical GPU now (part of process_bytes_on and of NVML's view)."""
        return int(self._lib.fake_vmm_bytes_on(physical))

    def pinned_bytes(self) -> int:
        """Host bytes registered (pinned) and not unregistered."""
        return int(self._lib.fake_pinned_bytes())

    def live_streams(self) -> int:
        return int(self._lib.fake_live_streams())

    def live_events(self) -> int:
        return int(self._lib.fake_live_events())

    def pinned_at_last_checkpoint(self) -> int:
        """Pinned host bytes the last checkpoint saw."""
        return int(self._lib.fake_pinned_at_last_checkpoint())

    def primary_ctx_refcount(self, device: int) -> int:
        """Retains of a device's primary context not released (0: the context does not exist)."""
        return int(self._lib.fake_primary_ctx_refcount(device))

    def copy_on(self, device: int, dst: int, src: int, size: int) -> int:
        """``cuMemcpyDtoDAsync`` with ``device``'s primary context current (retained for the call):
        what a copy or kernel of that GPU does to the two ranges. Returns the CUresult."""
        lib = self.library
        ctx = ctypes.c_void_p()
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), f"device {device}")
        previous = ctypes.c_void_p()
        lib.cuCtxGetCurrent(ctypes.byref(previous))
        lib.cuCtxSetCurrent(ctx)
        try:
            return int(lib.cuMemcpyDtoDAsync(ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(size), None))
        finally:
            lib.cuCtxSetCurrent(previous)
            lib.cuDevicePrimaryCtxRelease(device)

    def cumem_mapping(
        self, size: int, *, on_host: bool = True, made_elsewhere: bool = False, device: int = 0
    ) -> Callable[[], None]:
        """``size`` bytes (a multiple of ``granularity``) of cuMem memory on host NUMA node 0 (or,
        ``on_host=False``, on ``device``), mapped and open to ``device``: on the host, as NCCL makes its
        shared host memory unless NCCL_CUMEM_HOST_ENABLE=0 (fact `cumem-host-memory-unrestorable`).
        ``made_elsewhere``: made by another process, which exports it as an fd and exits, and imported
        here (as the copier makes host memory for the job). Returns what frees it again (unmap,
        release, give the range back); its ``address`` is where it is mapped."""
        lib = self.library
        u64 = ctypes.c_uint64
        where = _Location(type=CU_MEM_LOCATION_TYPE_HOST_NUMA if on_host else 1, id=0 if on_host else device)
        prop = _AllocationProp(type=1, location=where)
        access = _AccessDesc(location=_Location(type=1, id=device), flags=3)  # read/write
        ctx = ctypes.c_void_p()
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), f"device {device}")
        previous = ctypes.c_void_p()
        lib.cuCtxGetCurrent(ctypes.byref(previous))
        lib.cuCtxSetCurrent(ctx)
        handle, address, length, zero = ctypes.c_ulonglong(), u64(), ctypes.c_size_t(size), ctypes.c_size_t(0)

        def call(name: str, *args: Any) -> None:
            self._check(getattr(lib, name)(*args), name)

        try:
            if made_elsewhere:
                fd = self._made_in_a_child(size, on_host)
                try:
                    call("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd), 1)
                finally:
                    os.close(fd)
            else:
                call("cuMemCreate", ctypes.byref(handle), length, ctypes.byref(prop), u64(0))
            call("cuMemAddressReserve", ctypes.byref(address), length, zero, u64(0), u64(0))
            call("cuMemMap", address, length, zero, handle, u64(0))
            call("cuMemSetAccess", address, length, ctypes.byref(access), ctypes.c_size_t(1))
        except BaseException:
            lib.cuDevicePrimaryCtxRelease(device)  # contexts outlive reset(): none may be left retained
            raise
        finally:
            lib.cuCtxSetCurrent(previous)

        def free() -> None:
            lib.cuCtxSetCurrent(ctx)
            try:
                call("cuMemUnmap", address, length)
                call("cuMemRelease", handle)
                call("cuMemAddressFree", address, length)
            finally:
                lib.cuCtxSetCurrent(previous)
                lib.cuDevicePrimaryCtxRelease(device)

        free.address = address.value  # type: ignore[attr-defined]
        return free

    def _made_in_a_child(self, size: int, on_host: bool) -> int:
        """An fd (POSIX, exported) of ``size`` bytes of cuMem memory a child process made on the host
        (or device 0) with this fake and then exited."""
        import socket

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        child = f"""
import ctypes, os, socket, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from fake_driver import _AllocationProp, _Location
lib = ctypes.CDLL(os.environ["FLEXIUM_LIBCUDA"])
ctx, handle, fd = ctypes.c_void_p(), ctypes.c_ulonglong(), ctypes.c_int(-1)
prop = _AllocationProp(type=1, location=_Location(type={CU_MEM_LOCATION_TYPE_HOST_NUMA if on_host else 1}, id=0))
prop.requestedHandleTypes = 1
for rc in (lib.cuInit(0), lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), lib.cuCtxSetCurrent(ctx),
           lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t({size}), ctypes.byref(prop), ctypes.c_uint64(0)),
           lib.cuMemExportToShareableHandle(ctypes.byref(fd), handle, 1, ctypes.c_uint64(0))):
    assert rc == 0, rc
socket.send_fds(socket.socket(fileno={theirs.fileno()}), [b"fd"], [fd.value])
"""
        try:
            subprocess.run([sys.executable, "-c", child], check=True, timeout=60, pass_fds=(theirs.fileno(),))
            _message, fds, _flags, _address = socket.recv_fds(ours, 16, 1)
        finally:
            ours.close()
            theirs.close()
        return fds[0]

    def managed_memory(self, size: int) -> Callable[[], None]:
        """``size`` bytes of managed memory (``cuMemAllocManaged``, as bitsandbytes' paged optimizers
        make it), which the checkpoint refuses (fact `managed-memory-refused`). Returns what frees it; its
        ``address`` is where it is."""
        lib = self.library
        ctx, previous, address = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_uint64()
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0), "device 0")
        lib.cuCtxGetCurrent(ctypes.byref(previous))
        lib.cuCtxSetCurrent(ctx)
        try:
            made = lib.cuMemAllocManaged(ctypes.byref(address), ctypes.c_size_t(size), ctypes.c_uint(1))
            self._check(made, "cuMemAllocManaged")
        finally:
            lib.cuCtxSetCurrent(previous)

        def free() -> None:
            lib.cuCtxSetCurrent(ctx)
            try:
                self._check(lib.cuMemFree(address), "cuMemFree")
            finally:
                lib.cuCtxSetCurrent(previous)
                lib.cuDevicePrimaryCtxRelease(0)

        free.address = address.value  # type: ignore[attr-defined]
        return free

    def current_context(self) -> int:
        """The calling thread's current context as a device ordinal, -1 for none."""
        return int(self._lib.fake_current_context())

    def vmm_leaks(self) -> dict[str, int]:
        """Everything of the VMM model still held; all zero once a test gave it all back."""
        return {
            "allocations": self.vmm_allocations(),
            "handles": self.vmm_handles(),
            "mappings": self.vmm_mappings(),
            "reservations": self.vmm_reservations(),
            "pinned_bytes": self.pinned_bytes(),
            "streams": self.live_streams(),
            "events": self.live_events(),
            "primary_contexts": sum(self.primary_ctx_refcount(d) for d in range(self.gpu_count)),
        }

    # -- helpers -------------------------------------------------------------------------------

    def attach_pynvml(self, pynvml: Any) -> None:
        """Makes the given pynvml module use this library (see the module docstring)."""
        pynvml.nvmlLib = self._lib
        pynvml._nvmlGetFunctionPointer_cache.clear()

    def environment(self, **fake_vars: Any) -> dict[str, str]:
        """subprocess_env() for this library."""
        return subprocess_env(self.path, **fake_vars)

    def run_python(self, code: str, timeout: float = 120, **fake_vars: Any) -> subprocess.CompletedProcess:
        """Runs ``code`` in a fresh Python on the fake (own driver load, own machine state)."""
        return subprocess.run(
            [sys.executable, "-c", code],
            env=self.environment(**fake_vars),
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def activate() -> FakeDriver:
    """Points this process's flexium._C (and flexium's NVML through FLEXIUM_LIBNVML) at the fake,
    loads it and returns its FakeDriver, reset. _C loads a driver once per process: if something
    already made it load another library, this raises RuntimeError naming it."""
    path = build()
    os.environ.setdefault("FLEXIUM_LIBCUDA", str(path))
    os.environ.setdefault("FLEXIUM_LIBNVML", str(path))
    from flexium import _C

    library = _C.driver_status().library
    if library != str(path):
        raise RuntimeError(
            f"flexium._C already loaded {library!r} in this process, not the fake driver "
            f"{str(path)!r}: FLEXIUM_LIBCUDA must name the fake before anything touches the driver"
        )
    fake = FakeDriver(path)
    fake.reset()
    return fake


@contextlib.contextmanager
def activated() -> Iterator[FakeDriver]:
    """activate() for the length of a block (a test module's fixture): the environment variables it
    sets are put back afterwards, so later modules see the environment they started with."""
    saved = {name: os.environ.get(name) for name in ("FLEXIUM_LIBCUDA", "FLEXIUM_LIBNVML")}
    try:
        yield activate()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


__all__ = [
    "CUDA_ERRORS",
    "NVML_ERRORS",
    "OTHER_PID_BASE",
    "SYMBOL_FOUND",
    "SYMBOL_NOT_FOUND",
    "VERSION_NOT_SUFFICIENT",
    "Call",
    "FakeDriver",
    "ProcessState",
    "activate",
    "activated",
    "build",
    "subprocess_env",
]
