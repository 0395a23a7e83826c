"""train_job.py's control thread: runs the plan's operations in order, each once the training loop
has passed its step, as flexium's server connection runs a command: the engine's migrate, pause and
resume (at a safe point they run inside the training thread's optimizer.step()), and another
process taking GPU memory (occupy, arm, vacate: fill_gpu.py beside this file)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from job_events import emit, physical_device, placement_snapshot
from job_plan import PlanItem, Progress

FILL_GPU = Path(__file__).with_name("fill_gpu.py")
# A fast move's copies become the job's own over the next optimizer steps (NVML counts them for
# this process from then on): the next operation waits for that, this long at most.
OWN_MEMORY_WAIT_S = 60.0
# The keeper makes a 64 GiB job's staging in 15-35 s (fact `driver-made-host-memory`), after the pool settled.
KEPT_WAIT_S = 120.0
# What an armed filler may take to fill its GPU once fired (it fills within milliseconds).
FILL_WAIT_S = 60.0


def engine_target(engine: Any, name: str | None) -> Any:
    """The engine takes a GPU UUID or a GpuIdentity; a plan names GPUs as a person would tell the
    server, "cuda:N" in the job's own numbering at init, which the server resolves the same way."""
    if name is None or not name.startswith("cuda:"):
        return name
    return engine.gpus[int(name[len("cuda:") :])]


def wait_for_own_memory(timeout: float) -> float | None:
    """Seconds until no imported memory is left (None: still some after `timeout`)."""
    from flexium import _C

    started = time.perf_counter()
    while _C.vmm_imported_count() > 0:
        if time.perf_counter() - started > timeout:
            return None
        time.sleep(0.005)
    return time.perf_counter() - started


class Control(threading.Thread):
    """``settle_steps``: the steps the job trains after an operation (a pause's resume included)
    before the next one starts, even when the next one's step has passed meanwhile (the benchmark
    reads a resume's downtime from the second step after it)."""

    def __init__(
        self, plan: list[PlanItem], progress: Progress, *, path: str, pause_seconds: float, settle_steps: int
    ) -> None:
        super().__init__(daemon=True, name="job-control")
        self.plan = plan
        self.progress = progress
        self.path = path
        self.pause_seconds = pause_seconds
        self.settle_steps = settle_steps
        self.records: list[dict[str, Any]] = []
        self.finished = threading.Event()
        self.engine_state: str | None = None
        self.filler: subprocess.Popen[bytes] | None = None
        self.armed = False
        self.fired: dict[str, Any] | None = None  # what an armed filler took when it fired
        self.last_paused_bytes = 0

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.finished.set()

    def _run(self) -> None:
        from flexium.api import runtime

        current = runtime.current()
        engine = current.engine if current is not None else None
        settled = -1
        for item in self.plan:
            at_step = self.progress.wait_for_item(item, settled)
            if item.op == "occupy":
                self.occupy(engine, item.arg or "0")
            elif item.op == "vacate":
                self.vacate()
            elif item.op == "arm":
                self.arm(engine, engine_target(engine, item.arg))
            elif item.op == "kept":
                self.wait_kept(engine, float(item.arg or KEPT_WAIT_S))
            else:
                record = self.operate(engine, item, at_step)
                if item.op == "pause" and record["ok"]:
                    time.sleep(self.pause_seconds)
                else:
                    settled = self.progress.step + self.settle_steps
        self.vacate()
        if engine is not None:
            if engine.state.value == "PAUSED":  # a resume failed: once more in place, else the loop never ends
                try:
                    engine.resume()
                except Exception as exc:
                    emit("warning", message=f"the job stayed paused after the plan: {exc}")
            self.engine_state = engine.state.value
        emit("control_done")

    def wait_kept(self, engine: Any, timeout: float) -> None:
        """Until the keeper says it keeps the staging pinned ("keeps ..."), at most `timeout` s; the
        "kept" event says how long it took and what the keeper said (a pause after a timeout makes its
        own staging, which the benchmark's rows then show)."""
        keeper = getattr(engine, "_keeper", None)
        started = time.perf_counter()
        while keeper is not None and not (keeper.note or "").startswith("keeps "):
            if time.perf_counter() - started > timeout:
                break
            time.sleep(0.05)
        note = keeper.note if keeper is not None else "no keeper"
        emit("kept", seconds=round(time.perf_counter() - started, 3), note=note, step=self.progress.step)

    def operate(self, engine: Any, item: PlanItem, at_step: int) -> dict[str, Any]:
        """Runs one of the engine's operations; its record, also printed as the "op" event."""
        import flexium

        path = item.path or self.path
        emit("op_start", op=item.op, target=item.arg, at_step=at_step, step=self.progress.step, requested_path=path)
        record: dict[str, Any] = {"op": item.op, "target": item.arg, "at_step": at_step, "requested_path": path}
        record["t0"] = time.perf_counter()
        try:
            if engine is None:
                raise RuntimeError("flexium has no engine in this process (disabled, or no capability)")
            if item.op == "migrate":
                result = engine.migrate(engine_target(engine, item.arg), path=path)
            elif item.op == "pause":
                result = engine.pause(path=path)
            else:
                result = engine.resume(engine_target(engine, item.arg))
            record["t1"] = time.perf_counter()
            record.update(ok=True, path=result.path, result=result.to_dict())
            if item.op == "pause":
                self.last_paused_bytes = result.bytes_moved
            if item.op in ("migrate", "resume"):  # a fast resume's memory comes from the copier, imported too
                record["own_wait"] = wait_for_own_memory(OWN_MEMORY_WAIT_S)
        except Exception as exc:  # reported; the job goes on with the rest of the plan
            record["t1"] = time.perf_counter()
            failed = getattr(exc, "result", None)
            record.update(
                ok=False,
                error_type=type(exc).__name__,
                error=str(exc),
                step=getattr(exc, "step", None),
                state=engine.state.value if engine is not None else None,
                result=failed.to_dict() if failed is not None else None,
            )
        record.update(
            wall=record["t1"] - record["t0"],
            nvml=placement_snapshot(),
            physical=physical_device(),
            logical=flexium.auto.get_device(),
        )
        self.records.append(record)
        emit("op", **record)
        return record

    def occupy(self, engine: Any, leave: str) -> None:
        """Another process takes the job's GPU (where it is now), leaving ``leave`` GiB free ("+G":
        what the last pause took off the GPU plus G GiB), as a job handed the GPU of a paused one
        would, until vacate()."""
        leave_gib = float(leave) + (self.last_paused_bytes / (1 << 30) if leave.startswith("+") else 0.0)
        here = engine.placement()[1].uuid
        self.filler = subprocess.Popen(
            [sys.executable, str(FILL_GPU), "0", str(leave_gib)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": here},
        )
        assert self.filler.stdout is not None
        emit("occupied", **json.loads(self.filler.stdout.readline()), nvml=placement_snapshot())

    def arm(self, engine: Any, gpu: Any) -> None:
        """Another process, its context made on `gpu`, takes all but 1 GiB of it the moment the next
        operation starts (MIGRATING), after the target check; the operation goes on to lock and
        checkpoint the job only once the filler says it has (its state listener waits for that), so
        the memory is gone before the restore however the two processes are scheduled. A filler that
        says nothing within FILL_WAIT_S lets it go on: the "filled" event then says so."""
        self.filler = subprocess.Popen(
            [sys.executable, str(FILL_GPU), "0", "1", "--armed"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuid},
        )
        assert self.filler.stdin is not None and self.filler.stdout is not None
        json.loads(self.filler.stdout.readline())  # its context is made
        stdin, stdout, fired = self.filler.stdin, self.filler.stdout, threading.Event()

        def fire(state: Any) -> None:
            if state.value == "MIGRATING" and not fired.is_set():
                fired.set()
                stdin.write(b"\n")
                stdin.flush()
                ready, _, _ = select.select([stdout], [], [], FILL_WAIT_S)
                line = stdout.readline() if ready else b""
                self.fired = json.loads(line) if line else None
                emit("filled", filled=self.fired, within_s=FILL_WAIT_S)

        engine.add_state_listener(fire)
        self.armed = True
        emit("armed", gpu=gpu.uuid)

    def vacate(self) -> None:
        filler, self.filler = self.filler, None
        if filler is not None:
            assert filler.stdin is not None and filler.stdout is not None
            # An armed filler says what it took once it has fired; one that filled at once said it then.
            filled = self.fired
            if self.armed and filled is None:  # not fired: a line makes it fill and say so
                filler.stdin.write(b"\n")
                filler.stdin.flush()
                line = filler.stdout.readline()
                filled = json.loads(line) if line else None
            self.armed, self.fired = False, None
            filler.stdin.close()
            emit("vacated", exit=filler.wait(timeout=60), filled=filled)
