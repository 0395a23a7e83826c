"""The benchmark's training job: times every step and runs a plan of moves; JSON lines on stdout.

    python bench/bench_job.py --gb 16 --plan 10:migrate:fast:cuda:1 --plan 20:migrate:driver:cuda:0 \
        --plan 30:pause:fast --plan 30:resume
    python bench/bench_job.py --gb 16 --no-flexium --plan 10:handmove:cuda:1
    python bench/bench_job.py --measure-bandwidth

The job (seeded) trains an MLP with AdamW on cuda:0 beside a ballast of random data, sized so
that the training state (parameters, gradients, AdamW moments, ballast) is about --gb GiB. It
records time.perf_counter() at the start and at the end of every step (each step ends with
loss.item(), so its GPU work is done).

Plan items, STEP:OP[:...], run once the loop has finished step STEP (+STEPS:OP[:...]: STEPS steps
after the operation before it returned):
  STEP:migrate:PATH:TARGET   engine.migrate(TARGET, path=PATH)   PATH: auto | fast | driver; TARGET: cuda:N or a UUID
  STEP:pause[:PATH]          engine.pause(path=PATH); then --pause-seconds of sleep
  STEP:resume[:TARGET]       engine.resume(TARGET)    (in place without TARGET)
  STEP:handmove:TARGET       on the training thread at the start of step STEP: model, AdamW
                             state and ballast .to(TARGET), synchronize, old tensors dropped,
                             empty_cache(): the move a user writes by hand (use --no-flexium)
Engine operations are called from a control thread (as flexium's server connection does); at a
safe point they run inside the training thread's optimizer.step().

Events: ready (after the warm-up steps: state bytes), op (each operation as it returns: t0, when
the control thread made the call (the request), and t1, when it returned, on the perf_counter
clock; its OperationResult as a dict), done (step_starts, step_ends, the median normal step, and
per operation the step it ran in and its downtime, and for a pause how training went while it
prepared before its safe point; see analyse()).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import statistics
import sys
import threading
import time
from typing import Any, Optional

GIB = 1 << 30
ENGINE_OPS = ("migrate", "pause", "resume")
PATHS = ("auto", "fast", "driver")
SETTLE_STEPS = 3  # steps run after an operation before the next one starts
AFTER_STEPS = 20  # steps after a move whose extra time counts as the move's (after_extra)


_emit_lock = threading.Lock()


def emit(event: str, **data: Any) -> None:
    line = json.dumps({"event": event, **data}) + "\n"
    with _emit_lock:  # one write per line: the control and training threads both report
        sys.stdout.write(line)
        sys.stdout.flush()


# ---- the plan ---------------------------------------------------------------------------------


def parse_plan(items: list[str]) -> list[dict[str, Any]]:
    plan = []
    for item in items:
        parts = item.split(":", 2)
        relative = parts[0].startswith("+")
        if len(parts) < 2 or not parts[0].removeprefix("+").isdigit():
            raise SystemExit(f"bad plan item {item!r}: STEP:OP[:...] or +STEPS:OP[:...]")
        step, op, rest = int(parts[0].removeprefix("+")), parts[1], parts[2] if len(parts) > 2 else ""
        entry: dict[str, Any] = {"at_step": 0 if relative else step, "op": op, "path": None, "target": None}
        if relative:
            if op == "handmove":
                raise SystemExit(f"bad plan item {item!r}: a handmove needs its step: STEP:handmove:cuda:N")
            entry["after"] = step
        if op == "migrate":
            path, _, target = rest.partition(":")
            if path not in PATHS or not target:
                raise SystemExit(f"bad plan item {item!r}: STEP:migrate:PATH:TARGET, PATH one of {PATHS}")
            entry.update(path=path, target=target)
        elif op == "pause":
            path = rest or "auto"
            if path not in PATHS:
                raise SystemExit(f"bad plan item {item!r}: STEP:pause[:PATH], PATH one of {PATHS}")
            entry["path"] = path
        elif op == "resume":
            entry["target"] = rest or None
        elif op == "handmove":
            if not rest:
                raise SystemExit(f"bad plan item {item!r}: STEP:handmove:cuda:N")
            entry.update(path="hand", target=rest)
        else:
            raise SystemExit(f"bad plan item {item!r}: unknown operation {op!r}")
        plan.append(entry)
    return plan


def engine_target(engine: Any, name: Optional[str]) -> Any:
    """The engine takes a GPU UUID or a GpuIdentity; a plan names GPUs as a person would tell the
    server, "cuda:N" in the job's own numbering at init, which the server resolves the same way."""
    if name is None or not name.startswith("cuda:"):
        return name
    return engine.gpus[int(name[len("cuda:") :])]


class Progress:
    """The last finished step, for the control thread to wait on."""

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


class Control(threading.Thread):
    """Runs the plan's engine operations in order, each once the loop has passed its step."""

    def __init__(
        self, plan: list[dict[str, Any]], pause_seconds: float, progress: Progress, records: list[dict[str, Any]]
    ) -> None:
        super().__init__(daemon=True, name="bench-control")
        self.plan = plan
        self.pause_seconds = pause_seconds
        self.progress = progress
        self.records = records
        self.finished = threading.Event()
        self.engine_state: Optional[str] = None

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.finished.set()

    def _run(self) -> None:
        from flexium.api import runtime

        current = runtime.current()
        engine = current.engine if current is not None else None
        settled = 0
        for entry in self.plan:
            # A resume's downtime ends with the second step after it (analyse): the next operation
            # waits for those steps even when its own step has passed meanwhile.
            if "after" in entry:  # +STEPS: counted from the end of the operation before
                entry["at_step"] = self.progress.step + entry["after"]
            self.progress.wait_for(max(entry["at_step"], settled))
            record: dict[str, Any] = {
                "op": entry["op"],
                "requested_path": entry["path"],
                "target": entry["target"],
                "at_step": entry["at_step"],
            }
            record["t0"] = time.perf_counter()
            try:
                if engine is None:
                    raise RuntimeError("flexium has no engine in this process (disabled, or no capability)")
                if entry["op"] == "migrate":
                    result = engine.migrate(engine_target(engine, entry["target"]), path=entry["path"])
                elif entry["op"] == "pause":
                    result = engine.pause(path=entry["path"])
                else:
                    result = engine.resume(engine_target(engine, entry["target"]))
                record["t1"] = time.perf_counter()
                record.update(ok=True, result=result.to_dict())
            except Exception as exc:  # reported; the job goes on with the rest of the plan
                record["t1"] = time.perf_counter()
                failed = getattr(exc, "result", None)
                record.update(
                    ok=False,
                    error=f"{type(exc).__name__}: {exc}",
                    result=failed.to_dict() if failed is not None else None,
                )
            record["physical"] = _physical_device()
            self.records.append(record)
            emit("op", **record)
            if entry["op"] == "pause" and record["ok"]:
                time.sleep(self.pause_seconds)
            else:
                if entry["op"] == "migrate":
                    wait_for_own_memory(60.0)  # the moved copies become the job's own meanwhile
                settled = self.progress.step + SETTLE_STEPS
        if engine is not None:
            state = engine.state.value
            if state == "PAUSED":  # a resume failed: try once more in place, else the loop never ends
                try:
                    engine.resume()
                except Exception as exc:
                    emit("warning", message=f"the job stayed paused after the plan: {exc}")
            self.engine_state = engine.state.value


def wait_for_own_memory(timeout: float) -> None:
    from flexium import _C

    deadline = time.perf_counter() + timeout
    while _C.vmm_imported_count() > 0 and time.perf_counter() < deadline:
        time.sleep(0.005)


def _fast_path_blocker() -> Optional[str]:
    """Why a move now would take the driver path (None: the fast path can run)."""
    from flexium.api import runtime

    current = runtime.current()
    if current is None or current.engine is None:
        return "no flexium engine in this process"
    try:
        return current.engine.fast_path_blocker()
    except Exception as exc:
        return f"unknown ({type(exc).__name__}: {exc})"


def _physical_device() -> Optional[str]:
    try:
        import flexium

        return str(flexium.auto.get_physical_device())
    except Exception:
        return None


# ---- the analysis -----------------------------------------------------------------------------


def _step_of(record: dict[str, Any], starts: list[float], ends: list[float]) -> Optional[int]:
    """The step an engine operation ran in: the one whose [start, end] holds the middle of its
    execution. The op's own clock (result seconds) dates its execution; t1 (when the control
    thread woke) can come after the training thread has already ended that step."""
    if record.get("ran_in_step") is not None:
        return int(record["ran_in_step"])
    result = record.get("result") or {}
    seconds = result.get("seconds")
    if not seconds or seconds <= 0 or seconds > record["t1"] - record["t0"] + 1e-3:
        seconds = record["t1"] - record["t0"]
    middle = record["t1"] - seconds / 2
    for k in range(len(ends)):
        if starts[k] <= middle <= ends[k]:
            return k
    return None


def _work_started(record: dict[str, Any]) -> Optional[float]:
    """When the operation's work began (at the safe point, or on the caller's thread after the
    bounded wait): t1 minus the op's own seconds, which the engine counts from there."""
    seconds = (record.get("result") or {}).get("seconds")
    if not seconds or seconds <= 0 or seconds > record["t1"] - record["t0"] + 1e-3:
        return None
    return max(record["t0"], record["t1"] - seconds)


def preparation(record: dict[str, Any], ends: list[float]) -> dict[str, Any]:
    """A pause prepares before its safe point (the fast path touches and pins its host staging
    between the request and the safe point) while training goes on: the seconds from the request
    (t0) to the start of its work, and the steps that ended in between (a step's length:
    end(j) - end(j-1), as for the median normal step)."""
    started = _work_started(record)
    if started is None:
        return {"prep": None, "prep_steps": None, "prep_max_step": None, "prep_median_step": None}
    lengths = [ends[j] - ends[j - 1] for j in range(1, len(ends)) if record["t0"] < ends[j] <= started]
    return {
        "prep": started - record["t0"],
        "prep_steps": len(lengths),
        "prep_max_step": max(lengths) if lengths else None,
        "prep_median_step": statistics.median(lengths) if lengths else None,
    }


def after_extra(k: int, ends: list[float], median: float, until: float, steps: int = AFTER_STEPS) -> float:
    """What the steps after a move (up to `steps`, all ending before `until`: the next operation)
    took beyond a normal step, summed: a fast move's copies become the job's own at those steps,
    its cost outside the downtime."""
    return sum(
        max(0.0, ends[j] - ends[j - 1] - median) for j in range(k + 1, min(len(ends), k + 1 + steps)) if ends[j] < until
    )


def analyse(records: list[dict[str, Any]], starts: list[float], ends: list[float], warmup: int) -> dict[str, Any]:
    """Downtime of each operation on the training loop's own clock. Each figure holds exactly one
    normal step of compute, so `extra` (downtime minus the median normal step) is what the move
    cost the job:

      migrate, handmove  end(k) - end(k-1), k the step it ran in (inside its optimizer.step, or
                         at its start for handmove)
      pause              t1 - end(k-1): from the last finished step until the job is paused
      resume             end(k+1) - t0: from the resume call until the job has finished one
                         whole step after it (k, in which it had paused, and k+1)
    Where an operation ran outside any step (no safe point came): first step end after t1 minus
    the last step end before t0. A pause also gets preparation(): prep (request -> start of its
    work), prep_steps and the longest and median step that ended meanwhile (prep_max_step,
    prep_median_step).
    """
    busy: set[int] = set()
    placed = []
    for record in records:
        k = _step_of(record, starts, ends) if record.get("ok") else None
        placed.append(k)
        if k is not None:
            busy.update((k, k + 1, k + 2))
    durations = [(j, ends[j] - ends[j - 1]) for j in range(max(1, warmup + 1), len(ends))]
    normal = [d for j, d in durations if j not in busy] or [d for _, d in durations]
    median = statistics.median(normal) if normal else 0.0

    analysed = []
    for record, k in zip(records, placed, strict=True):
        entry: dict[str, Any] = {
            "op": record["op"],
            "t0": record["t0"],
            "ok": record.get("ok", False),
            "ran_in_step": k,
            "downtime": None,
            "extra": None,
            "next_step_extra": None,
            "method": None,
        }
        if not entry["ok"]:
            analysed.append(entry)
            continue
        op = record["op"]
        if op == "pause":
            entry.update(preparation(record, ends))
        downtime: Optional[float] = None
        if k is not None and k >= 1:
            if op in ("migrate", "handmove") and k < len(ends):
                downtime, entry["method"] = ends[k] - ends[k - 1], "end(k) - end(k-1)"
            elif op == "pause":
                downtime, entry["method"] = record["t1"] - ends[k - 1], "t1 - end(k-1)"
            elif op == "resume" and k + 1 < len(ends):
                downtime, entry["method"] = ends[k + 1] - record["t0"], "end(k+1) - t0"
            if op == "migrate":
                later = [r["t0"] for r in records if r["t0"] > record["t1"]]
                entry["after_extra"] = after_extra(k, ends, median, min(later, default=float("inf")))
            if k + 1 < len(ends) and op != "pause":
                entry["next_step_extra"] = (
                    ends[k + 1] - ends[k] - median
                    if op != "resume"
                    else (ends[k + 2] - ends[k + 1] - median if k + 2 < len(ends) else None)
                )
        if downtime is None:
            before = [e for e in ends if e < record["t0"]]
            after = [e for e in ends if e > record["t1"]]
            if before and after:
                downtime, entry["method"] = after[0] - before[-1], "first end after t1 - last end before t0"
        if downtime is not None:
            entry["downtime"] = downtime
            entry["extra"] = downtime - median
        analysed.append(entry)
    return {"median_step": median, "normal_steps": len(normal), "ops": analysed}


# ---- the model and its state ------------------------------------------------------------------


def model_width(gb: float) -> int:
    """An MLP width whose state (params, grads, two AdamW moments: 16 bytes a parameter, 8 w^2
    parameters) is a quarter of the job's GiB, at most 1 GiB."""
    target = min(0.25 * gb, 1.0) * GIB
    width = int(math.sqrt(target / 128) / 128 + 0.5) * 128
    return max(256, width)


def build(args: argparse.Namespace, device: str) -> tuple[Any, Any, list[Any], int]:
    import torch

    torch.manual_seed(args.seed)
    width = args.width or model_width(args.gb)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model_state = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    ballast_bytes = max(0, int(args.gb * GIB) - model_state)
    chunk = max(1, int(args.chunk_mb * (1 << 20)))
    generator = torch.Generator(device=device)
    generator.manual_seed(args.seed + 1)
    ballast = []
    left = ballast_bytes
    while left >= 4:
        size = min(chunk, left)
        tensor = torch.empty(size // 4, dtype=torch.float32, device=device)
        tensor.normal_(generator=generator)
        ballast.append(tensor)
        left -= size
    return model, optimizer, ballast, width


def checksum(ballast: list[Any]) -> float:
    return float(sum(t[::4097].double().sum().item() for t in ballast))


def hand_move(model: Any, optimizer: Any, ballast: list[Any], target: str) -> tuple[list[Any], int]:
    """What a user writes to move a training job by hand."""
    import torch

    moved = sum(p.numel() * p.element_size() for p in model.parameters())
    moved += sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    model.to(target)  # parameters and their gradients, in place (same Parameter objects)
    for state in optimizer.state.values():
        for key, value in list(state.items()):
            if torch.is_tensor(value) and value.is_cuda:
                state[key] = value.to(target)
                moved += value.numel() * value.element_size()
    new_ballast = [t.to(target) for t in ballast]
    moved += sum(t.numel() * t.element_size() for t in new_ballast)
    if torch.cuda.is_available():
        for device in range(torch.cuda.device_count()):  # the copies run on the source's stream
            torch.cuda.synchronize(device)
    ballast.clear()  # the old tensors go
    if torch.device(target).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.set_device(torch.device(target))
    return new_ballast, moved


# ---- the job ----------------------------------------------------------------------------------


def _reserved(torch: Any, device: str, model: Any, ballast: list[Any]) -> tuple[int, int]:
    """PyTorch's reserved and allocated bytes on the device (off CUDA: what the tensors hold)."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.memory_reserved(device)), int(torch.cuda.memory_allocated(device))
    held = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    held += sum(t.numel() * t.element_size() for t in ballast)
    return held, held


def run_job(args: argparse.Namespace) -> int:
    plan = parse_plan(args.plan)
    hand = {entry["at_step"]: entry for entry in plan if entry["op"] == "handmove"}
    engine_plan = [entry for entry in plan if entry["op"] in ENGINE_OPS]
    import flexium

    if args.no_flexium:
        flexium.init(disabled=True)
    else:
        os.environ.pop("FLEXIUM_SERVER", None)
        flexium.init()
    import torch

    from flexium.api import runtime

    current = runtime.current()
    pool = current.memory_pool if current is not None else None
    pool_active = bool(pool is not None and pool.active)
    device = args.device
    if hand:
        for entry in hand.values():  # the target's context exists before the timed move
            torch.zeros(1, device=entry["target"])
    model, optimizer, ballast, width = build(args, device)
    sum_before = checksum(ballast)
    batch = args.batch

    records: list[dict[str, Any]] = []
    progress = Progress()
    control = Control(engine_plan, args.pause_seconds, progress, records)
    control_started = False
    starts: list[float] = []
    ends: list[float] = []
    losses: list[float] = []
    step = 0
    tail_from: Optional[int] = None
    last_planned = max((entry["at_step"] for entry in plan), default=-1)
    while True:
        if step >= args.min_steps and step > last_planned + 1:
            if (not engine_plan or control.finished.is_set()) and tail_from is None:
                tail_from = step
            if tail_from is not None and step >= tail_from + args.tail_steps:
                break
        if step >= args.max_steps:
            emit("warning", message=f"stopped at --max-steps {args.max_steps} before the plan finished")
            break
        starts.append(time.perf_counter())
        if step in hand:
            entry = hand[step]
            t0 = time.perf_counter()
            ballast, moved = hand_move(model, optimizer, ballast, entry["target"])
            t1 = time.perf_counter()
            device = entry["target"]
            record = {
                "op": "handmove",
                "requested_path": "hand",
                "target": entry["target"],
                "at_step": entry["at_step"],
                "t0": t0,
                "t1": t1,
                "ok": True,
                "ran_in_step": step,
                "physical": device,
                "result": {
                    "path": "hand",
                    "ok": True,
                    "seconds": t1 - t0,
                    "bytes_moved": moved,
                    "steps": [{"step": "copy", "seconds": t1 - t0, "ok": True, "rollback": False, "error": None}],
                    "notes": [],
                },
            }
            records.append(record)
            emit("op", **record)
        x = torch.randn(batch, width, device=device)
        loss = (model(x) - x).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()  # engine operations run here, at the safe point
        losses.append(loss.item())
        ends.append(time.perf_counter())
        if step + 1 == args.warmup:
            emit(
                "ready",
                pid=os.getpid(),
                gb=args.gb,
                width=width,
                pool_active=pool_active,
                flexium=not args.no_flexium,
                state_bytes=_reserved(torch, device, model, ballast)[0],
                allocated_bytes=_reserved(torch, device, model, ballast)[1],
                ballast_bytes=sum(t.numel() * t.element_size() for t in ballast),
                ballast_tensors=len(ballast),
                model_params=sum(p.numel() for p in model.parameters()),
                step_seconds=ends[-1] - starts[-1],
                fast_path_blocker=_fast_path_blocker(),
            )
            if engine_plan:
                control.start()
                control_started = True
        progress.advance(step)
        step += 1
    if control_started:
        control.join(timeout=60)
    ballast_ok = checksum(ballast) == sum_before
    summary = analyse(records, starts, ends, args.warmup)
    finite = all(math.isfinite(v) for v in losses)
    emit(
        "done",
        steps=len(ends),
        step_starts=starts,
        step_ends=ends,
        median_step=summary["median_step"],
        normal_steps=summary["normal_steps"],
        ops=summary["ops"],
        ballast_ok=ballast_ok,
        losses_finite=finite,
        first_loss=losses[0] if losses else None,
        last_loss=losses[-1] if losses else None,
        engine_state=control.engine_state,
        physical=_physical_device(),
    )
    flexium.shutdown()
    return 0 if ballast_ok and finite and all(r.get("ok") for r in records) else 2


# ---- bandwidth --------------------------------------------------------------------------------


def measure_bandwidth(args: argparse.Namespace) -> int:
    """GPU0 -> GPU1 peer copy (with 2+ GPUs) and pinned host copies, plain torch (no flexium),
    best of --repeats."""
    import torch

    def best(copy: Any, devices: tuple[int, ...], nbytes: int) -> tuple[float, list[float]]:
        copy()  # warm-up (enables peer access)
        rates = []
        for _ in range(args.repeats):
            for d in devices:
                torch.cuda.synchronize(d)
            started = time.perf_counter()
            copy()
            for d in devices:
                torch.cuda.synchronize(d)
            rates.append(nbytes / (time.perf_counter() - started) / 1e9)
        return max(rates), rates

    result: dict[str, Any] = {}
    peer = int(args.peer_gb * GIB)
    host = int(args.host_gb * GIB)
    src = torch.empty(peer, dtype=torch.uint8, device="cuda:0")
    if torch.cuda.device_count() >= 2:
        dst = torch.empty(peer, dtype=torch.uint8, device="cuda:1")
        result["peer_gbps"], result["peer_runs"] = best(lambda: dst.copy_(src), (0, 1), peer)
        result["peer_back_gbps"], result["peer_back_runs"] = best(lambda: src.copy_(dst), (0, 1), peer)
        result["can_access_peer"] = bool(torch.cuda.can_device_access_peer(0, 1))
        del dst
    pinned = torch.empty(host, dtype=torch.uint8, pin_memory=True)
    part = src[:host]
    result["d2h_gbps"], result["d2h_runs"] = best(lambda: pinned.copy_(part, non_blocking=True), (0,), host)
    result["h2d_gbps"], result["h2d_runs"] = best(lambda: part.copy_(pinned, non_blocking=True), (0,), host)
    result.update(peer_bytes=peer, host_bytes=host, repeats=args.repeats, device_count=torch.cuda.device_count())
    emit("bandwidth", **result)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=2.0, help="training state in GiB (model + AdamW + ballast)")
    parser.add_argument("--plan", action="append", default=[], help="STEP:OP[:...], repeatable (see above)")
    parser.add_argument("--no-flexium", action="store_true", help="flexium.init(disabled=True): no pool, no engine")
    parser.add_argument("--pause-seconds", type=float, default=0.5, help="how long a pause lasts before the resume")
    parser.add_argument("--warmup", type=int, default=5, help="steps before ready (and before the plan may start)")
    parser.add_argument("--min-steps", type=int, default=20)
    parser.add_argument("--tail-steps", type=int, default=5, help="steps after the last operation")
    parser.add_argument("--max-steps", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--width", type=int, default=0, help="MLP width (0: from --gb, see model_width)")
    parser.add_argument("--chunk-mb", type=float, default=1024, help="ballast tensor size in MiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda:0", help="where the job starts (cpu only to try the script)")
    parser.add_argument("--hang-seconds", type=float, default=900, help="dump every thread's stack and exit")
    parser.add_argument("--measure-bandwidth", action="store_true", help="only measure copy bandwidths")
    parser.add_argument("--peer-gb", type=float, default=4.0)
    parser.add_argument("--host-gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.hang_seconds, exit=True)
    if args.measure_bandwidth:
        return measure_bandwidth(args)
    return run_job(args)


if __name__ == "__main__":
    sys.exit(main())
