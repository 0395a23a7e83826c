"""The process-wide flexium runtime that init() starts and shutdown() ends."""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flexium import reasons
from flexium.config import (
    ENV_DEVICE,
    SOURCE_DEFAULT,
    SOURCE_PARAMETER,
    FlexiumConfig,
    load_config,
    resolve_device,
)
from flexium.engine.capabilities import Capabilities, detect
from flexium.torch_import import import_torch

if TYPE_CHECKING:  # imported when used: they load the native extension, torch or an HTTP client
    from flexium.client.process import ProcessClient
    from flexium.engine.engine import Engine
    from flexium.engine.fast.memory_pool import MemoryPool

log = logging.getLogger("flexium")


@dataclass
class Runtime:
    config: FlexiumConfig | None
    process_id: str
    logical_device: str  # what the training code uses: "cuda:N", or "cpu" without CUDA
    disabled: bool = False
    capabilities: Capabilities | None = None
    engine: Engine | None = None  # when pause/resume is possible here
    memory_pool: MemoryPool | None = None  # when torch has CUDA
    client: ProcessClient | None = None  # the server connection, when a server is configured
    scopes: int = 0  # open flexium.auto.run() blocks


_lock = threading.RLock()
_runtime: Runtime | None = None
_process_id = f"gpu-{secrets.token_hex(4)}"
_atexit_registered = False


def current() -> Runtime | None:
    return _runtime


def process_id() -> str:
    return _process_id


def is_initialized() -> bool:
    return _runtime is not None


def init(
    server: str | None = None, device: str | None = None, disabled: bool = False, *, priority: str | int | None = None
) -> None:
    with _lock:
        if _runtime is not None:
            log.warning("flexium.init() was already called; this call changes nothing (call shutdown() first)")
            return
        start(server, device, disabled, server_parameter="server", priority=priority)


def start(
    server: str | None,
    device: str | None,
    disabled: bool,
    *,
    server_parameter: str,
    priority: str | int | None = None,
) -> None:
    """Starts the runtime (none may be running); `server_parameter` names `server` in errors as
    the caller's API spells it. `priority`: the job's in the server's queue (protocol.PRIORITIES)."""
    global _runtime
    with _lock:
        assert _runtime is None, "a flexium runtime is already running"
        if disabled:
            _runtime = Runtime(
                config=None, process_id=_process_id, logical_device=resolve_device(device), disabled=True
            )
            return
        config = load_config(orchestrator=server, device=device, priority=priority, server_parameter=server_parameter)
        from flexium._logging import configure_logging

        configure_logging(config.log_level)
        import_torch()
        _runtime = _start(config)
        _register_atexit()


def _start(config: FlexiumConfig) -> Runtime:
    from flexium.engine.fast import checksum, host_copier, host_staging, pinned_budget
    from flexium.engine.transactions import locked_section

    # Settings that are not what they must be are refused before anything starts, not at the first move
    # that reads them (the keeper reads the driver-made memory switch in its own thread, where a bad value
    # would only be logged).
    pinned_budget.budget()
    host_staging.driver_memory_enabled()
    checksum.checksum_enabled()
    for switch in (host_copier.copier_enabled, host_copier.overlap_enabled, host_copier.written_staging_enabled):
        switch()
    host_copier.write_buffer_bytes()
    locked_section.check_report_setting()
    # A driver named explicitly (the simulated host, the tests' fake) runs the engine without
    # torch CUDA, so a CPU-only torch is no problem to warn about there.
    capabilities = detect(check_torch=not _driver_selected_by_env())
    _prepare_job_environment()
    logical_device = _claim_device(config, capabilities)
    runtime = Runtime(config=config, process_id=_process_id, logical_device=logical_device, capabilities=capabilities)
    runtime.memory_pool = _start_memory_pool(config, logical_device, capabilities)
    runtime.engine = _start_engine(logical_device, capabilities, config, runtime.memory_pool)

    from flexium.api import device_routing

    device_routing.install(lambda: runtime.logical_device)
    if not config.local_mode:
        runtime.client = _start_client(runtime)
    _log_start(runtime, capabilities, config)
    return runtime


def _log_start(runtime: Runtime, capabilities: Capabilities, config: FlexiumConfig) -> None:
    """One line says what this job can do. A job that cannot be moved at all (no engine: a CPU
    job, no driver) says the reason that matters most; its other reasons are at DEBUG. A job
    with an engine is told each limit (pause only, no fast path): they are few and each matters."""
    local = ", local mode: no FLEXIUM_SERVER" if config.local_mode else ""
    if runtime.engine is None:
        problems = reasons.most_important_first(capabilities.problems)
        for problem in problems[1:]:
            log.debug("migration and pause are limited: %s", problem)
        more = f" ({len(problems) - 1} more at FLEXIUM_LOG_LEVEL=DEBUG)" if len(problems) > 1 else ""
        log.warning(
            "flexium in degraded mode on %s (process %s%s): %s%s",
            runtime.logical_device,
            _process_id,
            local,
            problems[0] if problems else "migrate and pause are off",
            more,
        )
        return
    for problem in capabilities.problems:
        log.warning("migration and pause are limited: %s", problem)
    pool = runtime.memory_pool
    log.log(
        logging.WARNING if config.local_mode else logging.INFO,
        "flexium ready on %s (process %s, migration %s, fast path %s%s)",
        runtime.logical_device,
        _process_id,
        "on" if capabilities.migration else "off",
        "on" if pool is not None and pool.active else f"off: {pool.reason_off if pool is not None else 'no CUDA'}",
        local,
    )


def _prepare_job_environment() -> None:
    """A process whose NCCL has not started yet gets the settings that let its job be paused and
    moved as a whole (engine/distributed/nccl.py): a rank that torchrun launched, and a process
    that starts its other ranks itself (PyTorch Lightning's rank 0, fact `lightning-ranks-different-parents`), which
    they inherit. NCCL reads them only if the job starts it."""
    from flexium.engine.distributed import membership, nccl

    if not membership.describe().initialized:
        for setting in nccl.prepare_environment():
            log.debug("set %s so that this job can be paused and moved as a whole if it starts NCCL", setting)


def _claim_device(config: FlexiumConfig, capabilities: Capabilities) -> str:
    """The device this process trains on (api/device_choice.py), made torch's current device."""
    from flexium.api.device_choice import choose_device

    if config.device == "cpu":
        return "cpu"
    torch_cuda = capabilities.torch_cuda
    if not torch_cuda and not _driver_selected_by_env():
        return "cpu"
    source = config.sources.get("device", SOURCE_DEFAULT)
    local_rank = os.environ.get("LOCAL_RANK", "")
    if torch_cuda:
        import torch

        visible = torch.cuda.device_count()
        # set_device and any CUDA use initialize CUDA; before that the script has chosen nothing.
        initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # torch leaves it untyped
        script_device = torch.cuda.current_device() if initialized else None
    else:
        visible, script_device = capabilities.gpu_count, None
    choice = choose_device(
        setting=config.device,
        where=_device_origin(source),
        visible=visible,
        script_device=script_device,
        local_rank=int(local_rank) if source == SOURCE_DEFAULT and local_rank.isdigit() else None,
    )
    if choice.warning is not None:
        log.warning("%s", choice.warning)
    if torch_cuda and choice.device != "cpu":
        torch.cuda.set_device(_ordinal(choice.device))
    return choice.device


def _device_origin(source: str) -> str:
    if source == SOURCE_DEFAULT:
        return "the default"
    if source == SOURCE_PARAMETER:
        return "passed in code as device="
    return f"from environment variable {source}" if source == ENV_DEVICE else f"from {source}"


def _ordinal(device: str) -> int:
    """N of the "cuda:N" that config.validate_device already checked."""
    return int(device.split(":", 1)[1])


def _driver_selected_by_env() -> bool:
    # FLEXIUM_LIBCUDA names a driver explicitly (the tests' fake): run the engine without torch CUDA.
    return bool(os.environ.get("FLEXIUM_LIBCUDA"))


def _start_memory_pool(config: FlexiumConfig, logical_device: str, capabilities: Capabilities) -> MemoryPool | None:
    """Routes PyTorch's CUDA memory into our pool before the job allocates any (fact `allocator-routed-to-pool`)."""
    if logical_device == "cpu" or not capabilities.torch_cuda or not capabilities.pause_resume:
        return None
    from flexium.engine.fast.memory_pool import MemoryPool

    pool = MemoryPool()
    if not config.fast_path:
        source = config.sources.get("fast_path", "default")
        pool.reason_off = f"switched off (fast_path false, from {source})"
        return pool
    # The job's own GPU only (fact `pool-on-job-gpu-only`).
    if not pool.install([_ordinal(logical_device)]):
        log.warning("fast path off, migrations and pauses use the driver path: %s", pool.reason_off)
    return pool


def _start_engine(
    logical_device: str, capabilities: Capabilities, config: FlexiumConfig, memory_pool: MemoryPool | None
) -> Engine | None:
    if logical_device == "cpu" or not capabilities.pause_resume:
        return None
    if not (capabilities.torch_cuda or _driver_selected_by_env()):
        return None
    from flexium.engine import Engine, snapshot_gpus
    from flexium.engine.fast.path import FastPath

    engine = Engine(
        logical_ordinal=_ordinal(logical_device),
        gpus=snapshot_gpus(),
        capabilities=capabilities,
        safe_point_wait_seconds=config.safe_point_wait,
        fast_path=FastPath(memory_pool) if memory_pool is not None else None,
    )
    engine.start()
    return engine


def _start_client(runtime: Runtime) -> ProcessClient | None:
    try:
        from flexium.client import start_client
    except ImportError:
        log.warning("a server is configured but this flexium build has no client; running locally")
        return None
    return start_client(runtime)


def shutdown() -> None:
    global _runtime
    with _lock:
        runtime, _runtime = _runtime, None
        if runtime is None or runtime.disabled:
            return
        if runtime.client is not None:
            runtime.client.stop()
        if runtime.engine is not None:
            runtime.engine.stop()
        if runtime.memory_pool is not None:
            # Before any MemPool can be destroyed (at exit): destroying one while routed aborts.
            runtime.memory_pool.uninstall()
        from flexium.api import device_routing

        device_routing.uninstall()


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(shutdown)
        _atexit_registered = True
