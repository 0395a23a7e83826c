"""PyTorch's tensor memory in our VMM allocator: what lets the fast path move it itself.

A `torch.cuda.MemPool` on flexium._C's pluggable allocator for the job's GPU, and every
thread's allocations on that GPU routed to it (fact `allocator-routed-to-pool`). Other GPUs keep PyTorch's
allocator: a pool made for another GPU creates a CUDA context there, which every swap would carry
(fact `pool-on-job-gpu-only`). PyTorch keeps caching, streams, statistics and `record_stream` on top;
only the segments come from us, each a cuMemCreate allocation the fast path can copy to another
GPU or to pinned host memory and map back at the same address.

Rules from fact `allocator-routed-to-pool` this module keeps: the routing starts before the job's first CUDA allocation
(memory allocated earlier stays outside the pool, so the job then uses the driver path); it
ends before exit and before any MemPool is destroyed (destroying one while routed aborts the
process); PyTorch's free-cache-and-retry on out-of-memory is off while routed, so oversize
cached blocks are made releasable (max_split_size_mb), which the allocator frees and retries
with before it reports an out-of-memory.
"""

from __future__ import annotations

import logging
import os
import resource
import threading
from collections.abc import Sequence
from typing import Any

from flexium import _C

log = logging.getLogger("flexium")
# A segment's address -> its live (offset, length) ranges, as PyTorch's allocator reports them.
LiveRanges = dict[int, list[tuple[int, int]]]

MIB = 1 << 20
# Cached blocks at least this large can be freed by PyTorch's OOM retry inside our pool.
DEFAULT_MAX_SPLIT_MB = 256
_ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# One fd per segment is held across a fast migration; ask for this many when the hard limit allows.
WANTED_OPEN_FILES = 1 << 20


# The pool whose routing a destroyed MemPool must pause (one per process; a new init replaces it).
_installed: MemoryPool | None = None


class MemoryPool:
    """The routing of PyTorch's allocations into our allocator, on or off with a reason."""

    def __init__(self) -> None:
        # Re-entrant: a MemPool's __del__ (which takes it) can run inside any call, via gc.
        self._lock = threading.RLock()
        self._pools: dict[int, Any] = {}  # device -> torch.cuda.MemPool, kept alive on purpose
        self._routed: list[int] = []
        self._allocator: Any | None = None
        self._suspended = False  # routing ended while some other MemPool is destroyed
        self._step_hook: Any | None = None
        self._open_failed = False  # said once: open_to_gpus_in_use runs at every step
        self.reason_off: str | None = "not installed"

    @property
    def active(self) -> bool:
        return bool(self._routed)

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(self._routed)

    def install(self, devices: Sequence[int]) -> bool:
        """Routes every thread's allocations on `devices` to our allocator. Returns whether it
        did; otherwise `reason_off` says why and what to do, and the job uses the driver path."""
        with self._lock:
            if self._routed:
                return True
            reason = self._refusal(devices)
            if reason is not None:
                self.reason_off = reason
                return False
            import torch

            _raise_open_file_limit()
            _make_oversize_blocks_releasable(torch)
            self._allocator = torch.cuda.memory.CUDAPluggableAllocator(
                _C.__file__, "flexium_vmm_alloc", "flexium_vmm_free"
            )
            allocator: Any = self._allocator  # torch leaves CUDAPluggableAllocator.allocator() unannotated
            try:
                for device in devices:
                    # A MemPool belongs to the device current when it is made. flexium pools the
                    # job's own GPU only, which init already made current (fact `pool-on-job-gpu-only`).
                    previous = torch.cuda._maybe_exchange_device(device)
                    try:
                        pool = torch.cuda.MemPool(allocator.allocator())
                    finally:
                        torch.cuda._maybe_exchange_device(previous)
                    self._pools[device] = pool
                    torch._C._cuda_beginAllocateToPool(device, pool.id)
                    self._routed.append(device)
            except Exception as exc:
                self._end_routing(torch)
                self._routed = []
                self.reason_off = f"PyTorch refused the memory pool ({type(exc).__name__}: {exc})"
                return False
            self._guard_other_pools(torch)
            _open_before_data_parallel_gathers(torch)
            self.reason_off = None
            return True

    def uninstall(self) -> None:
        """Ends the routing; the pools stay alive (their memory may still hold tensors)."""
        global _installed
        with self._lock:
            if _installed is self:
                _installed = None
            if self._step_hook is not None:
                self._step_hook.remove()
                self._step_hook = None
            if not self._routed:
                return
            import torch

            if not self._suspended:
                self._end_routing(torch)
            self._routed = []
            self._suspended = False
            self.reason_off = "uninstalled"

    # ---- other MemPools -------------------------------------------------------------------

    def _guard_other_pools(self, torch: Any) -> None:
        """Destroying any MemPool while ours is routed aborts the process (fact `allocator-routed-to-pool`), and jobs or
        libraries may make and drop their own. So the routing ends just before another pool is
        destroyed and starts again at the next optimizer step; allocations in between come
        from PyTorch's own allocator and ride the driver checkpoint."""
        global _installed
        _installed = self
        cls = torch.cuda.MemPool
        if not getattr(cls, "_flexium_guarded", False):
            original = cls.__dict__.get("__del__")

            def __del__(pool: Any) -> None:
                routed = _installed
                if routed is not None and not any(pool is ours for ours in routed._pools.values()):
                    routed._suspend()
                if original is not None:
                    original(pool)

            cls.__del__ = __del__
            cls._flexium_guarded = True
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._step_hook = register_optimizer_step_post_hook(lambda *_: self._after_step())

    def _after_step(self) -> None:
        self._resume_if_suspended()
        self.open_to_gpus_in_use()

    def open_to_gpus_in_use(self) -> None:
        """Opens the pool to the GPUs the process has begun to use since it last looked (their
        context active: PyTorch's own allocator there), which copy into it (fact `jobs-use-every-visible-gpu`):
        at each optimizer step and before DataParallel's gather. Never breaks training."""
        if not self._routed:
            return
        try:
            opened = _C.open_pool_to_current_users()
        except Exception as exc:
            if not self._open_failed:
                self._open_failed = True
                log.warning("could not open the memory pool to the other GPUs this job uses: %s", exc)
            return
        if opened:
            log.info("memory pool opened to %d more GPU(s) this job uses", opened)

    def _suspend(self) -> None:
        with self._lock:
            if not self._routed or self._suspended:
                return
            import torch

            self._end_routing(torch)
            self._suspended = True
            log.info("memory pool routing paused while another MemPool is destroyed; it resumes at the next step")

    def _resume_if_suspended(self) -> None:
        if not self._suspended:
            return
        with self._lock:
            if not self._suspended or not self._routed:
                return
            import torch

            for device in self._routed:
                torch._C._cuda_beginAllocateToPool(device, self._pools[device].id)
            self._suspended = False

    def _end_routing(self, torch: Any) -> None:
        """Ends the routing of every device in _routed (which the caller updates)."""
        for device in self._routed:
            pool = self._pools[device]
            try:
                torch._C._cuda_endAllocateToPool(device, pool.id)
                # Gives back the use beginAllocateToPool took (as torch.cuda.use_mem_pool does), so
                # the pool's own destruction later finds the count it expects.
                torch._C._cuda_releasePool(device, pool.id)
            except Exception as exc:  # exiting anyway: say so, keep ending the others
                log.error("could not end the memory pool routing on cuda:%d: %s", device, exc)

    def _refusal(self, devices: Sequence[int]) -> str | None:
        try:
            import torch
        except ImportError:
            return "PyTorch is not installed"
        if not torch.cuda.is_available():
            return "torch has no usable CUDA"
        if not _C.driver_status().vmm_api:
            return "the driver lacks the virtual memory management API (cuMemCreate and friends)"
        if not all(
            hasattr(torch._C, name) for name in ("_cuda_beginAllocateToPool", "_cuda_endAllocateToPool")
        ) or not hasattr(torch.cuda, "MemPool"):
            return f"torch {torch.__version__} has no MemPool routing (PyTorch 2.6 or newer has it)"
        early = _memory_allocated_before(torch, devices)
        if early:
            where = ", ".join(f"{_mib(n)} on cuda:{d}" for d, n in early.items())
            return (
                f"CUDA memory was allocated before flexium.init() ({where}); that memory cannot join the "
                "pool, so this job uses the driver path: call flexium.init() before creating CUDA tensors"
            )
        return None

    # ---- what the fast path reads ----------------------------------------------------------

    def live_ranges(self, device: int) -> LiveRanges:
        """For each of our segments on `device` that PyTorch knows, the byte ranges of its blocks
        that hold tensors (or wait for a stream to finish with them). What is left out is free
        cache by PyTorch's own books, so copying it would move garbage. Call with the device
        synchronized and no other thread allocating (the safe point)."""
        pool = self._pools.get(device)
        if pool is None:
            return {}
        import torch

        snapshot = _pool_snapshot(torch, pool)
        ours = {s.address for s in _C.vmm_segments() if s.device == device}
        ranges: dict[int, list[tuple[int, int]]] = {}
        for segment in snapshot:
            base = int(segment["address"])
            if base not in ours or int(segment.get("device", device)) != device:
                continue
            ranges[base] = _merge(_active_blocks(segment, base))
        return ranges


def _pool_snapshot(torch: Any, pool: Any) -> list[dict[str, Any]]:
    try:
        raw = torch.cuda.memory_snapshot(pool.id)
    except TypeError:  # older signature: everything, filtered by segment_pool_id below
        raw = torch.cuda.memory_snapshot()
    segments = raw["segments"] if isinstance(raw, dict) else raw
    wanted = tuple(pool.id)
    return [s for s in segments if tuple(s.get("segment_pool_id", wanted)) == wanted]


def _active_blocks(segment: dict[str, Any], base: int) -> list[tuple[int, int]]:
    blocks = []
    offset = 0
    for block in segment.get("blocks", []):
        size = int(block["size"])
        start = int(block["address"]) - base if "address" in block else offset
        if block.get("state") != "inactive":
            blocks.append((start, size))
        offset = start + size
    return blocks


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, length in sorted(ranges):
        if merged and merged[-1][0] + merged[-1][1] >= start:
            last_start, last_length = merged[-1]
            merged[-1] = (last_start, max(last_start + last_length, start + length) - last_start)
        else:
            merged.append((start, length))
    return merged


def _open_before_data_parallel_gathers(torch: Any) -> None:
    """DataParallel's first gather may come before the pool makes a segment after its replicas'
    GPUs began (small models: every tensor fits the first segments), and the replica GPUs copy into
    the pool: the installed pool is opened to them first."""
    cls = torch.nn.DataParallel
    if getattr(cls, "_flexium_opens_pool", False):
        return
    original = cls.gather

    def gather(module: Any, outputs: Any, output_device: Any) -> Any:
        routed = _installed
        if routed is not None:
            routed.open_to_gpus_in_use()
        return original(module, outputs, output_device)

    cls.gather = gather
    cls._flexium_opens_pool = True


def _memory_allocated_before(torch: Any, devices: Sequence[int]) -> dict[int, int]:
    if not torch.cuda.is_initialized():
        return {}
    torch.cuda.empty_cache()
    early = {}
    for device in devices:
        if torch._C._cuda_hasPrimaryContext(device):
            reserved = int(torch.cuda.memory_reserved(device))
            if reserved:
                early[device] = reserved
    return early


def _raise_open_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, WANTED_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            log.info("could not raise the open file limit from %d (%s); fast moves need one per segment", soft, exc)


def open_file_headroom() -> int:
    """How many more files this process may open now."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 0
    return max(0, soft - in_use)


def _make_oversize_blocks_releasable(torch: Any) -> None:
    for variable in _ALLOC_CONF_VARIABLES:
        if "max_split_size_mb" in os.environ.get(variable, ""):
            return  # the user's choice stands
    # torch 2.9+ has the accelerator-wide setter; torch.cuda's own is deprecated there (it warns).
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    try:
        setter(f"max_split_size_mb:{DEFAULT_MAX_SPLIT_MB}")
    except Exception as exc:  # an allocator without the setting: OOM retry stays off in the pool
        log.info("could not set max_split_size_mb (%s): out-of-memory will not retry after freeing cache", exc)


def _mib(n: int) -> str:
    return f"{n / MIB:.0f} MiB"
