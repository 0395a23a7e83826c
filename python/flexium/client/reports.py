"""What this process tells the server about itself: the bodies of register, heartbeat and
the process and result parts of a command report (``flexium.wire`` models).

Hazard: while the engine has the process locked or checkpointed (MIGRATING, PAUSING, PAUSED,
RESUMING), any CUDA call, torch.cuda.* included, blocks until it runs again. Nothing here
touches torch or CUDA unless the engine says RUNNING; NVML goes through ``nvml.host_gpus()``,
which reads from a child process while the process is frozen.
"""

from __future__ import annotations

import getpass
import logging
import os
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from flexium import protocol, wire
from flexium.api.progress import PROGRESS, TrainingProgress
from flexium.client.contracts import EngineControl, TrainingProcess
from flexium.client.host import reported_host
from flexium.engine import nvml, torch_bridge
from flexium.engine.distributed import job_operation, membership
from flexium.engine.operations import EngineState, GpuIdentity, OperationResult

log = logging.getLogger("flexium.client")

_STATE_ON_WIRE: dict[EngineState, wire.ProcessState] = {
    EngineState.RUNNING: "RUNNING",
    EngineState.MIGRATING: "MIGRATING",
    EngineState.PAUSING: "PAUSING",
    EngineState.PAUSED: "PAUSED",
    EngineState.RESUMING: "RESUMING",
    EngineState.FAILED: "FAILED",  # a rollback failed: the server refuses its commands
}


def _short(text: object, limit: int = protocol.MAX_SHORT_TEXT) -> str:
    """`text` as the wire takes it: valid Unicode (an argument or a file name that is not UTF-8
    is kept with U+FFFD where its bytes were), within `limit`."""
    return wire.clean_text(str(text or ""))[:limit]


def _placement_id() -> int | None:
    """The placement ``flexium run`` started this job with, whose held room it takes."""
    text = os.environ.get(protocol.PLACEMENT_ENV, "")
    return int(text) if text.isdigit() and 0 < int(text) < 2**31 else None


def _process_started_at() -> float | None:
    """When this process started (Linux: /proc), so the dashboard shows the job's age, not
    the age of its flexium connection."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _torch_version() -> str:
    torch = sys.modules.get("torch")
    if torch is not None:
        return _short(getattr(torch, "__version__", ""))
    try:
        from importlib.metadata import version

        return _short(version("torch"))
    except Exception:  # not installed, or metadata unreadable: nothing to report
        return ""


def _user() -> str:
    try:
        return _short(getpass.getuser())
    except Exception:  # no passwd entry in some containers
        return _short(os.getuid())


def body_seq() -> int:
    """``seq`` of a body (see ``wire.HeartbeatRequest``), taken before its state is read: the
    monotonic clock grows across every client this process (or host, until a reboot, when
    the job registers afresh anyway) ever runs, where a counter would restart with a new one."""
    return time.monotonic_ns()


@dataclass(frozen=True)
class GpuReading:
    """The host's GPUs as NVML read them, with the ``seq`` taken just before the read, which a
    body built from them carries. An operation may end between the read (during it, with the
    process checkpointed: none of its memory anywhere) and the body: the server must then take
    the body for what it is, older than the operation's final report (``wire.HeartbeatRequest``)."""

    seq: int
    gpus: list[nvml.HostGpu]

    @classmethod
    def take(cls) -> GpuReading:
        seq = body_seq()
        return cls(seq, nvml.host_gpus())


def visible_gpus(engine: EngineControl) -> list[str]:
    """The job's GPU UUIDs in its CUDA ordinal order, as it was at init: ``cuda:N`` is entry N
    (``wire.cuda_ordinal``), on the server and here alike."""
    return [gpu.uuid for gpu in sorted(engine.gpus, key=lambda gpu: gpu.ordinal)]


def gpu_reports(gpus: list[nvml.HostGpu], pid: int | None = None) -> list[wire.GpuReport]:
    """Every GPU of the host; with `pid`, what that process holds on each."""
    reports: list[wire.GpuReport] = []
    for gpu in gpus[: protocol.MAX_DEVICES]:
        utilization = gpu.utilization_percent
        reports.append(
            wire.GpuReport(
                uuid=_short(gpu.uuid),
                index=int(gpu.index),
                name=_short(gpu.name),
                memory_total=int(gpu.memory_total),
                memory_used=int(gpu.memory_used),
                utilization=None if utilization is None else max(0, min(100, int(utilization))),
                temperature=None if gpu.temperature_c is None else int(gpu.temperature_c),
                # What NVML says, "unknown" included: the server refuses only a known-bad health.
                health=_short(gpu.health),
                process_bytes=None if pid is None else gpu.used_by(pid),
            )
        )
    return reports


class ProcessReporter:
    """Builds the bodies from the training process's flexium state (process id, devices,
    capabilities) and its engine (state, placement, memory). Called from the client's
    threads only."""

    def __init__(self, training: TrainingProcess, progress: TrainingProgress = PROGRESS) -> None:
        self.training = training
        self.progress = progress
        self.engine = training.engine
        self.pid = os.getpid()
        self.host = reported_host()
        self.started_at = _process_started_at() or time.time()
        self._last_memory = 0

    # ---- state and placement: pure Python, safe at any time ---------------------------------

    def state(self) -> wire.ProcessState:
        if self.engine is None:
            return "RUNNING"
        return _STATE_ON_WIRE.get(self.engine.state, "RUNNING")

    def placement(self) -> wire.ProcessUpdate:
        """Where the process is, or paused from: its GPU's UUID (None without an engine). The
        server derives the index and ``cuda:N`` it shows from it (and from ``visible_gpus``)."""
        if self.engine is None:
            return wire.ProcessUpdate(gpu_uuid=None)
        _, gpu = self.engine.placement()
        return wire.ProcessUpdate(gpu_uuid=_short(gpu.uuid))

    def capabilities(self) -> wire.ProcessCapabilities:
        caps = self.training.capabilities
        report = (
            wire.ProcessCapabilities()
            if caps is None
            else wire.ProcessCapabilities(
                driver_version=caps.driver_version,
                driver_major=caps.driver_major,
                cuda_version=caps.cuda_version,
                checkpoint_api=caps.checkpoint_api,
                torch_cuda=caps.torch_cuda,
                gpu_count=caps.gpu_count,
                pause_resume=caps.pause_resume,
                migration=caps.migration,
                problems=[_short(problem, protocol.MAX_LONG_TEXT) for problem in caps.problems],
            )
        )
        if self.engine is None:
            # Whatever the driver allows, without the engine this process cannot act on commands.
            report.pause_resume = False
            report.migration = False
            report.problems = [
                *report.problems,
                "flexium's engine is not running in this process (training on "
                f"{self.training.logical_device}): migrate, pause and resume are off",
            ]
        job = membership.describe()
        if job.multi_process:
            # Read now, not at init: the job may start its process group after flexium.init().
            # A paused job keeps what it had: the server refuses a resume without pause_resume.
            problem = job_operation.job_problem(job)
            report.nccl = job.uses_nccl if job.initialized else None
            report.job_operations = problem is None or self.state() == "PAUSED"
            if not report.job_operations:
                report.pause_resume = False
                report.migration = False
                report.problems = [
                    *report.problems,
                    _short(
                        f"this process is {job.describe_rank()}, and the job cannot be paused or moved as a whole: "
                        f"{problem}",
                        protocol.MAX_LONG_TEXT,
                    ),
                ]
        pool = getattr(self.training, "memory_pool", None)
        report.fast_path = bool(self.engine is not None and pool is not None and pool.active)
        report.fast_path_problem = (
            None
            if report.fast_path
            else (pool.reason_off if pool is not None else "no CUDA memory pool in this process (no CUDA torch)")
        )
        return report

    # ---- measurements -----------------------------------------------------------------------

    def memory(self, gpus: list[nvml.HostGpu] | None = None) -> tuple[int, int | None]:
        """(bytes held on GPUs now, bytes needed on a GPU). The second is None while an
        operation runs: asking would mean touching the frozen process."""
        engine = self.engine
        if engine is None:
            held = self._held_by_pid(gpus)
            if held is None:
                held = torch_bridge.reserved_bytes()
            return held, held
        state = engine.state
        if state == EngineState.RUNNING:
            held = int(engine.process_bytes())
            self._last_memory = held
            return held, held
        if state in (EngineState.PAUSED, EngineState.FAILED):
            return 0, int(engine.footprint_bytes())
        return self._last_memory, None

    def _held_by_pid(self, gpus: list[nvml.HostGpu] | None) -> int | None:
        found = None
        for gpu in gpus if gpus is not None else nvml.host_gpus():
            used = gpu.used_by(self.pid)
            if used is not None:
                found = (found or 0) + used
        return found

    # ---- bodies -----------------------------------------------------------------------------

    def register_body(self, reading: GpuReading) -> wire.RegisterRequest:
        from flexium import __version__

        memory, footprint = self.memory(reading.gpus)
        placement = self.placement()
        engine = self.engine
        caps = self.training.capabilities
        return wire.RegisterRequest(
            process_id=self.training.process_id,
            host=self.host,
            user=_user(),
            pid=self.pid,
            gpu_uuid=placement.gpu_uuid,
            gpu_model="" if engine is None else _short(engine.placement()[1].name),
            logical_device=_short(self.training.logical_device),
            visible_gpus=[] if engine is None else [_short(uuid) for uuid in visible_gpus(engine)],
            torch_version=_torch_version(),
            driver_version=_short(caps.driver_version if caps is not None else ""),
            flexium_version=_short(__version__),
            capabilities=self.capabilities(),
            memory_bytes=memory,
            footprint_bytes=footprint,
            state=self.state(),
            started_at=self.started_at,
            cmdline=_short(
                " ".join(shlex.quote(a) for a in getattr(sys, "orig_argv", sys.argv)), protocol.MAX_LONG_TEXT
            ),
            devices=gpu_reports(reading.gpus, self.pid),
            seq=reading.seq,
            job=job_membership(),
            priority=self.training.config.priority if self.training.config is not None else None,
            placement_id=_placement_id(),
            **self._progress(),
        )

    def heartbeat_body(self, reading: GpuReading) -> wire.HeartbeatRequest:
        memory, footprint = self.memory(reading.gpus)
        body = wire.HeartbeatRequest(
            state=self.state(),
            memory_bytes=memory,
            devices=gpu_reports(reading.gpus, self.pid),
            seq=reading.seq,
            **_stated(self.placement()),
            **self._progress(),
        )
        if footprint is not None:
            body.footprint_bytes = footprint
        return body

    def _progress(self) -> dict[str, Any]:
        """steps and loss when known: a body leaves out what it does not know, so the server
        keeps what it has (an older client sends neither)."""
        said: dict[str, Any] = {}
        self.progress.hook_if_ready()  # the job may import torch after flexium.init()
        steps, loss = self.progress.steps, self.progress.loss
        if steps is not None:
            said["steps"] = min(steps, protocol.MAX_INT)
        if loss is not None:
            said["loss"] = loss
        return said

    def process_update(self) -> wire.ProcessUpdate:
        seq = body_seq()
        memory, _ = self.memory()
        return wire.ProcessUpdate(state=self.state(), memory_bytes=memory, seq=seq, **_stated(self.placement()))


def job_membership() -> wire.JobMembership | None:
    """This process's job and rank for the server, None for a single-process job."""
    job = membership.describe()
    if not job.multi_process or job.rank is None or job.world_size is None:
        return None
    return wire.JobMembership(
        key=_short(membership.job_key()),
        rank=job.rank,
        world_size=job.world_size,
        local_rank=job.local_rank,
        local_world_size=job.local_world_size,
        node_rank=job.group_rank,
    )


def operation_report(result: OperationResult) -> wire.OperationReport | None:
    """The one conversion of the engine's result to the wire; None (with a warning) when it
    does not fit the wire's limits: the outcome itself must reach the server whatever its
    details hold."""
    try:
        return wire.OperationReport(
            kind=result.kind.value,
            path=result.path,
            ok=result.ok,
            logical_device=result.logical_device,
            source=_operation_gpu(result.source),
            target=None if result.target is None else _operation_gpu(result.target),
            steps=[
                wire.StepReport(
                    step=s.step,
                    seconds=s.seconds,
                    ok=s.ok,
                    rollback=s.rollback,
                    error=None if s.error is None else _short(s.error, protocol.MAX_LONG_TEXT),
                )
                for s in result.steps
            ],
            bytes_moved=result.bytes_moved,
            seconds=result.seconds,
            failed_step=result.failed_step,
            error=None if result.error is None else _short(result.error, protocol.MAX_LONG_TEXT),
            notes=[_short(note, protocol.MAX_LONG_TEXT) for note in result.notes],
        )
    except ValidationError as exc:
        log.warning("the operation's result is left out of the report: %s", exc.errors()[0]["msg"])
        return None


def _operation_gpu(gpu: GpuIdentity) -> wire.OperationGpu:
    return wire.OperationGpu(
        ordinal=gpu.ordinal,
        uuid=gpu.uuid,
        name=gpu.name,
        total_memory=gpu.total_memory,
        pci_bus_id=gpu.pci_bus_id,
        nvml_index=gpu.nvml_index,
    )


def _stated(update: wire.ProcessUpdate) -> dict[str, Any]:
    """The fields ``update`` states, None included (None = no GPU)."""
    return {name: getattr(update, name) for name in update.model_fields_set}
