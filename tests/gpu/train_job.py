"""A real training job for the GPU tests and the benchmark: one JSON line per event on stdout.

    python train_job.py --ballast-gb 4 --steps 60 --plan 10:migrate:cuda:1 --plan 20:pause --plan 20:resume:cuda:0

A control thread (standing in for flexium's server connection) runs each planned operation once
the training loop has passed that step, and reports its result with an NVML reading of where the
job's memory is. The loss trace is printed bit-exactly (float.hex) for comparison between runs.

A plan item may end in "@fast", "@driver" or "@auto" to ask that path for that operation
(default: --path). Feature flags make the job use what real training jobs use, each in a
deterministic way, so two runs with the same flags give the same loss trace bit for bit:
--amp (fp16 autocast + GradScaler), --checkpointing (activation checkpointing of a block),
--side-stream (a second CUDA stream feeding the forward), --dataloader (worker processes,
pinned memory, non-blocking copies), --cuda-graph (a CUDA graph captured before any move and
replayed every step). --stall-at N --stall-seconds S keeps step N from reaching its optimizer
step (the safe point) for S seconds.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.utils.checkpoint  # noqa: E402
import torch.utils.data  # noqa: E402

import flexium  # noqa: E402
from flexium.api import runtime as flexium_runtime  # noqa: E402
from flexium.engine import nvml  # noqa: E402
from flexium.engine.fast import pinned_budget  # noqa: E402

BATCH = 1024
PATHS = ("auto", "fast", "driver")
# The DataLoader's dataset: this many batches, read cyclically.
DATASET_BATCHES = 8
# The CUDA graph's static computation: GRAPH_ROWS x min(GRAPH_WIDTH, --width).
GRAPH_ROWS = 64
GRAPH_WIDTH = 256


def emit(event: str, **data: object) -> None:
    print(json.dumps({"event": event, **data}), flush=True)


def placement_snapshot() -> dict[str, object]:
    pid = os.getpid()
    return {
        gpu.uuid: {"index": gpu.index, "ours": gpu.used_by(pid) or 0, "used": gpu.memory_used}
        for gpu in nvml.host_gpus()
    }


def engine_target(engine: Any, name: Optional[str]) -> Any:
    """The engine takes a GPU UUID or a GpuIdentity; a plan names GPUs as a person would tell the
    server, "cuda:N" in the job's own numbering at init, which the server resolves the same way."""
    if name is None or not name.startswith("cuda:"):
        return name
    return engine.gpus[int(name[len("cuda:") :])]


PlanItem = tuple[int, str, Optional[str], Optional[str]]  # step, op, target, path (None: --path)


class Control(threading.Thread):
    def __init__(self, plan: list[PlanItem], pause_seconds: float, progress: "Progress", path: str = "auto") -> None:
        super().__init__(daemon=True, name="test-control")
        self.plan = plan
        self.pause_seconds = pause_seconds
        self.progress = progress
        self.path = path
        self.filler: Optional[subprocess.Popen[bytes]] = None
        self.last_paused_bytes = 0
        self.armed = False

    def run(self) -> None:
        engine = flexium_runtime.current().engine
        for at_step, op, target, path in self.plan:
            path = path or self.path
            self.progress.wait_for(at_step)
            if op == "occupy":
                self.occupy(target or "0")
                continue
            if op == "vacate":
                self.vacate()
                continue
            if op == "arm":
                self.arm(engine, engine_target(engine, target))
                continue
            started = time.perf_counter()
            emit("op_start", op=op, target=target, at_step=at_step, step=self.progress.step, requested_path=path)
            try:
                if op == "migrate":
                    result = engine.migrate(engine_target(engine, target), path=path)
                elif op == "pause":
                    result = engine.pause(path=path)
                else:
                    result = engine.resume(engine_target(engine, target))
                # A fast move's copies become the job's own over the next optimizer steps; NVML
                # counts them for this process from then on.
                own_wait = wait_for_own_memory(30.0) if op == "migrate" and result.path == "fast" else 0.0
                emit(
                    "op",
                    op=op,
                    target=target,
                    ok=True,
                    wall=time.perf_counter() - started,
                    own_wait=own_wait,
                    requested_path=path,
                    path=result.path,
                    result=result.to_dict(),
                    nvml=placement_snapshot(),
                    physical=flexium.auto.get_physical_device(),
                    logical=flexium.auto.get_device(),
                )
                if op == "pause":
                    self.last_paused_bytes = result.bytes_moved
                    time.sleep(self.pause_seconds)
            except Exception as exc:  # reported, and training must go on
                failed = getattr(exc, "result", None)
                emit(
                    "op",
                    op=op,
                    target=target,
                    ok=False,
                    error_type=type(exc).__name__,
                    error=str(exc),
                    step=getattr(exc, "step", None),
                    state=engine.state.value,
                    requested_path=path,
                    result=failed.to_dict() if failed is not None else None,
                    nvml=placement_snapshot(),
                    physical=flexium.auto.get_physical_device(),
                )
        self.vacate()
        emit("control_done")

    def occupy(self, leave: str) -> None:
        """Another process takes the job's GPU (where it is now), leaving ``leave`` GiB free ("+G":
        what the last pause took off the GPU plus G GiB), as a job handed the GPU of a paused one
        would: tests/gpu/fill_gpu.py, until vacate()."""
        leave_gib = float(leave) + (self.last_paused_bytes / (1 << 30) if leave.startswith("+") else 0.0)
        here = flexium_runtime.current().engine.placement()[1].uuid
        filler = Path(__file__).with_name("fill_gpu.py")
        self.filler = subprocess.Popen(
            [sys.executable, str(filler), "0", str(leave_gib)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": here},
        )
        assert self.filler.stdout is not None
        emit("occupied", **json.loads(self.filler.stdout.readline()), nvml=placement_snapshot())

    def arm(self, engine: Any, gpu: Any) -> None:
        """Another process, its context made on `gpu`, takes all but 1 GiB of it the moment the next
        operation starts (MIGRATING): while the job is being checkpointed, after the target check."""
        filler = Path(__file__).with_name("fill_gpu.py")
        self.filler = subprocess.Popen(
            [sys.executable, str(filler), "0", "1", "armed"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuid},
        )
        assert self.filler.stdin is not None and self.filler.stdout is not None
        json.loads(self.filler.stdout.readline())  # its context is made
        stdin, fired = self.filler.stdin, threading.Event()

        def fire(state: Any) -> None:
            if state.value == "MIGRATING" and not fired.is_set():
                fired.set()
                stdin.write(b"\n")
                stdin.flush()

        engine.add_state_listener(fire)
        self.armed = True
        emit("armed", gpu=gpu.uuid)

    def vacate(self) -> None:
        filler, self.filler = self.filler, None
        if filler is not None:
            assert filler.stdin is not None and filler.stdout is not None
            # An armed filler says what it took once it has fired; one that filled at once said it then.
            if self.armed:  # fired already or not: a line makes it fill (again harmless) and say so
                filler.stdin.write(b"\n")
                filler.stdin.flush()
            filled = filler.stdout.readline() if self.armed else ""
            self.armed = False
            filler.stdin.close()
            emit("vacated", exit=filler.wait(timeout=60), filled=json.loads(filled) if filled else None)


def wait_for_own_memory(timeout: float) -> Optional[float]:
    """Seconds until no imported memory is left (None: still some after `timeout`)."""
    from flexium import _C

    started = time.perf_counter()
    while _C.vmm_imported_count() > 0:
        if time.perf_counter() - started > timeout:
            return None
        time.sleep(0.005)
    return time.perf_counter() - started


class Progress:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.step = -1

    def advance(self, step: int) -> None:
        with self._cond:
            self.step = step
            self._cond.notify_all()

    def wait_for(self, step: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.step >= step)


def send_cuda_tensor(queue: Any, done: Any, floats: int) -> None:
    """A spawned process that sends a CUDA tensor through torch.multiprocessing and keeps it (the
    sender must outlive the receiver's use) until `done` is set."""
    tensor = torch.zeros(floats, device="cuda")
    queue.put(tensor)
    done.wait(600)


class HeldMemory:
    """4 MiB that the driver's checkpoint cannot carry, written by a kernel: "host-cumem", cuMem
    memory on the host mapped for the GPU and the CPU (as NCCL makes it; docs/facts.md fact 26, the
    allocation bench/probes/host_memory_restore.py measured), "managed", cuMemAllocManaged (as bitsandbytes'
    paged optimizers make it; fact 27), or "cuda-ipc", a CUDA tensor another process sent through
    torch.multiprocessing (fact 29). flexium refuses to checkpoint a process holding any of them."""

    FLOATS = 1 << 20

    def __init__(self, kind: str) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "probes"))
        from cuda_driver import Driver
        from host_memory_restore import DeviceView, mapped_host_memory

        self.kind = kind
        if kind == "host-cumem":
            self.pointer, _host, self.keep = mapped_host_memory("cumem-host", self.FLOATS * 4)
        elif kind == "cuda-ipc":
            import torch.multiprocessing as mp

            context = mp.get_context("spawn")
            queue, self.done = context.Queue(), context.Event()
            self.sender = context.Process(target=send_cuda_tensor, args=(queue, self.done, self.FLOATS))
            self.sender.start()
            self.received = queue.get(timeout=120)
            self.pointer = self.received.data_ptr()
        else:
            address = ctypes.c_uint64()
            allocate = Driver().lib.cuMemAllocManaged
            allocate.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_uint]
            assert allocate(ctypes.byref(address), self.FLOATS * 4, 1) == 0  # CU_MEM_ATTACH_GLOBAL
            self.pointer = address.value
        self.view = (
            self.received
            if kind == "cuda-ipc"
            else torch.as_tensor(DeviceView(self.pointer, self.FLOATS), device="cuda")
        )
        self.view.fill_(1.0)
        torch.cuda.synchronize()
        emit("memory_held", kind=kind, address=self.pointer)

    def free(self) -> bool:
        """Frees it; whether it still held what the kernel wrote."""
        from cuda_driver import Driver
        from host_memory_restore import free_cumem_host

        intact = self.view.sum().item() == self.FLOATS
        del self.view
        torch.cuda.synchronize()
        if self.kind == "host-cumem":
            free_cumem_host(self.pointer, self.keep)
        elif self.kind == "cuda-ipc":
            del self.received  # the last reference: torch closes the import
            self.done.set()
            self.sender.join(60)
        else:
            Driver().call("cuMemFree", self.pointer)
        return intact


def parse_plan(items: list[str]) -> list[PlanItem]:
    """ "STEP:OP[:TARGET][@PATH]", e.g. "10:migrate:cuda:1@fast", "20:pause", "20:resume:cuda:0";
    "20:occupy:1" (another process takes the job's GPU, leaving 1 GiB free; "20:occupy:+0.2": what
    the last pause took off it plus 0.2 GiB), "20:arm:cuda:1" (another process takes all but 1 GiB of
    that GPU the moment the next operation starts) and "20:vacate"."""
    plan: list[PlanItem] = []
    for item in items:
        path = None
        if "@" in item:
            item, path = item.rsplit("@", 1)
            if path not in PATHS:
                raise SystemExit(f"plan item {item}@{path}: the path must be one of {', '.join(PATHS)}")
        step, op, *rest = item.split(":", 2)
        plan.append((int(step), op, rest[0] if rest else None, path))
    return plan


# ---- the DataLoader's side: runs in worker processes, which must never touch CUDA -------------


class IndexedRows(torch.utils.data.Dataset):
    """Row i is a fixed function of i (its own seeded CPU generator): any worker, any order,
    the same batch."""

    def __init__(self, length: int, width: int, batch_delay: float = 0.0) -> None:
        self.length = length
        self.width = width
        self.batch_delay = batch_delay

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.batch_delay and index % BATCH == 0:
            time.sleep(self.batch_delay)  # a slow input pipeline: batches still arrive while paused
        generator = torch.Generator()
        generator.manual_seed(10_000 + index)
        return torch.randn(self.width, generator=generator)


def _worker_init(_worker_id: int) -> None:
    # Spawned fresh, with CUDA not initialized: hiding every GPU keeps the worker off CUDA for good.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)


class Batches:
    """Batches from a DataLoader (2 spawned workers, pinned memory), cyclically, copied to the
    device with non_blocking=True."""

    def __init__(self, width: int, device: str, batch_delay: float = 0.0) -> None:
        self.device = device
        self.loader = torch.utils.data.DataLoader(
            IndexedRows(DATASET_BATCHES * BATCH, width, batch_delay),
            batch_size=BATCH,
            shuffle=False,
            drop_last=True,
            num_workers=2,
            pin_memory=True,
            persistent_workers=True,
            multiprocessing_context="spawn",
            worker_init_fn=_worker_init,
            prefetch_factor=2,
        )
        self._iterator: Any = iter(self.loader)

    def next(self) -> torch.Tensor:
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._iterator = iter(self.loader)
            batch = next(self._iterator)
        return batch.to(self.device, non_blocking=True)

    def close(self) -> None:
        shutdown = getattr(self._iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._iterator = None


# ---- the other features --------------------------------------------------------------------


class SideStream:
    """f = tanh(x @ proj) on a second stream from x made on the main stream; the main stream
    waits for it and the forward uses x + 0.1 f, so a lost or early f changes the loss."""

    def __init__(self, width: int, device: str) -> None:
        generator = torch.Generator(device=device)
        generator.manual_seed(2)
        self.proj = torch.randn(width, width, device=device, generator=generator) / width**0.5
        self.stream = torch.cuda.Stream(device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            f = torch.tanh(x @ self.proj)
        x.record_stream(self.stream)  # x was made on main and is read on the side stream
        main.wait_stream(self.stream)
        f.record_stream(main)  # f was made on the side stream and is read on main
        return x + 0.1 * f


class Graph:
    """A CUDA graph of a small fixed module, captured before training (warm-up on a side stream
    first, as PyTorch's docs require) and replayed each step on step-dependent input."""

    def __init__(self, width: int, device: str) -> None:
        cols = min(GRAPH_WIDTH, width)
        self.cols = cols
        self.module = torch.nn.Sequential(torch.nn.Linear(cols, cols), torch.nn.Tanh(), torch.nn.Linear(cols, 1)).to(
            device
        )
        self.static_in = torch.zeros(GRAPH_ROWS, cols, device=device)
        warmup = torch.cuda.Stream(device=device)
        warmup.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(warmup):
            for _ in range(3):
                self.module(self.static_in)
        torch.cuda.current_stream().wait_stream(warmup)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.static_out = self.module(self.static_in)
        torch.cuda.synchronize()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.static_in.copy_(x[:GRAPH_ROWS, : self.cols])
        self.graph.replay()
        return self.static_out.sum()


def pool_status() -> dict[str, object]:
    session = flexium_runtime.current()
    pool = getattr(session, "memory_pool", None) if session is not None else None
    engine = getattr(session, "engine", None) if session is not None else None
    blocker_of: Optional[Callable[[], Optional[str]]] = getattr(engine, "fast_path_blocker", None)
    try:
        blocker = blocker_of() if blocker_of is not None else "no engine"
    except Exception as exc:  # reported, not fatal
        blocker = f"fast_path_blocker raised {type(exc).__name__}: {exc}"
    return {
        "pool_active": bool(getattr(pool, "active", False)) if pool is not None else False,
        "pool_reason": getattr(pool, "reason_off", None) if pool is not None else "no memory pool in the session",
        "fast_path_blocker": blocker,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ballast-gb", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--plan", action="append", default=[], help="STEP:OP[:TARGET][@auto|fast|driver]")
    parser.add_argument("--pause-seconds", type=float, default=1.0)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--step-sleep", type=float, default=0.02, help="keeps the loop from outrunning the plan")
    parser.add_argument("--no-flexium", action="store_true")
    parser.add_argument("--hang-seconds", type=float, default=300, help="dump every thread's stack and exit")
    parser.add_argument("--path", choices=PATHS, default="auto", help="path for migrate and pause")
    parser.add_argument("--amp", action="store_true", help="fp16 autocast and a GradScaler")
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of the first block")
    parser.add_argument("--side-stream", action="store_true", help="a second CUDA stream feeds the forward")
    parser.add_argument("--dataloader", action="store_true", help="input from a DataLoader with 2 workers")
    parser.add_argument("--batch-delay", type=float, default=0.0, help="seconds a DataLoader worker takes per batch")
    parser.add_argument("--cuda-graph", action="store_true", help="a CUDA graph captured before training")
    parser.add_argument("--stall-at", type=int, default=-1, help="this step sleeps before its optimizer step")
    parser.add_argument("--stall-seconds", type=float, default=0.0)
    parser.add_argument(
        "--hold-memory",
        metavar="KIND:STEP",
        help="hold 4 MiB that the checkpoint cannot carry (host-cumem or managed; facts.md facts 26 and 27) "
        "from before training until this step",
    )
    parser.add_argument(
        "--alloc-before-init",
        type=float,
        default=0.0,
        metavar="MB",
        help="allocate this many MB on cuda:0 before flexium.init() (kept alive)",
    )
    args = parser.parse_args()

    faulthandler.dump_traceback_later(args.hang_seconds, exit=True)
    torch.use_deterministic_algorithms(True)
    early: Optional[torch.Tensor] = None
    if args.alloc_before_init > 0:
        early = torch.full((int(args.alloc_before_init * (1 << 20)) // 4,), 1.5, dtype=torch.float32, device="cuda:0")
        torch.cuda.synchronize()
    if args.no_flexium:
        flexium.init(disabled=True)
    else:
        flexium.init()
    device = flexium.auto.get_device()

    torch.manual_seed(0)
    generator = torch.Generator(device=device)
    generator.manual_seed(1)
    ballast = torch.empty(int(args.ballast_gb * (1 << 30)) // 4, dtype=torch.float32, device=device)
    ballast.normal_(generator=generator)
    checksum = ballast[::4097].double().sum().item()
    width = args.width
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
    ).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first_block, head = model[:2], model[2]

    features = [
        name for name in ("amp", "checkpointing", "side_stream", "dataloader", "cuda_graph") if getattr(args, name)
    ]
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=8) if args.amp else None
    side = SideStream(width, device) if args.side_stream else None
    graph = Graph(width, device) if args.cuda_graph else None
    batches = Batches(width, device, args.batch_delay) if args.dataloader else None

    def forward(inp: torch.Tensor) -> torch.Tensor:
        if args.checkpointing:
            hidden = torch.utils.checkpoint.checkpoint(first_block, inp, use_reentrant=False)
            return head(hidden)
        return model(inp)

    torch.cuda.synchronize()
    emit(
        "ready",
        pid=os.getpid(),
        device=device,
        uuid=str(torch.cuda.get_device_properties(device).uuid),
        migration=flexium.auto.is_migration_enabled(),
        process_id=flexium.auto.get_process_id(),
        reserved=torch.cuda.memory_reserved(),
        nvml=placement_snapshot(),
        features=features,
        requested_path=args.path,
        **pool_status(),
    )

    held_kind, _, held_until = (args.hold_memory or "").partition(":")
    held = HeldMemory(held_kind) if held_kind else None
    progress = Progress()
    control = Control(parse_plan(args.plan), args.pause_seconds, progress, args.path)
    if args.plan:
        control.start()
    losses = []
    last = time.perf_counter()
    max_gap = 0.0
    for step in range(args.steps):
        if batches is not None:
            x = batches.next()
        else:
            x = torch.randn(BATCH, width, device=device, generator=generator)
        inp = side(x) if side is not None else x
        if scaler is not None:
            with torch.autocast("cuda", dtype=torch.float16):
                out = forward(inp)
            loss = (out.float() - x).pow(2).mean()
        else:
            loss = (forward(inp) - x).pow(2).mean()
        if graph is not None:
            loss = loss + 1e-3 * graph(x)
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if step == args.stall_at:
            emit("stall", step=step, seconds=args.stall_seconds)
            time.sleep(args.stall_seconds)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        value = loss.item()
        losses.append(value.hex())
        now = time.perf_counter()
        max_gap = max(max_gap, now - last)
        last = now
        if held is not None and step == int(held_until):
            # What the keeper of a kept-ready pause did while the job held it, and the host memory
            # this process kept pinned for a pause meanwhile (none: its pause would be refused).
            keeper = flexium_runtime.current().engine._keeper
            keeper_note = keeper.note if keeper is not None else None
            kept_pinned = sum(h.bytes for h in pinned_budget.holders() if h.pid == os.getpid())
            emit("memory_freed", step=step, intact=held.free(), keeper_note=keeper_note, kept_pinned=kept_pinned)
            held = None
        progress.advance(step)
        if step == 0:
            emit("first_step")  # a command from now on finds its safe point
        time.sleep(args.step_sleep)
    if args.plan:
        control.join(timeout=600)
    intact = ballast[::4097].double().sum().item() == checksum
    extra: dict[str, object] = {}
    if early is not None:
        extra["early_ok"] = early.double().sum().item() == early.numel() * 1.5
    if scaler is not None:
        extra["amp_scale"] = scaler.get_scale()
    if batches is not None:
        batches.close()
    emit(
        "done",
        losses=losses,
        ballast_ok=intact,
        max_gap=max_gap,
        physical=flexium.auto.get_physical_device(),
        nvml=placement_snapshot(),
        **extra,
        **pool_status(),
    )
    flexium.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
