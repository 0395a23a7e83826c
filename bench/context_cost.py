"""What makes up the fixed cost of the driver's checkpoint + restore of a CUDA context, and what
can be released or kept out before the checkpoint to shrink it (docs/facts.md fact 12).

    python bench/context_cost.py [--variants bare,torch_init,...] [--repeats 3] [--json out.json]

Each variant runs in a fresh process (this file with --variant NAME) on cuda:0, without
flexium.init(): it calls flexium._C directly. It sets up, synchronizes, reads the GPU memory NVML
shows for its pid on GPU0 (only while the process runs: NVML blocks while it is checkpointed),
then --repeats times runs lock (30 s timeout) -> checkpoint -> restore in place -> unlock through
_C.run_steps (rollbacks: recover, recover, unlock), checks after each round that a small buffer
kept its content, and prints one JSON line. The driver prints a table of medians and a short
section of differences between variants, computed from the numbers of this run.

Variants:
  bare                no torch: flexium._C plus the primary context made current through ctypes
                      (cuInit, cuDevicePrimaryCtxRetain, cuCtxSetCurrent) and a 4 KiB cuMemAlloc
                      buffer: the driver's own minimum
  torch_init          import torch, torch.cuda.init(), one tiny tensor on cuda:0 (no kernel run)
  torch_matmul        torch_init plus fp32 and bf16 matmuls, a bf16 linear with bias (cuBLAS,
                      cuBLASLt, their workspaces) and fp32 / bf16 conv2d (cuDNN)
  matmul_released     torch_matmul, then cublas workspaces cleared, torch.cuda.empty_cache(),
                      synchronize: what torch can hand back before the checkpoint
  matmul_small_stack  matmul_released, then the context's limits lowered through ctypes
                      cuCtxSetLimit: malloc heap 1 MiB, printf FIFO 64 KiB, stack 1 KiB per thread
                      (local memory for the stack is sized by the largest stack any kernel used)
  lazy_loading_off    CUDA_MODULE_LOADING=EAGER (every kernel of every loaded library loaded into
                      the context), then as torch_matmul; every other variant runs with LAZY
  pinned_host_1g      torch_init plus 1 GiB of pinned host memory (torch.empty(pin_memory=True))

MiB are NVML's bytes used by the pid on the GPU (2^20); where NVML does not list the pid (a pid
namespace), the GPU's used memory minus what it used before the process made its context ("~").
Each process dumps its threads' stacks (faulthandler) and exits 10 s before --timeout; the
lazy_loading_off process gets twice --timeout (eager loading is slow). A failed variant is
reported and the others still run; the exit status is non-zero if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import tables
from children import run_child

VARIANTS = (
    "bare",
    "torch_init",
    "torch_matmul",
    "matmul_released",
    "matmul_small_stack",
    "lazy_loading_off",
    "pinned_host_1g",
)
MIB = 1 << 20
LOCK_TIMEOUT_MS = 30000
# CUlimit values (cuda.h)
CU_LIMIT_STACK_SIZE = 0x00
CU_LIMIT_PRINTF_FIFO_SIZE = 0x01
CU_LIMIT_MALLOC_HEAP_SIZE = 0x02
LIMIT_NAMES = {
    CU_LIMIT_STACK_SIZE: "stack_size",
    CU_LIMIT_PRINTF_FIFO_SIZE: "printf_fifo_size",
    CU_LIMIT_MALLOC_HEAP_SIZE: "malloc_heap_size",
}
# What matmul_small_stack sets, in this order (the stack last: it is the one that can be large).
SMALL_LIMITS = (
    (CU_LIMIT_MALLOC_HEAP_SIZE, 1 * MIB),
    (CU_LIMIT_PRINTF_FIFO_SIZE, 64 * 1024),
    (CU_LIMIT_STACK_SIZE, 1024),
)
LIBRARY_MARKERS = (
    "libcuda.so",
    "cudart",
    "cublas",
    "cudnn",
    "nvrtc",
    "nvJitLink",
    "cusparse",
    "cufft",
    "curand",
    "cusolver",
    "nccl",
    "nvshmem",
    "libtorch_cuda",
    "libc10_cuda",
    "nvidia-ml",
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def emit(record: dict[str, Any]) -> None:
    print(json.dumps({"event": "result", **record}), flush=True)


# ---- libcuda through ctypes (the same library flexium._C loads) ----------------------------------


class Cuda:
    """The few driver calls the variants make themselves. FLEXIUM_LIBCUDA (the tests' fake
    driver) is honoured like flexium._C does, so both talk to one library."""

    def __init__(self) -> None:
        import ctypes

        self.ct = ctypes
        lib = ctypes.CDLL(os.environ.get("FLEXIUM_LIBCUDA") or "libcuda.so.1")
        self.lib = lib
        c_int, c_void_p, c_size_t, c_uint64, POINTER = (
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_uint64,
            ctypes.POINTER,
        )
        signatures: dict[str, list[Any]] = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [POINTER(c_int), c_int],
            "cuDevicePrimaryCtxRetain": [POINTER(c_void_p), c_int],
            "cuCtxSetCurrent": [c_void_p],
            "cuCtxGetCurrent": [POINTER(c_void_p)],
            "cuCtxSynchronize": [],
            "cuCtxGetLimit": [POINTER(c_size_t), c_int],
            "cuCtxSetLimit": [c_int, c_size_t],
            "cuMemAlloc_v2": [POINTER(c_uint64), c_size_t],
            "cuMemcpyHtoD_v2": [c_uint64, c_void_p, c_size_t],
            "cuMemcpyDtoH_v2": [c_void_p, c_uint64, c_size_t],
            "cuGetErrorName": [c_int, POINTER(ctypes.c_char_p)],
        }
        for name, argtypes in signatures.items():
            function = getattr(lib, name, None)
            if function is not None:
                function.argtypes = argtypes
                function.restype = c_int

    def error_name(self, code: int) -> str:
        text = self.ct.c_char_p()
        function = getattr(self.lib, "cuGetErrorName", None)
        if function is None or function(code, self.ct.byref(text)) != 0 or not text.value:
            return f"CUresult {code}"
        return text.value.decode()

    def call(self, name: str, *args: Any) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            raise RuntimeError(f"{name} failed: {self.error_name(code)} ({code})")

    def make_primary_current(self, ordinal: int = 0) -> None:
        ct = self.ct
        self.call("cuInit", 0)
        dev = ct.c_int()
        self.call("cuDeviceGet", ct.byref(dev), ordinal)
        ctx = ct.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ct.byref(ctx), dev.value)
        self.call("cuCtxSetCurrent", ctx)

    def ensure_current(self) -> bool:
        """Makes sure this thread has a current context (torch's primary one); True if it had."""
        ctx = self.ct.c_void_p()
        self.call("cuCtxGetCurrent", self.ct.byref(ctx))
        if ctx.value:
            return True
        self.make_primary_current(0)
        return False

    def get_limit(self, limit: int) -> Optional[int]:
        value = self.ct.c_size_t()
        code = self.lib.cuCtxGetLimit(self.ct.byref(value), limit)
        return int(value.value) if code == 0 else None

    def limits(self) -> dict[str, Optional[int]]:
        return {LIMIT_NAMES[k]: self.get_limit(k) for k in LIMIT_NAMES}

    def set_limit(self, limit: int, value: int) -> str:
        code = self.lib.cuCtxSetLimit(limit, value)
        return "ok" if code == 0 else self.error_name(code)


# ---- the worker (one fresh process per variant) --------------------------------------------------


def mapped_libraries() -> dict[str, float]:
    """CUDA-related shared libraries mapped into this process, with their file size in MiB."""
    found: dict[str, float] = {}
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split()
                if len(parts) < 6 or not parts[5].startswith("/"):
                    continue
                path = parts[5]
                name = os.path.basename(path)
                if name in found or ".so" not in name or not any(m in name for m in LIBRARY_MARKERS):
                    continue
                try:
                    found[name] = round(os.path.getsize(path) / MIB, 1)
                except OSError:
                    found[name] = -1.0
    except OSError:
        pass
    return dict(sorted(found.items()))


class Memory:
    """NVML's view of this pid on the GPU behind cuda:0 (read only while the process runs)."""

    def __init__(self, nvml: Any, uuid: str, pid: int) -> None:
        self.nvml, self.uuid, self.pid = nvml, uuid, pid
        gpu = nvml.gpu_by_uuid(uuid)
        self.baseline_used = gpu.memory_used if gpu is not None else None
        self.nvml_index = gpu.index if gpu is not None else None

    def read(self, label: str) -> dict[str, Any]:
        gpu = self.nvml.gpu_by_uuid(self.uuid)
        if gpu is None:
            return {"stage": label, "pid_mib": None, "device_delta_mib": None}
        used = gpu.used_by(self.pid)
        return {
            "stage": label,
            "pid_mib": None if used is None else round(used / MIB, 1),
            "device_delta_mib": None
            if self.baseline_used is None
            else round((gpu.memory_used - self.baseline_used) / MIB, 1),
        }


class Setup:
    """What a variant built: checks run after each round (copies only, no kernels) and after all."""

    def __init__(self) -> None:
        self.info: dict[str, Any] = {}
        self.limits_set: dict[str, Any] = {}
        self.round_check: Callable[[], bool] = lambda: True
        self.final_checks: Callable[[], dict[str, Any]] = dict
        self.synchronize: Callable[[], None] = lambda: None
        self.release: Optional[Callable[[], None]] = None
        self.lower_limits = False


def setup_bare(cuda: Cuda, setup: Setup) -> None:
    ct = cuda.ct
    cuda.make_primary_current(0)
    size = 4096
    pattern = bytes((i * 7 + 3) % 256 for i in range(size))
    source = ct.create_string_buffer(pattern, size)
    address = ct.c_uint64()
    cuda.call("cuMemAlloc_v2", ct.byref(address), size)
    cuda.call("cuMemcpyHtoD_v2", address.value, ct.cast(source, ct.c_void_p), size)
    cuda.call("cuCtxSynchronize")

    def check() -> bool:
        back = ct.create_string_buffer(size)
        cuda.call("cuMemcpyDtoH_v2", ct.cast(back, ct.c_void_p), address.value, size)
        return back.raw == pattern

    setup.round_check = check
    setup.synchronize = lambda: cuda.call("cuCtxSynchronize")


def setup_torch(setup: Setup, *, libraries: bool, pinned_bytes: int = 0) -> Any:
    import torch

    torch.cuda.init()
    torch.cuda.set_device(0)
    device = torch.device("cuda:0")
    expected = torch.arange(4096, dtype=torch.float32) * 0.5 + 3.0
    tiny = expected.to(device)  # a host-to-device copy: no kernel
    torch.cuda.synchronize()
    setup.synchronize = torch.cuda.synchronize
    setup.info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(0))
    checks: list[Callable[[], bool]] = [lambda: bool(torch.equal(tiny.cpu(), expected))]

    if pinned_bytes:
        pinned = torch.empty(pinned_bytes, dtype=torch.uint8, pin_memory=True)
        stride = max(1, pinned_bytes // 1024)
        marks = (torch.arange(len(range(0, pinned_bytes, stride)), dtype=torch.int64) % 251).to(torch.uint8)
        pinned[::stride] = marks
        setup.info.update(pinned_bytes=pinned_bytes, pinned_is_pinned=bool(pinned.is_pinned()))
        checks.append(lambda: bool(torch.equal(pinned[::stride], marks)))

    if libraries:
        g = torch.Generator(device=device)
        g.manual_seed(0)
        a = torch.randn(1024, 1024, device=device, generator=g)
        product = a @ a  # fp32: cuBLAS
        ab = a.bfloat16()
        bias = torch.randn(1024, device=device, generator=g).bfloat16()
        half = ab @ ab  # bf16 gemm
        linear = torch.nn.functional.linear(ab, ab, bias)  # addmm with a bias: the cuBLASLt path
        image = torch.randn(8, 3, 64, 64, device=device, generator=g)
        weight = torch.randn(16, 3, 3, 3, device=device, generator=g)
        conv = torch.nn.functional.conv2d(image, weight, padding=1)  # cuDNN
        conv_half = torch.nn.functional.conv2d(image.bfloat16(), weight.bfloat16(), padding=1)
        torch.cuda.synchronize()
        finite = all(bool(torch.isfinite(t).all()) for t in (product, half, linear, conv, conv_half))
        del ab, bias, half, linear, image, weight, conv, conv_half
        setup.info.update(
            cudnn=torch.backends.cudnn.version(),
            blas_library=str(torch.backends.cuda.preferred_blas_library())
            if hasattr(torch.backends.cuda, "preferred_blas_library")
            else None,
            results_finite=finite,
        )

        def final() -> dict[str, Any]:
            again = a @ a  # runs kernels again after the last round: the context still computes
            torch.cuda.synchronize()
            return {
                "matmul_close_after_restore": bool(torch.allclose(again, product, rtol=1e-5, atol=1e-4)),
                "matmul_bit_identical_after_restore": bool(torch.equal(again, product)),
            }

        setup.final_checks = final

    def release() -> None:
        torch.cuda.synchronize()
        done = []
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
            done.append("clearCublasWorkspaces")
        torch.cuda.empty_cache()
        done.append("empty_cache")
        torch.cuda.synchronize()
        setup.info["released"] = done

    setup.release = release
    setup.round_check = lambda: all(check() for check in checks)
    setup.info["torch_reserved_mib_setup"] = round(torch.cuda.memory_reserved(0) / MIB, 1)
    return torch


def run_rounds(_C: Any, pid: int, repeats: int, setup: Setup) -> tuple[list[dict[str, Any]], Optional[str]]:
    steps = [
        _C.Step(_C.StepKind.LOCK, timeout_ms=LOCK_TIMEOUT_MS),
        _C.Step(_C.StepKind.CHECKPOINT),
        _C.Step(_C.StepKind.RESTORE),
        _C.Step(_C.StepKind.UNLOCK),
    ]
    recover = [_C.Step(_C.StepKind.RECOVER)]
    rollbacks = [[], recover, recover, [_C.Step(_C.StepKind.UNLOCK)]]
    rounds: list[dict[str, Any]] = []
    for index in range(repeats):
        started = time.perf_counter()
        outcomes = list(_C.run_steps(pid, steps, rollbacks))
        wall = time.perf_counter() - started
        state = _C.process_state(pid)
        record: dict[str, Any] = {
            "round": index,
            "wall_s": wall,
            "state": state.name,
            "outcomes": [
                {"step": o.step, "rollback": o.rollback, "code": o.code, "error": o.error_name, "seconds": o.seconds}
                for o in outcomes
            ],
        }
        for o in outcomes:
            if not o.rollback and o.code == 0:
                record[f"{o.step}_s"] = o.seconds
        rounds.append(record)
        failed = [o for o in outcomes if o.code != 0]
        if failed or state != _C.ProcessState.RUNNING:
            first = failed[0] if failed else None
            what = f"{first.step}: {first.error_name} ({first.code}) {first.error_text}" if first else "no step failed"
            return rounds, f"round {index}: {what}; the process is {state.name}"
        started = time.perf_counter()
        setup.synchronize()
        record["intact"] = setup.round_check()
        record["first_use_s"] = time.perf_counter() - started
        if not record["intact"]:
            return rounds, f"round {index}: the buffer's content changed across checkpoint + restore"
    return rounds, None


def median_of(rounds: list[dict[str, Any]], key: str) -> Optional[float]:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


def worker(args: argparse.Namespace) -> int:
    import faulthandler

    faulthandler.enable()
    faulthandler.dump_traceback_later(max(5.0, args.timeout - 10), exit=True)
    variant = args.variant
    # Before anything calls cuInit (flexium._C does below): the driver reads it there.
    if variant == "lazy_loading_off":
        os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    else:
        os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    result: dict[str, Any] = {
        "variant": variant,
        "ok": False,
        "pid": os.getpid(),
        "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING"),
    }
    running = True
    _C: Any = None
    try:
        from flexium import _C
        from flexium.engine import nvml

        pid = os.getpid()
        devices = _C.list_devices()
        if not devices:
            raise RuntimeError("the driver lists no GPU")
        dev0 = devices[0]
        result.update(
            gpu_uuid=dev0.uuid,
            gpu_name=dev0.name,
            driver=nvml.driver_version(),
            cuda_driver=_C.driver_status().cuda_version,
        )
        if not nvml.available():
            raise RuntimeError(f"NVML is needed for the memory figures: {nvml.unavailable_reason()}")
        memory = Memory(nvml, dev0.uuid, pid)  # before any context of ours exists
        result["nvml_index"] = memory.nvml_index
        stages: list[dict[str, Any]] = []
        result["stages"] = stages
        cuda = Cuda()
        setup = Setup()
        torch = None

        started = time.perf_counter()
        if variant == "bare":
            setup_bare(cuda, setup)
        elif variant == "torch_init":
            torch = setup_torch(setup, libraries=False)
        elif variant in ("torch_matmul", "lazy_loading_off"):
            torch = setup_torch(setup, libraries=True)
        elif variant == "matmul_released":
            torch = setup_torch(setup, libraries=True)
        elif variant == "matmul_small_stack":
            torch = setup_torch(setup, libraries=True)
            setup.lower_limits = True
        elif variant == "pinned_host_1g":
            torch = setup_torch(setup, libraries=False, pinned_bytes=1 << 30)
        else:
            raise RuntimeError(f"unknown variant {variant}")
        setup.synchronize()
        result["setup_s"] = time.perf_counter() - started
        result["had_current_context"] = cuda.ensure_current()
        result["limits_after_setup"] = cuda.limits()
        stages.append(memory.read("after setup"))

        if variant in ("matmul_released", "matmul_small_stack"):
            assert setup.release is not None
            setup.release()
            stages.append(memory.read("after release"))
        if setup.lower_limits:
            before = cuda.limits()
            setup.limits_set = {LIMIT_NAMES[k]: {"to": v, "result": cuda.set_limit(k, v)} for k, v in SMALL_LIMITS}
            setup.synchronize()
            result["limits_lowered"] = {"before": before, "set": setup.limits_set, "after": cuda.limits()}
            stages.append(memory.read("after limits lowered"))
        if torch is not None:
            result["torch_reserved_mib"] = round(torch.cuda.memory_reserved(0) / MIB, 1)
            result["torch_allocated_mib"] = round(torch.cuda.memory_allocated(0) / MIB, 1)
        result["libraries"] = mapped_libraries()
        result["limits_before_checkpoint"] = cuda.limits()
        setup.synchronize()
        before = memory.read("before checkpoint")
        stages.append(before)
        result["mib_before"] = before["pid_mib"] if before["pid_mib"] is not None else before["device_delta_mib"]
        result["mib_source"] = "pid" if before["pid_mib"] is not None else "device delta"

        rounds, error = run_rounds(_C, pid, args.repeats, setup)
        result["rounds"] = rounds
        running = _C.process_state(pid) == _C.ProcessState.RUNNING
        for key in ("lock", "checkpoint", "restore", "unlock", "first_use"):
            result[f"{key}_s"] = median_of(rounds, f"{key}_s")
        if error is not None:
            result["error"] = error
        else:
            result["mib_after_rounds"] = memory.read("after rounds")
            result["limits_after_rounds"] = cuda.limits()
            result["final_checks"] = setup.final_checks()
            failed_checks = [k for k, v in result["final_checks"].items() if v is False and "bit_identical" not in k]
            if failed_checks:
                result["error"] = f"after the rounds: {', '.join(failed_checks)} failed"
            else:
                result["ok"] = True
        result["info"] = setup.info
    except BaseException as exc:  # report, never hang: the driver reads the JSON line
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        if _C is not None:
            try:  # the checkpoint API answers in any state
                running = _C.process_state(os.getpid()) == _C.ProcessState.RUNNING
            except Exception:
                pass
    emit(result)
    if not running:
        os._exit(1)  # a process that is not RUNNING would hang in any CUDA call at exit
    return 0 if result["ok"] else 1


# ---- the driver ----------------------------------------------------------------------------------


def variant_timeout(variant: str, timeout: float) -> float:
    return timeout * 2 if variant == "lazy_loading_off" else timeout


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    timeout = variant_timeout(variant, args.timeout)
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--variant",
        variant,
        "--repeats",
        str(args.repeats),
        "--timeout",
        str(timeout),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("FLEXIUM_SERVER", None)
    env["CUDA_MODULE_LOADING"] = "EAGER" if variant == "lazy_loading_off" else "LAZY"
    return run_child(argv, env, timeout).result(failed={"variant": variant}, timeout=timeout)


def fmt(value: Optional[float], digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def total_of(r: dict[str, Any]) -> Optional[float]:
    c, s = r.get("checkpoint_s"), r.get("restore_s")
    return None if c is None or s is None else c + s


def spread_of(r: dict[str, Any]) -> Optional[float]:
    totals = [
        x["checkpoint_s"] + x["restore_s"]
        for x in r.get("rounds", [])
        if x.get("checkpoint_s") is not None and x.get("restore_s") is not None
    ]
    return max(totals) - min(totals) if len(totals) > 1 else None


def mib_text(r: dict[str, Any]) -> str:
    if r.get("mib_before") is None:
        return "-"
    return ("" if r.get("mib_source") == "pid" else "~") + f"{r['mib_before']:.0f}"


def print_table(results: list[dict[str, Any]]) -> None:
    columns = (
        "variant",
        "MiB on GPU",
        "torch MiB",
        "checkpoint s",
        "restore s",
        "total s",
        "spread s",
        "1st use ms",
        "status",
    )
    rows = []
    for r in results:
        first = r.get("first_use_s")
        rows.append(
            (
                r["variant"],
                mib_text(r),
                "-" if r.get("torch_reserved_mib") is None else f"{r['torch_reserved_mib']:.0f}",
                fmt(r.get("checkpoint_s")),
                fmt(r.get("restore_s")),
                fmt(total_of(r)),
                fmt(spread_of(r)),
                "-" if first is None else f"{first * 1e3:.1f}",
                "ok" if r.get("ok") else "FAILED",
            )
        )
    tables.print_table(columns, rows)
    print(
        "MiB on GPU: NVML, this pid on GPU0 just before the first checkpoint (~: GPU used minus before the "
        "context). torch MiB: torch.cuda.memory_reserved. checkpoint / restore: median of the rounds; spread: "
        "max - min of checkpoint + restore over the rounds; 1st use: synchronize + copy-back check after unlock."
    )


def print_details(results: list[dict[str, Any]]) -> None:
    print()
    print("details")
    for r in results:
        print(f"  {r['variant']}:")
        if not r.get("ok"):
            print(f"    FAILED: {r.get('error')}")
        stages = ", ".join(
            f"{s['stage']} {'-' if s.get('pid_mib') is None else s['pid_mib']} MiB"
            + ("" if s.get("device_delta_mib") is None else f" (GPU +{s['device_delta_mib']})")
            for s in r.get("stages", [])
        )
        if stages:
            print(f"    memory: {stages}")
        after = r.get("mib_after_rounds")
        if after:
            print(f"    after the rounds: {after.get('pid_mib')} MiB (GPU +{after.get('device_delta_mib')})")
        rounds = r.get("rounds", [])
        if rounds:
            per = "; ".join(
                f"{fmt(x.get('lock_s'), 4)} / {fmt(x.get('checkpoint_s'))} / {fmt(x.get('restore_s'))} / "
                f"{fmt(x.get('unlock_s'), 4)}"
                for x in rounds
            )
            print(f"    rounds, lock / checkpoint / restore / unlock s: {per}")
        if r.get("limits_before_checkpoint"):
            print(f"    limits before checkpoint (bytes): {r['limits_before_checkpoint']}")
        lowered = r.get("limits_lowered")
        if lowered:
            print(f"    limits lowered: before {lowered['before']} -> set {lowered['set']} -> after {lowered['after']}")
        if r.get("limits_after_rounds") and r.get("limits_after_rounds") != r.get("limits_before_checkpoint"):
            print(f"    limits after the rounds: {r['limits_after_rounds']}")
        info = r.get("info") or {}
        if info:
            print(f"    info: {json.dumps(info)}")
        if r.get("final_checks"):
            print(f"    checks after the rounds: {r['final_checks']}")
        if r.get("libraries"):
            print(
                "    CUDA libraries mapped (file MiB): "
                + ", ".join(f"{name} {size:g}" for name, size in r["libraries"].items())
            )
        if r.get("setup_s") is not None:
            print(
                f"    setup {r['setup_s']:.2f} s, CUDA_MODULE_LOADING={r.get('cuda_module_loading')}, "
                f"process {r.get('wall_s', 0):.1f} s"
            )
        if not r.get("ok") and r.get("stderr_tail"):
            print("    stderr tail:")
            for text in r["stderr_tail"].rstrip().splitlines()[-30:]:
                print(f"      {text}")


def fit(points: list[tuple[float, float]]) -> Optional[tuple[float, float, float]]:
    """Least squares y = a + b x; (a, b, r^2), or None with fewer than 3 points or one x."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    if sxx <= 0:
        return None
    b = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx
    a = my - b * mx
    syy = sum((p[1] - my) ** 2 for p in points)
    residual = sum((p[1] - a - b * p[0]) ** 2 for p in points)
    return a, b, (1 - residual / syy) if syy > 0 else 1.0


def analysis(results: list[dict[str, Any]]) -> list[str]:
    ok = {r["variant"]: r for r in results if r.get("ok") and total_of(r) is not None}
    spreads = [s for s in (spread_of(r) for r in ok.values()) if s is not None]
    noise = max(spreads) if spreads else 0.0
    lines: list[str] = []

    def diff(new: str, old: str, what: str) -> None:
        if new not in ok or old not in ok:
            return
        a, b = ok[new], ok[old]
        dt = total_of(a) - total_of(b)  # type: ignore[operator]
        dc = a["checkpoint_s"] - b["checkpoint_s"]
        dr = a["restore_s"] - b["restore_s"]
        dm = (
            (a["mib_before"] - b["mib_before"])
            if a.get("mib_before") is not None and b.get("mib_before") is not None
            else None
        )
        mib = "" if dm is None else f"{dm:+.0f} MiB, "
        tag = f" (within the rounds' largest spread, {noise:.3f} s)" if abs(dt) <= noise else ""
        lines.append(f"{what} ({new} vs {old}): {mib}{dt:+.3f} s in all (checkpoint {dc:+.3f}, restore {dr:+.3f}){tag}")

    if "bare" in ok:
        b = ok["bare"]
        mib = "" if b.get("mib_before") is None else f"{b['mib_before']:.0f} MiB, "
        lines.append(
            f"the driver's own minimum (bare): {mib}checkpoint {b['checkpoint_s']:.3f} s + restore "
            f"{b['restore_s']:.3f} s = {total_of(b):.3f} s"
        )
        for name in ("torch_matmul", "torch_init"):
            if name in ok:
                share = total_of(b) / total_of(ok[name]) if total_of(ok[name]) else None  # type: ignore[operator]
                if share is not None:
                    lines.append(
                        f"bare is {share:.0%} of {name}'s checkpoint + restore; the rest comes with what "
                        f"{name} adds to the context"
                    )
                break
    diff("torch_init", "bare", "torch's runtime context over the bare driver context")
    diff("torch_matmul", "torch_init", "cuBLAS / cuBLASLt / cuDNN kernels and workspaces")
    diff("matmul_released", "torch_matmul", "clearing cuBLAS workspaces + empty_cache")
    diff("matmul_small_stack", "matmul_released", "lowering stack / heap / printf limits")
    diff("matmul_small_stack", "torch_matmul", "everything released and lowered")
    diff("lazy_loading_off", "torch_matmul", "eager module loading (every kernel loaded) over lazy")
    diff("pinned_host_1g", "torch_init", "1 GiB of pinned host memory")

    lowered = ok.get("matmul_small_stack", {}).get("limits_lowered")
    if lowered:
        before = lowered["before"].get("stack_size")
        after = lowered["after"].get("stack_size")
        result = lowered["set"].get("stack_size", {}).get("result")
        lines.append(f"stack limit per thread: {before} -> {after} bytes (cuCtxSetLimit: {result})")
    for name, r in ok.items():
        stages = [s for s in r.get("stages", []) if s.get("pid_mib") is not None]
        if len(stages) > 2 and stages[0]["stage"] == "after setup":
            steps = ", ".join(f"{s['stage']} {s['pid_mib']:.0f}" for s in stages)
            if len({s["pid_mib"] for s in stages}) > 1:
                lines.append(f"{name} MiB by stage: {steps}")

    # Does the cost follow the memory? Fit over the variants without pinned host memory.
    points = [
        (r["mib_before"] / 1024, r) for n, r in ok.items() if n != "pinned_host_1g" and r.get("mib_before") is not None
    ]
    if len({round(p[0], 3) for p in points}) >= 3:
        for key, label in (("checkpoint_s", "checkpoint"), ("restore_s", "restore")):
            line = fit([(gib, r[key]) for gib, r in points])
            if line is None:
                continue
            intercept, slope, r2 = line
            rate = f", i.e. {1 / slope * 1.073741824:.1f} GB/s" if slope > 0 else ""
            lines.append(
                f"{label} s ~ {intercept:.3f} + {slope:.3f} x GiB on GPU (least squares over {len(points)} "
                f"variants, r^2 {r2:.2f}{rate})"
            )
        line = fit([(gib, r["checkpoint_s"] + r["restore_s"]) for gib, r in points])
        if line is not None and "torch_matmul" in ok and ok["torch_matmul"].get("mib_before") is not None:
            intercept, slope, r2 = line
            t = total_of(ok["torch_matmul"])
            part = slope * ok["torch_matmul"]["mib_before"] / 1024
            lines.append(
                f"for torch_matmul the fit gives {part:.3f} s proportional to its GPU memory + {intercept:.3f}"
                f" s fixed = {part + intercept:.3f} s (measured {fmt(t)} s)"
            )
    best = [n for n in ("matmul_released", "matmul_small_stack") if n in ok]
    if best and "torch_matmul" in ok:
        name = min(best, key=lambda n: total_of(ok[n]))  # type: ignore[arg-type,return-value]
        whole = total_of(ok["torch_matmul"])
        saved = whole - total_of(ok[name])  # type: ignore[operator]
        lines.append(
            f"best release found: {name} saves {saved:.3f} s of torch_matmul's checkpoint + restore "
            f"({saved / whole:.0%})"  # type: ignore[operator]
        )
    if noise:
        lines.append(
            f"largest spread of checkpoint + restore over the rounds of one variant: {noise:.3f} s; smaller "
            "differences are noise"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma list (default all): {', '.join(VARIANTS)}"
    )
    parser.add_argument("--repeats", type=int, default=3, help="checkpoint + restore rounds per variant (default 3)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=120,
        help="seconds per variant process before it is killed (default 120; lazy_loading_off 2x)",
    )
    parser.add_argument("--json", type=Path, help="write every raw result here")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # worker mode
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.variant:
        return worker(args)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"unknown variant(s) {', '.join(unknown) or '(none given)'}: choose from {', '.join(VARIANTS)}")

    started = time.perf_counter()
    results = []
    for variant in variants:
        log(f"-- {variant} ...")
        result = run_variant(variant, args)
        results.append(result)
        if result.get("ok"):
            log(
                f"   {mib_text(result)} MiB, checkpoint {fmt(result.get('checkpoint_s'))} s, "
                f"restore {fmt(result.get('restore_s'))} s ({result['wall_s']:.1f} s)"
            )
        else:
            log(f"!! {variant} failed: {result.get('error')}")
    print_table(results)
    print_details(results)
    print()
    print("what this says (computed from this run)")
    lines = analysis(results)
    for line in lines or ["(not enough successful variants to compare)"]:
        print(f"  - {line}")
    failures = [f"{r['variant']}: {r.get('error')}" for r in results if not r.get("ok")]
    elapsed = time.perf_counter() - started
    print(f"{len(results)} variants in {elapsed:.0f} s" + (f"; FAILED: {'; '.join(failures)}" if failures else ""))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "results": results,
                    "analysis": lines,
                    "failures": failures,
                    "seconds": elapsed,
                    "repeats": args.repeats,
                },
                indent=1,
            )
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
