"""Downtime of migrate, pause and resume of a real training job, fast path against driver path,
against a hand-written .to() move and against the floor set by this machine's copy bandwidth.

    python bench/migrate.py --sizes 2,16,64 [--json results.json] [--skip-driver-above 16] [--timeout 600]

Once per run: copy bandwidths (GPU0 -> GPU1 peer, pinned D2H / H2D; plain torch, best of 3) and
the fixed cost of the driver checkpoint (a job of 0.1 GiB migrated by the driver path: its
checkpoint + restore seconds are what a bare torch context costs). Per size (GiB of training
state, bench/jobs/train_job.py): one job with the memory pool on doing fast migrate cuda:0 -> cuda:1,
driver migrate back, fast pause + resume and driver pause + resume (in place); one job with
flexium disabled doing the move by hand (model, AdamW state and ballast .to("cuda:1")).
With --repeat-pause N: N-1 more pool jobs doing the fast pause + resume only, for each size that
has a pause or resume goal (16 GiB), which is then judged on the median of N runs.
Unless --no-compare-in-process: per size one more pool job, fast pause + resume only, with the
host copies in the job's process (FLEXIUM_HOST_COPIER=0; rows "fast-here") beside the default
copier process (rows "fast").

With one GPU (torch's device count, in a child process) it measures what one GPU allows and says
that the migrate rows were not measured: bandwidth pinned D2H / H2D only; the fixed cost from a
0.1 GiB job paused by the driver path and resumed in place, twice (checkpoint seconds of the
pause, restore seconds of the resume, the better pair); per size the pool job's fast and driver
pause + resume in place; no hand-move job.

Downtime is read from the job's own step end times (bench/jobs/step_analysis.py): for a migrate at the
safe point of step k it is end(k) - end(k-1). Every downtime holds one normal step of compute,
so "extra" (downtime minus the median normal step) is what the move cost; "vs floor" and
"vs driver" and the goals use it. Floors: migrate S/peer + checkpoint + restore, pause
S/D2H + checkpoint, resume S/H2D + restore, or the larger of the two where the copier copied back
beside the restore (S: the job's reserved bytes, fixed costs above). "beside restore s" of a fast
resume: the copier's fill and the part of it that ran while the job restored ("after": copied back
after the restore, the note says why).

Pause rows also show how training went between the request and the pause's safe point (the fast
path tops up a staging kept pinned from before then; one not kept is made at the safe point, with
the job stopped, and its note says where the copy step's time went):
"prep s" from the request to the start of the pause at the safe point, and the longest and the
median step of the steps that ended in that time (step_analysis.preparation).

"free s": the time to a free GPU, from the request to the first NVML reading that shows no memory
of the job or of its children (the copier) on any GPU (pause rows) or on the GPU it left (migrate
rows: parking the job on another GPU with room frees its GPU without any pinned host memory), read
every 5 ms by this process (the clocks of both processes are CLOCK_MONOTONIC). Each pool job pauses
twice: the first pause may find its staging still being prepared ("staging": made at the pause, or
"part": kept but still being pinned ahead, the rest streamed), the second finds it kept from the
first ("kept"); a resume row shows the staging of the pause it ends. Goals: FREE_GOALS, for the
pauses; the fast migrations' are shown beside them. With --staging-ways, per size more jobs
pause and resume with nothing kept pinned (FLEXIUM_PINNED_HOST_MEMORY=0; again with the staging touched
and pinned rather than written by the copier, FLEXIUM_WRITTEN_STAGING=0) and with --kept-budget
(their rows marked "@budget"; the downtime goals leave them out), another with --kept-budget pauses
only once its keeper keeps the staging (its kept rows "ahead": made by the keeper, as a job that has
trained a while finds it), and another the same with the default budget where that cannot hold the whole
staging (its rows "share": the part the budget has room for kept, the rest made at the safe point),
and the summary "What a pause and
its resume give" shows, per size and staging way, the time to a free GPU and the resume's
operation, each beside its floor (floor_seconds: the bytes at this run's measured copy rate plus the
bare context's checkpoint or restore).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tables import print_table

JOBS = Path(__file__).resolve().parent / "jobs"
JOB = JOBS / "train_job.py"
BANDWIDTH = JOBS / "bandwidth.py"
# How the benchmark runs the job: 5 warm-up steps before the plan, then at least 20 steps and 5 after
# the plan; 3 steps after an operation before the next; no sleep between steps (it would count in the
# downtime); the ballast in tensors of 1 GiB; a pause held 0.5 s unless --pause-seconds says otherwise.
MEASURING = (
    *("--warmup", "5", "--steps", "20", "--tail-steps", "5", "--settle-steps", "3", "--step-sleep", "0"),
    *("--chunk-mb", "1024", "--pause-seconds", "0.5"),
)
GIB = 1 << 30
FIXED_COST_GB = 0.1
GOALS = (  # (size GiB, op, seconds): downtime minus one step of the fast path, shown, not asserted
    (16.0, "migrate", 1.3),
    (64.0, "migrate", 1.5),
    (16.0, "pause", 1.0),
    (16.0, "resume", 1.0),
)
PAUSE_GOAL_SIZES = {size for size, op, _limit in GOALS if op in ("pause", "resume")}
FREE_GOALS = ((16.0, 1.5), (64.0, 6.0))  # (size GiB, seconds from a pause's request to a free GPU)
NVML_EVERY_S = 0.005
# A reading: when (perf_counter), and the bytes the job's family held on each GPU (by UUID) then.
GpuUse = tuple[float, dict[str, int]]
COLUMNS = (
    "size GiB",
    "op",
    "path",
    "downtime s",
    "-step s",
    "free s",
    "staging",
    "pinned GiB",
    "step ms",
    "op total s",
    "copy s",
    "checkpoint s",
    "restore s",
    "map/back s",
    "beside restore s",
    "checksum ms",
    "copied GiB",
    "floor s",
    "vs floor",
    "vs driver",
    "after s",
    "prep s",
    "prep max step ms",
    "prep med step ms",
)
MIGRATE_NEEDS = "migrate rows need 2 GPUs and were not measured"
JOB_LOGS: Path | None = None  # --job-logs
IN_PROCESS_PATH = "fast-here"  # fast pause / resume rows with FLEXIUM_HOST_COPIER=0


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- running a job ----------------------------------------------------------------------------


class JobRun:
    def __init__(self, label: str, argv: list[str]) -> None:
        self.label = label
        self.argv = argv
        self.events: list[dict[str, Any]] = []
        self.returncode: int | None = None
        self.timed_out = False
        self.stderr = ""
        self.seconds = 0.0
        self.gpu_use: list[GpuUse] = []

    def first(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events if e.get("event") == name), None)

    def all(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == name]

    def problems(self) -> list[str]:
        found = []
        if self.timed_out:
            found.append(f"timed out after {self.seconds:.0f} s")
        elif self.returncode not in (0, None):
            found.append(f"exit status {self.returncode}")
        for op in self.all("op"):
            if not op.get("ok"):
                found.append(f"{op.get('requested_path')} {op['op']}: {op_error(op)}")
        done = self.first("done")
        if done is None and not self.timed_out:
            found.append("no 'done' event")
        elif done is not None and not done.get("ballast_ok", True):
            found.append("the ballast changed (data not intact after the moves)")
        if done is not None and not done.get("losses_finite", True):
            found.append("a loss was not finite")
        return found

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "argv": self.argv,
            "returncode": self.returncode,
            "timed_out": self.timed_out,
            "seconds": self.seconds,
            "events": self.events,
            "stderr_tail": self.stderr[-4000:],
        }


def op_error(op: dict[str, Any]) -> str:
    return f"{op.get('error_type')}: {op.get('error')}"


def run_job(
    label: str,
    job_args: list[str],
    timeout: float,
    on_event: Any = None,
    env_extra: dict[str, str] | None = None,
    script: Path = JOB,
) -> JobRun:
    """Runs the training job (``script``: another of bench/jobs/) with ``job_args``."""
    # The job dumps every thread's stack and exits shortly before it would be killed.
    argv = [sys.executable, str(script), "--hang-seconds", str(max(5.0, timeout - 10))]
    argv += [*MEASURING, *job_args] if script == JOB else job_args
    run = JobRun(label, argv)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    env.pop("FLEXIUM_SERVER", None)
    started = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if not line.startswith('{"event"'):
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                run.events.append(event)
                if on_event is not None:
                    try:
                        on_event(event)
                    except Exception as exc:  # progress printing must not lose events
                        log(f"   (progress: {type(exc).__name__}: {exc})")

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        watcher = GpuUseWatcher(proc.pid)
        watcher.start()
        try:
            run.returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            run.timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the job and any helper it started
            except ProcessLookupError:
                pass
            run.returncode = proc.wait()
        reader.join(timeout=10)
        run.gpu_use = watcher.finish()
        run.seconds = time.perf_counter() - started
        err.seek(0)
        run.stderr = err.read().decode(errors="replace")
    if JOB_LOGS is not None:
        with JOB_LOGS.open("a") as logs:
            logs.write(f"==== bench job {label}: exit {run.returncode}\n{run.stderr}\n")
    return run


class GpuUseWatcher(threading.Thread):
    """Reads NVML every NVML_EVERY_S: the GPU memory of a process and of its descendants, per GPU."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True, name="gpu-use")
        self.pid = pid
        self.samples: list[GpuUse] = []
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handles = {}
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                handles[uuid.decode() if isinstance(uuid, bytes) else str(uuid)] = handle
        except Exception as exc:  # no NVML: the "free s" column stays empty
            log(f"   (NVML unavailable, no time to a free GPU: {type(exc).__name__}: {exc})")
            return
        while not self._halt.wait(NVML_EVERY_S):
            family = self._family()
            used: dict[str, int] = {}
            for uuid, handle in handles.items():
                try:
                    processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                except pynvml.NVMLError:
                    continue
                used[uuid] = sum(p.usedGpuMemory or 0 for p in processes if p.pid in family)
            self.samples.append((time.perf_counter(), used))

    def _family(self) -> set[int]:
        found, todo = {self.pid}, [self.pid]
        while todo:
            pid = todo.pop()
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as children:
                        for child in children.read().split():
                            if int(child) not in found:
                                found.add(int(child))
                                todo.append(int(child))
            except (OSError, ValueError):
                continue
        return found

    def finish(self) -> list[GpuUse]:
        self._halt.set()
        self.join(timeout=5)
        return self.samples


def time_to_free(samples: list[GpuUse], request: float | None, gpu: str | None = None) -> float | None:
    """From `request` to the first reading after it with no memory of the job's family on `gpu`
    (a UUID), or on any GPU."""
    if request is None:
        return None
    after = [(t, used.get(gpu, 0) if gpu is not None else sum(used.values())) for t, used in samples if t >= request]
    if not after or after[0][1] == 0:
        return None  # nothing held when asked, or no readings: not a measurement
    return next((t - request for t, held in after if held == 0), None)


def freed(op: dict[str, Any], result: dict[str, Any], samples: list[GpuUse]) -> float | None:
    """A row's "free s": a pause frees every GPU, a migration the GPU it left."""
    if op["op"] == "pause":
        return time_to_free(samples, op.get("t0"))
    source = (result.get("source") or {}).get("uuid")
    if op["op"] == "migrate" and source is not None:
        return time_to_free(samples, op.get("t0"), gpu=source)
    return None


def report_failure(run: JobRun) -> None:
    log(f"!! {run.label} failed: {'; '.join(run.problems())}")
    tail = run.stderr[-4000:].rstrip()
    if tail:
        log(f"!! last of its stderr:\n{tail}")


# ---- the jobs ---------------------------------------------------------------------------------


def progress_printer(size_label: str) -> Any:
    def on_event(event: dict[str, Any]) -> None:
        if event["event"] == "ready":
            pool = "pool on" if event.get("pool_active") else "pool off"
            if not event.get("flexium"):
                pool = "flexium disabled"
            blocker = event.get("fast_path_blocker")
            extra = f", fast path blocked: {blocker}" if blocker and event.get("flexium") else ""
            log(f"   {size_label}: job ready, state {event['state_bytes'] / GIB:.2f} GiB, {pool}{extra}")
        elif event["event"] == "op":
            result = event.get("result") or {}
            path = result.get("path") or event.get("requested_path")
            where = f" -> {event['target']}" if event.get("target") else ""
            if event.get("ok"):
                log(f"-- {size_label}: {path} {event['op']}{where}: {result.get('seconds', 0):.2f} s")
            else:
                log(f"-- {size_label}: {event.get('requested_path')} {event['op']}{where}: FAILED {event.get('error')}")
        elif event["event"] == "warning":
            log(f"   {size_label}: warning: {event.get('message')}")

    return on_event


def pool_plan(with_driver: bool, with_migrate: bool = True, keeper_first: bool = False) -> list[str]:
    """`keeper_first`: the first pause waits until the job's keeper keeps its staging (plan op "kept")."""
    plan = ["10:migrate:cuda:1@fast"] if with_migrate else []
    if with_driver and with_migrate:
        plan.append("20:migrate:cuda:0@driver")
    # The second pause comes 100 steps (0.5-1 s) after the first resume, whenever that came (a pause
    # that makes its staging reaches its safe point seconds after step 30): the copier pins what the
    # copy back left unpinned in the background meanwhile, as it would before any pause a person sends.
    plan += ["30:kept", "+0:pause@fast"] if keeper_first else ["30:pause@fast"]
    plan += ["+0:resume", "+100:pause@fast", "+0:resume"]
    if with_driver:
        plan += ["+10:pause@driver", "+0:resume"]
    return plan


def run_pause_job(
    label: str,
    size: float,
    args: argparse.Namespace,
    env_extra: dict[str, str] | None = None,
    *,
    keeper_first: bool = False,
) -> JobRun:
    """A pool job that only pauses on the fast path and resumes, in place; with `keeper_first` its first
    pause waits until its keeper keeps the staging (plan op "kept")."""
    plan = pool_plan(False, with_migrate=False, keeper_first=keeper_first)
    return run_job(
        label,
        [
            "--gb",
            str(size),
            "--pause-seconds",
            str(args.pause_seconds),
            *plan_args(plan),
        ],
        args.timeout,
        progress_printer(f"{size:g} GiB"),
        env_extra=env_extra,
    )


def plan_args(plan: list[str]) -> list[str]:
    return [arg for item in plan for arg in ("--plan", item)]


def count_gpus(timeout: float) -> int | None:
    """The GPUs a job sees (torch.cuda.device_count() in a child process, as the jobs count them)."""
    env = {**os.environ}
    env.pop("FLEXIUM_SERVER", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        return int(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        log(f"!! could not count the GPUs ({type(exc).__name__}: {exc})")
        return None


def measure_bandwidth(timeout: float, gpus: int) -> tuple[JobRun, dict[str, Any] | None]:
    if gpus >= 2:
        log("-- bandwidth: GPU0 -> GPU1 peer copy of 4 GiB, pinned D2H / H2D of 2 GiB, best of 3")
    else:
        log("-- bandwidth: pinned D2H / H2D of 2 GiB, best of 3 (one GPU: no peer copy)")
    run = run_job("bandwidth", [], timeout, script=BANDWIDTH)
    event = run.first("bandwidth")
    if event is None or run.returncode != 0:
        report_failure(run)
        return run, None
    peer = f"peer {event['peer_gbps']:.0f} GB/s, " if event.get("peer_gbps") else ""
    log(f"   {peer}D2H {event['d2h_gbps']:.1f} GB/s, H2D {event['h2d_gbps']:.1f} GB/s")
    return run, event


def measure_fixed_cost(timeout: float, gpus: int) -> tuple[JobRun, dict[str, Any] | None]:
    """Checkpoint + restore of a tiny job on the driver path: a migrate there and back (2+ GPUs),
    else a pause and a resume in place, twice (the pause's checkpoint, the resume's restore)."""
    if gpus >= 2:
        log(f"-- fixed cost: a {FIXED_COST_GB:g} GiB job, driver migrate cuda:0 -> cuda:1 and back")
        plan = ["10:migrate:cuda:1@driver", "20:migrate:cuda:0@driver"]
    else:
        log(f"-- fixed cost: a {FIXED_COST_GB:g} GiB job, driver pause + resume in place, twice (one GPU)")
        plan = ["10:pause@driver", "10:resume", "20:pause@driver", "20:resume"]
    run = run_job(
        "fixed cost",
        ["--gb", str(FIXED_COST_GB), *plan_args(plan)],
        timeout,
        progress_printer(f"{FIXED_COST_GB:g} GiB"),
    )
    pairs: list[tuple[float | None, float | None]] = []
    checkpoint: float | None = None  # the last pause's, for the resume that follows it
    for op in run.all("op"):
        result = op.get("result")
        if not (op.get("ok") and result):
            checkpoint = None
            continue
        if op["op"] == "migrate":
            pairs.append((step_seconds(result, "checkpoint"), step_seconds(result, "restore")))
        elif op["op"] == "pause":
            checkpoint = step_seconds(result, "checkpoint")
        elif op["op"] == "resume" and checkpoint is not None:
            pairs.append((checkpoint, step_seconds(result, "restore")))
            checkpoint = None
    pairs = [p for p in pairs if p[0] is not None and p[1] is not None]
    if not pairs or run.problems():
        report_failure(run)
        if not pairs:
            return run, None
    best = min(pairs, key=lambda p: (p[0] or 0.0) + (p[1] or 0.0))
    fixed: dict[str, Any] = {
        "checkpoint": best[0],
        "restore": best[1],
        "runs": [list(p) for p in pairs],
        "how": "driver migrate" if gpus >= 2 else "driver pause + resume in place",
    }
    log(f"   checkpoint {fixed['checkpoint']:.3f} s + restore {fixed['restore']:.3f} s")
    return run, fixed


# ---- rows -------------------------------------------------------------------------------------


def step_seconds(result: dict[str, Any], *names: str) -> float | None:
    steps = [s for s in result.get("steps", []) if s["step"] in names and not s.get("rollback")]
    return sum(s["seconds"] for s in steps) if steps else None


def copied_bytes(result: dict[str, Any]) -> int | None:
    """The fast path's copied bytes (from its note), else what the result says it moved."""
    for note in result.get("notes", []):
        match = re.search(r"copied ([0-9.]+) GiB", note)
        if match:
            return int(float(match.group(1)) * GIB)
    moved = result.get("bytes_moved")
    return int(moved) if moved else None


def rows_of(size: float, run: JobRun) -> list[dict[str, Any]]:
    """One row per operation of a job, joined with the job's downtime analysis."""
    ready = run.first("ready") or {}
    done = run.first("done") or {}
    analysed = {entry.get("t0"): entry for entry in done.get("ops", [])}
    median = done.get("median_step")
    rows = []
    paused_with = None  # the staging of the last fast pause, which the resume after it brings back
    buffer_of_pause = None  # the buffers that pause's copier wrote through (FLEXIUM_WRITE_BUFFER), if it wrote
    for op in run.all("op"):
        result = op.get("result") or {}
        timing = analysed.get(op.get("t0"), {})
        path = result.get("path") or op.get("requested_path")
        staging = None
        if op["op"] == "pause":
            staging = paused_with = staging_of(result) if path == "fast" else None
            buffer_of_pause = write_buffer_of(result) if path == "fast" else None
        elif op["op"] == "resume" and path == "fast":
            staging = paused_with
        rows.append(
            {
                "size_gb": size,
                "op": "migrate" if op["op"] == "handmove" else op["op"],
                "path": "hand .to()" if path == "hand" else path,
                "requested_path": op.get("requested_path"),
                "ok": bool(op.get("ok")),
                "error": op_error(op),
                "downtime": timing.get("downtime"),
                "extra": timing.get("extra"),
                "next_step_extra": timing.get("next_step_extra"),
                "after_extra": timing.get("after_extra"),
                "ran_in_step": timing.get("ran_in_step"),
                "method": timing.get("method"),
                "median_step": median,
                "op_seconds": result.get("seconds"),
                "copy": step_seconds(result, "copy"),
                "checkpoint": step_seconds(result, "checkpoint"),
                "restore": step_seconds(result, "restore"),
                "map_back": step_seconds(result, "map", "copy_back"),
                "beside": beside_restore(result) if op["op"] == "resume" and path == "fast" else None,
                # The move's proof: its bytes summed before the copy and where they landed.
                "checksum": step_seconds(result, "checksum", "verify"),
                "copied": copied_bytes(result),
                "state_bytes": ready.get("state_bytes"),
                "prep": timing.get("prep"),
                "prep_steps": timing.get("prep_steps"),
                "prep_max_step": timing.get("prep_max_step"),
                "prep_median_step": timing.get("prep_median_step"),
                "free": freed(op, result, run.gpu_use),
                "staging": staging,
                "write_buffer": buffer_of_pause if staging is not None else None,
                "newly_pinned": newly_pinned_of(result) if op["op"] == "pause" and path == "fast" else None,
                "notes": result.get("notes", []),
            }
        )
    return rows


def beside_restore(result: dict[str, Any]) -> str:
    """A fast resume's copy back made by the copier beside the restore (engine/fast/resume_overlap.py):
    "FILL/BESIDE" (the copier's seconds, and those of them while the job restored), or "after" when
    it was copied back after the restore."""
    for note in result.get("notes", []):
        match = re.search(r"filled [0-9.]+ GiB of new memory in ([0-9.]+) s .*?, ([0-9.]+) s of it beside", note)
        if match:
            return f"{match.group(1)}/{match.group(2)}"
        if note.startswith(("copied back after the restore", "copied back beside the restore")):
            return "after" if note.startswith("copied back after") else "0"
    return "after"


def write_buffer_of(result: dict[str, Any]) -> str | None:
    """The buffers a fast pause's copier wrote its staging through ("16 MiB"), as its notes say; None where
    it wrote none."""
    for note in result.get("notes", []):
        match = re.search(r"through ([0-9]+ [KM]iB) buffers", note)
        if match:
            return match.group(1)
    return None


def staging_of(result: dict[str, Any]) -> str:
    """Whether a fast pause found its staging kept from before ("kept"), kept but still being pinned
    ahead or grown since ("part": it streamed the rest at its safe point), or made it after the
    request ("made": at its safe point when none was kept). The notes are the engine's (fast_pause.py)."""
    for note in result.get("notes", []):
        if note.startswith("the staging kept for pauses holds "):  # all the pinned budget has room for
            return "share"
        if note.startswith("the staging kept for pauses "):
            return "part"
        if note.startswith("made the host staging "):
            return "written" if "newly mapped and written" in note else "made"
        match = re.search(r"pinned ([0-9.]+) GiB of host staging .*\(([0-9.]+) GiB of it newly mapped", note)
        if match:
            # A kept staging may have grown a little with the pool since (fact `growing-staging-keeps-pins`).
            return "made" if float(match.group(2)) > float(match.group(1)) / 2 else "kept"
    return "kept"


def default_budget_holds(size_gb: float) -> bool:
    """Whether the pinned host memory budget the jobs get here (this environment's, else the default) holds
    a pause's staging for a job of `size_gb` GiB (the pool and a sixteenth, as FastPath.host_bytes_wanted
    asks at most)."""
    from flexium.engine.fast import pinned_budget

    return size_gb * GIB * 17 / 16 <= pinned_budget.budget().bytes


def newly_pinned_of(result: dict[str, Any]) -> float:
    """GiB of host staging a fast pause pinned between its request and its safe point."""
    for note in result.get("notes", []):
        match = re.search(r"([0-9.]+) GiB newly pinned", note)
        if match:
            return float(match.group(1))
    return 0.0


def add_ratios(rows: list[dict[str, Any]], bandwidth: dict[str, Any] | None, fixed: dict[str, Any] | None) -> None:
    for row in rows:
        row["floor"] = floor_seconds(row, bandwidth, fixed)
        extra = row["extra"]
        row["vs_floor"] = extra / row["floor"] if extra is not None and row["floor"] else None
        row["vs_driver"] = None
        if row["path"] == "fast" and extra is not None:
            driver = next(
                (
                    r
                    for r in rows
                    if r["size_gb"] == row["size_gb"] and r["op"] == row["op"] and r["path"] == "driver" and r["extra"]
                ),
                None,
            )
            if driver is not None:
                row["vs_driver"] = extra / driver["extra"]


def floor_seconds(row: dict[str, Any], bandwidth: dict[str, Any] | None, fixed: dict[str, Any] | None) -> float | None:
    """A row's floor from this run's measured bandwidth and the bare context's checkpoint and restore
    (fixed): the bytes at the copy rate plus what the context costs. A pause's is also the floor of its
    time to a free GPU: the GPU is free once the bytes are copied and the context checkpointed."""
    size = row.get("state_bytes") or row["size_gb"] * GIB
    if bandwidth is None or fixed is None:
        return None
    if row["op"] == "migrate" and bandwidth.get("peer_gbps"):
        return size / (bandwidth["peer_gbps"] * 1e9) + fixed["checkpoint"] + fixed["restore"]
    if row["op"] == "pause":
        return size / (bandwidth["d2h_gbps"] * 1e9) + fixed["checkpoint"]
    if row["op"] == "resume" and "/" in (row.get("beside") or ""):  # copied back beside the restore
        return max(size / (bandwidth["h2d_gbps"] * 1e9), fixed["restore"])
    if row["op"] == "resume":
        return size / (bandwidth["h2d_gbps"] * 1e9) + fixed["restore"]
    return None


# ---- printing ---------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 3, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def ms(seconds: float | None) -> str:
    return fmt(seconds * 1e3 if seconds is not None else None, 1)


def table_row(row: dict[str, Any]) -> tuple[str, ...]:
    if not row["ok"]:
        return (f"{row['size_gb']:g}", row["op"], str(row["path"]), "FAILED", *("-",) * (len(COLUMNS) - 4))
    median = row["median_step"]
    copied = row["copied"]
    return (
        f"{row['size_gb']:g}",
        row["op"],
        str(row["path"]),
        fmt(row["downtime"]),
        fmt(row["extra"]),
        fmt(row.get("free")),
        (staging_way(row) or "-") + (f" @{row['budget']}" if row.get("budget") else ""),
        fmt(row.get("newly_pinned"), 2),
        ms(median),
        fmt(row["op_seconds"]),
        fmt(row["copy"]),
        fmt(row["checkpoint"]),
        fmt(row["restore"]),
        fmt(row["map_back"]),
        row.get("beside") or "-",
        ms(row.get("checksum")),
        fmt(copied / GIB if copied else None, 2),
        fmt(row["floor"]),
        fmt(row["vs_floor"], 2, "x"),
        fmt(row["vs_driver"], 2, "x"),
        fmt(row.get("after_extra")),
        fmt(row.get("prep")),
        ms(row.get("prep_max_step")),
        ms(row.get("prep_median_step")),
    )


def goals(rows: list[dict[str, Any]], migrate_measured: bool = True) -> list[dict[str, Any]]:
    """Each goal against the median of its fast rows (several with --repeat-pause); met only if
    none of them failed."""
    checked = []
    for size, op, limit in GOALS:
        # The jobs of --staging-ways (another budget than the default) are not what the goals are about.
        runs = [
            r for r in rows if r["size_gb"] == size and r["op"] == op and r["path"] == "fast" and not r.get("budget")
        ]
        measured = [r for r in runs if r["ok"] and r["extra"] is not None]
        extra = statistics.median(r["extra"] for r in measured) if measured else None
        failed = len(runs) - len(measured)
        checked.append(
            {
                "size_gb": size,
                "op": op,
                "limit": limit,
                "extra": extra,
                "runs": [r["extra"] for r in measured],
                "failed": failed,
                "within": sum(1 for r in measured if r["extra"] <= limit),
                "downtime": statistics.median(r["downtime"] for r in measured) if measured else None,
                "met": None if extra is None else extra <= limit and failed == 0,
                "why_not": "needs 2 GPUs" if op == "migrate" and not migrate_measured else None,
            }
        )
    return checked


def print_goals(checked: list[dict[str, Any]]) -> None:
    print("\nGoals (fast path, downtime minus one normal step, the median of its runs; measured, not asserted):")
    for goal in checked:
        mark = {True: "[x]", False: "[ ]", None: "[?]"}[goal["met"]]
        runs, failed = goal["runs"], goal["failed"]
        measured = (
            "not measured" if goal["extra"] is None else (f"{goal['extra']:.3f} s (downtime {goal['downtime']:.3f} s)")
        )
        if len(runs) + failed > 1:
            measured += f"; median of {len(runs)} runs ({', '.join(f'{e:.3f}' for e in runs)}), {goal['within']} within"
        if failed:
            measured += f"; {failed} FAILED"
        if goal["extra"] is None and goal.get("why_not"):
            measured += f" ({goal['why_not']})"
        print(f"  {mark} {goal['op']} {goal['size_gb']:g} GiB <= {goal['limit']:g} s: {measured}")


# How a GPU is freed, as the "Time to a free GPU" lines name it: a fast pause that found its
# staging kept or made it, or a fast migration to another GPU with room (the job parked there).
FREEING = {
    "kept": "pause, staging kept",
    "part": "pause, staging kept in part",
    "made": "pause, staging made, touched and pinned (FLEXIUM_WRITTEN_STAGING=0)",
    "written": "pause, staging made (written by the copier)",
    "parked": "migrate (parked elsewhere)",
}


def free_goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Time to a free GPU per size and way (FREEING), the median of its fast operations."""

    def way(row: dict[str, Any]) -> str | None:
        if row["op"] == "migrate":
            return "parked"
        return row.get("staging") if row["op"] == "pause" else None

    checked = []
    for size, limit in FREE_GOALS:
        for freeing in FREEING:
            runs = [r["free"] for r in rows if r["size_gb"] == size and r["path"] == "fast" and way(r) == freeing]
            runs = [f for f in runs if f is not None]
            median = statistics.median(runs) if runs else None
            met = None if median is None else median <= limit
            checked.append(
                {"size_gb": size, "freeing": freeing, "limit": limit, "runs": runs, "median": median, "met": met}
            )
    return checked


def print_free_goals(checked: list[dict[str, Any]]) -> None:
    budget = os.environ.get("FLEXIUM_PINNED_HOST_MEMORY") or "the default, 25% of the host's memory"
    print(
        "\nTime to a free GPU (request to no memory of the job on any GPU, or for a migration on the GPU it left; "
        f"pinned host memory budget: {budget}):"
    )
    for goal in checked:
        mark = {True: "[x]", False: "[ ]", None: "[?]"}[goal["met"]]
        runs = goal["runs"]
        measured = "not measured" if goal["median"] is None else f"{goal['median']:.3f} s"
        if len(runs) > 1:
            measured += f" (median of {', '.join(f'{r:.3f}' for r in runs)})"
        print(f"  {mark} {FREEING[goal['freeing']]} {goal['size_gb']:g} GiB: <= {goal['limit']:g} s: {measured}")


# How a fast pause got its staging, as the summary names it (staging_of; "ahead": kept, in the job that paused
# only once its keeper had made the staging, as a job that has trained a while finds it).
STAGING_WAYS = {
    "ahead": "staging kept, made ahead by the keeper",
    "kept": "staging kept",
    "part": "staging kept in part",
    "share": "staging kept in part, the pinned budget's share, the rest made at the safe point",
    "made": "staging not kept, touched and pinned (FLEXIUM_WRITTEN_STAGING=0)",
    "written": "staging not kept (written by the copier)",
}


# The jobs --staging-ways adds per size (--staging-jobs picks among them).
STAGING_JOBS = {
    "unkept": "nothing kept pinned (FLEXIUM_PINNED_HOST_MEMORY=0)",
    "kept": "the whole staging kept (--kept-budget)",
    "touched": "nothing kept, the staging touched and pinned rather than written (FLEXIUM_WRITTEN_STAGING=0)",
    "ahead": "paused once its keeper kept its staging (--kept-budget)",
    "share": "paused once its keeper kept the default budget's share (sizes beyond that budget)",
}


def staging_jobs(wanted: str) -> set[str]:
    jobs = {j.strip() for j in wanted.split(",") if j.strip()}
    unknown = sorted(jobs - set(STAGING_JOBS))
    if unknown:
        raise SystemExit(f"--staging-jobs: unknown {', '.join(unknown)}; choose among {', '.join(STAGING_JOBS)}")
    return jobs


def staging_way(row: dict[str, Any]) -> str | None:
    """The row's STAGING_WAYS key: its staging, "ahead" where it was kept in a job marked so."""
    staging = row.get("staging")
    return "ahead" if staging == "kept" and row.get("ahead") else staging


def staging_ways(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per size and staging way (STAGING_WAYS), what a user gets: the median time to a free GPU of
    its fast pauses and the median operation of the fast resumes after them, each beside its floor
    (floor_seconds, from the run's measured bandwidth and fixed cost: the rows carry it)."""

    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    from flexium.units import read_size  # reads the notes' "16 MiB" as FLEXIUM_WRITE_BUFFER's "16MiB"

    checked = []
    buffers = sorted({r.get("write_buffer") for r in rows}, key=lambda b: (b is not None, b and read_size(b)))
    for size in sorted({r["size_gb"] for r in rows}):
        for way, buffer in ((way, buffer) for way in STAGING_WAYS for buffer in buffers):
            of_way = [
                r
                for r in rows
                if r["size_gb"] == size and r["path"] == "fast" and r["ok"] and r.get("write_buffer") == buffer
            ]
            pauses = [r for r in of_way if r["op"] == "pause" and staging_way(r) == way]
            resumes = [r for r in of_way if r["op"] == "resume" and staging_way(r) == way]
            if not pauses and not resumes:
                continue
            checked.append(
                {
                    "size_gb": size,
                    "staging": way,
                    "write_buffer": buffer,
                    "free_runs": [r["free"] for r in pauses if r.get("free") is not None],
                    "free": median([r.get("free") for r in pauses]),
                    "free_floor": median([r.get("floor") for r in pauses]),
                    "resume_runs": [r["op_seconds"] for r in resumes if r.get("op_seconds") is not None],
                    "resume": median([r.get("op_seconds") for r in resumes]),
                    "resume_floor": median([r.get("floor") for r in resumes]),
                }
            )
    return checked


def print_staging_ways(checked: list[dict[str, Any]]) -> None:
    budget = os.environ.get("FLEXIUM_PINNED_HOST_MEMORY") or "the default, 25% of the host's memory"
    print(
        "\nWhat a pause and its resume give, by how the pause got its staging (fast path, median of the runs; "
        "free: request -> free GPU; resume: the operation; floor: the bytes at this run's measured copy rate plus "
        f"the bare context's checkpoint or restore; pinned host memory budget: {budget}):"
    )
    for way in checked:
        free = f"free {fmt(way['free'])} s (floor {fmt(way['free_floor'])} s, {len(way['free_runs'])} runs)"
        resume = f"resume {fmt(way['resume'])} s (floor {fmt(way['resume_floor'])} s, {len(way['resume_runs'])} runs)"
        through = f" through {way['write_buffer']} buffers" if way.get("write_buffer") else ""
        print(f"  {way['size_gb']:g} GiB, {STAGING_WAYS[way['staging']]}{through}: {free}; {resume}")


def print_machine(bandwidth: dict[str, Any] | None, fixed: dict[str, Any] | None) -> None:
    b = bandwidth or {}
    f = fixed or {}
    total = f["checkpoint"] + f["restore"] if fixed else None
    print()
    print_table(
        (
            "peer 0->1 GB/s",
            "peer 1->0 GB/s",
            "pinned D2H GB/s",
            "pinned H2D GB/s",
            "checkpoint s",
            "restore s",
            "fixed total s",
        ),
        [
            (
                fmt(b.get("peer_gbps"), 1),
                fmt(b.get("peer_back_gbps"), 1),
                fmt(b.get("d2h_gbps"), 1),
                fmt(b.get("h2d_gbps"), 1),
                fmt(f.get("checkpoint")),
                fmt(f.get("restore")),
                fmt(total),
            )
        ],
    )
    if f.get("how") == "driver pause + resume in place":
        print(
            f"(fixed: checkpoint of a driver-path pause + restore of its resume in place, a {FIXED_COST_GB:g} GiB job:"
            " the cost of a bare torch context; one GPU, no peer copy)"
        )
    else:
        print(
            f"(fixed: checkpoint + restore of a {FIXED_COST_GB:g} GiB job by the driver path, the cost of a bare"
            " torch context)"
        )


# ---- main -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,16,64", help="GiB of training state per job, comma-separated")
    parser.add_argument("--json", type=Path, help="write every raw result here")
    parser.add_argument(
        "--skip-driver-above",
        type=float,
        default=None,
        metavar="GB",
        help="no driver-path rows for sizes above this (default: driver rows for every size)",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per job before it is killed")
    parser.add_argument("--pause-seconds", type=float, default=0.5, help="how long each pause lasts")
    parser.add_argument(
        "--repeat-pause",
        type=int,
        default=1,
        metavar="N",
        help="fast pause + resume N times at the sizes with pause / resume goals (N-1 more jobs); "
        "the goals take the median",
    )
    parser.add_argument(
        "--no-compare-in-process",
        dest="compare_in_process",
        action="store_false",
        help="skip the fast pause + resume rows with the copies in the job's process",
    )
    parser.add_argument(
        "--staging-ways",
        action="store_true",
        help="per size, two more pool jobs doing the fast pause + resume only: one with nothing kept pinned "
        "(FLEXIUM_PINNED_HOST_MEMORY=0) and one with --kept-budget, so that each size is measured with its staging "
        "kept and not kept (the default budget keeps a 16 GiB job's, not a 64 GiB job's)",
    )
    parser.add_argument(
        "--staging-jobs",
        default=",".join(STAGING_JOBS),
        help="for --staging-ways: which of its jobs run, comma-separated (default all: "
        + "; ".join(f"{k}: {v}" for k, v in STAGING_JOBS.items())
        + ")",
    )
    parser.add_argument(
        "--write-buffers",
        default="",
        help="for --staging-ways' unkept job: one such job per buffer size listed (FLEXIUM_WRITE_BUFFER, "
        "e.g. 1MiB,16MiB: the pinned buffers the copier writes a staging made at the safe point through; "
        "default: one job, with the job's default)",
    )
    parser.add_argument(
        "--kept-budget",
        default="90%",
        help="for --staging-ways: the pinned host memory budget of the job that keeps its staging (default 90%%)",
    )
    parser.add_argument(
        "--job-sizes",
        default="",
        help="GiB of training state per rank: also measure whole-job operations of torchrun jobs "
        "(bench/job_moves.py) at these sizes, with this run's bandwidth and fixed cost for the floors",
    )
    parser.add_argument(
        "--job-scenarios",
        default="",
        help="for --job-sizes: bench/job_moves.py's scenarios, comma-separated (default: those the GPUs allow: "
        "gloo-one-gpu on 1, swap on 2, also four-gpus and four-ranks on 4)",
    )
    parser.add_argument(
        "--nccl",
        default=os.environ.get("FLEXIUM_TEST_NCCL_LIB"),
        help="for --job-sizes: a libnccl.so.2 with ncclCommSuspend to LD_PRELOAD (torch before 2.12)",
    )
    parser.add_argument(
        "--job-logs", type=Path, help="append each job's stderr here (its flexium log: FLEXIUM_LOG_LEVEL=DEBUG)"
    )
    args = parser.parse_args()
    global JOB_LOGS
    JOB_LOGS = args.job_logs
    if args.repeat_pause < 1:
        parser.error(f"--repeat-pause must be at least 1 (one run: the pool job's own), not {args.repeat_pause}")
    sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
    jobs_wanted = staging_jobs(args.staging_jobs)
    write_buffers = [b.strip() for b in args.write_buffers.split(",") if b.strip()]

    started = time.perf_counter()
    failures: list[str] = []
    jobs: list[JobRun] = []
    gpus = count_gpus(min(args.timeout, 300))
    if gpus is None:
        failures.append("GPU count")
        gpus = 2  # unknown: run what two GPUs allow, as always; failing jobs say why
    elif gpus < 1:
        log("!! torch sees no GPU: nothing to measure")
        return 1
    migrate = gpus >= 2
    if not migrate:
        log(f"-- one GPU: {MIGRATE_NEEDS}; measuring pause and resume in place only")
    job_sizes = [float(s) for s in args.job_sizes.split(",") if s.strip()]
    job_scenarios: list[str] = []
    if job_sizes:
        import job_moves

        try:
            job_scenarios = job_moves.scenarios_for(args.job_scenarios, gpus)
        except ValueError as exc:
            parser.error(str(exc))
    run, bandwidth = measure_bandwidth(args.timeout, gpus)
    jobs.append(run)
    if bandwidth is None:
        failures.append("bandwidth")
    run, fixed = measure_fixed_cost(args.timeout, gpus)
    jobs.append(run)
    if run.problems():
        failures.append("fixed cost")

    rows: list[dict[str, Any]] = []

    def record(run: JobRun, size: float, **marks: str) -> None:
        """A job's rows into the table, each with ``marks``; a job that went wrong is said and counted."""
        jobs.append(run)
        rows.extend({**row, **marks} for row in rows_of(size, run))
        if run.problems():
            report_failure(run)
            failures.append(run.label)

    for size in sizes:
        label = f"{size:g} GiB"
        with_driver = args.skip_driver_above is None or size <= args.skip_driver_above
        plan = pool_plan(with_driver, with_migrate=migrate)
        log(
            f"-- {label}: pool job: "
            + ("fast migrate 0->1, " if migrate else "")
            + ("driver migrate 1->0, " if with_driver and migrate else "")
            + "fast pause + resume"
            + (", driver pause + resume" if with_driver else " (driver rows skipped: --skip-driver-above)")
            + ("" if migrate else " (in place, one GPU)")
        )
        run = run_job(
            f"{label} pool job",
            ["--gb", str(size), "--pause-seconds", str(args.pause_seconds), *plan_args(plan)],
            args.timeout,
            progress_printer(label),
        )
        record(run, size)

        repeats = args.repeat_pause if size in PAUSE_GOAL_SIZES else 1
        for again in range(2, repeats + 1):
            log(f"-- {label}: pool job, fast pause + resume again (run {again} of {repeats})")
            record(run_pause_job(f"{label} pool job, pause run {again}", size, args), size)

        if args.compare_in_process:
            log(
                f"-- {label}: pool job, fast pause + resume with the copies in the job's process "
                "(FLEXIUM_HOST_COPIER=0), for comparison"
            )
            run = run_pause_job(f"{label} pool job, copies in-process", size, args, {"FLEXIUM_HOST_COPIER": "0"})
            record(run, size, path=IN_PROCESS_PATH)

        if args.staging_ways:
            for job, budget in (("unkept", "0"), ("kept", args.kept_budget)):
                if job not in jobs_wanted:
                    continue
                for buffer in (write_buffers or [None]) if job == "unkept" else [None]:
                    env = {"FLEXIUM_PINNED_HOST_MEMORY": budget, **({"FLEXIUM_WRITE_BUFFER": buffer} if buffer else {})}
                    through = f", FLEXIUM_WRITE_BUFFER={buffer}" if buffer else ""
                    log(f"-- {label}: pool job, fast pause + resume with FLEXIUM_PINNED_HOST_MEMORY={budget}{through}")
                    run = run_pause_job(f"{label} pool job, pinned budget {budget}{through}", size, args, env)
                    record(run, size, budget=budget)
            if "touched" in jobs_wanted:
                log(f"-- {label}: pool job, nothing kept, its staging touched and pinned (FLEXIUM_WRITTEN_STAGING=0)")
                touched = {"FLEXIUM_PINNED_HOST_MEMORY": "0", "FLEXIUM_WRITTEN_STAGING": "0"}
                run = run_pause_job(f"{label} pool job, staging touched", size, args, touched)
                record(run, size, budget="0")
            if "ahead" in jobs_wanted:
                # A job that has trained a while: its first pause finds the staging its keeper made ahead.
                log(f"-- {label}: pool job paused once its keeper made its staging ({args.kept_budget} budget)")
                run = run_pause_job(
                    f"{label} pool job, kept by its keeper",
                    size,
                    args,
                    {"FLEXIUM_PINNED_HOST_MEMORY": args.kept_budget},
                    keeper_first=True,
                )
                record(run, size, budget=args.kept_budget, ahead="keeper")
            if "share" in jobs_wanted and not default_budget_holds(size):
                log(f"-- {label}: pool job paused once its keeper kept the default budget's share of its staging")
                run = run_pause_job(f"{label} pool job, kept in part by its keeper", size, args, keeper_first=True)
                record(run, size, budget="default", ahead="keeper")

        if not migrate:
            continue  # the hand-written move needs a second GPU
        log(f"-- {label}: hand-written move (flexium disabled): model, AdamW state, ballast .to('cuda:1')")
        run = run_job(
            f"{label} hand job",
            ["--gb", str(size), "--no-flexium", *plan_args(["10:handmove:cuda:1"])],
            args.timeout,
            progress_printer(label),
        )
        jobs.append(run)
        hand = rows_of(size, run)
        if hand and hand[0]["state_bytes"] is None:
            hand[0]["state_bytes"] = next((r["state_bytes"] for r in rows if r["size_gb"] == size), None)
        rows += hand
        if run.problems():
            report_failure(run)
            failures.append(run.label)

    job_rows: list[dict[str, Any]] = []
    job_runs: list[dict[str, Any]] = []
    if job_sizes:
        job_rows, job_runs, job_failures = job_moves.measure(
            job_sizes,
            job_scenarios,
            nccl=args.nccl,
            hold=args.pause_seconds,
            timeout=args.timeout,
            bandwidth=bandwidth,
            fixed=fixed,
        )
        failures += job_failures

    add_ratios(rows, bandwidth, fixed)
    print_table(COLUMNS, [table_row(r) for r in rows])
    print(
        "downtime: on the job's step clock, holding one normal step; -step: minus the median normal step (step ms)."
        "\nfloor: migrate S/peer + checkpoint + restore, pause S/D2H + checkpoint, resume S/H2D + restore"
        " (S: the job's reserved bytes); vs floor and vs driver compare -step."
        "\ncopied: the fast path's copied bytes, else the bytes the process held (what the checkpoint carried)."
        "\nafter (migrate rows): what the 20 steps after the move took beyond normal steps, summed (a fast"
        " move's copies become the job's own there, outside the downtime)."
        f"\n{IN_PROCESS_PATH}: the fast path with its host copies in the job's process (FLEXIUM_HOST_COPIER=0);"
        " fast: in the copier process (the default)."
        "\nfree s: request -> no memory of the job (its copier included) on any GPU (pause rows), or on the GPU it"
        " left (migrate rows)."
    )
    print(
        "prep (pause rows): request -> the pause's start at the safe point (the fast path tops up a kept staging"
        " meanwhile, and makes one not kept at the safe point); prep max / med step: the longest / median step"
        " that ended in that time (-: none did)."
    )
    print(
        "staging (fast pause rows, and the resume after each): made at the pause, kept from an earlier one, or"
        " part (kept but still being pinned ahead, or grown: the rest streamed at the safe point); pinned GiB: what"
        " the pause"
        " pinned of it between its request and its safe point (kept staging is pinned ahead, so 0 is the aim)."
    )
    if not migrate:
        print(f"ONE GPU: {MIGRATE_NEEDS} (torch sees {gpus} GPU); pause and resume ran in place, no hand move.")
    for row in rows:
        if not row["ok"]:
            print(f"FAILED {row['size_gb']:g} GiB {row['requested_path']} {row['op']}: {row['error']}")
    if job_rows:
        print()
        job_moves.print_rows(job_rows)
    print_machine(bandwidth, fixed)
    checked = goals(rows, migrate_measured=migrate)
    print_goals(checked)
    free_checked = free_goals(rows)
    print_free_goals(free_checked)
    ways = staging_ways(rows)
    print_staging_ways(ways)
    elapsed = time.perf_counter() - started
    print(f"\n{len(jobs)} jobs in {elapsed:.0f} s" + (f"; FAILED: {', '.join(failures)}" if failures else ""))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "sizes_gb": sizes,
                    "skip_driver_above": args.skip_driver_above,
                    "gpus": gpus,
                    "migrate_measured": migrate,
                    "bandwidth": bandwidth,
                    "fixed": fixed,
                    "rows": rows,
                    "goals": checked,
                    "free_goals": free_checked,
                    "staging_ways": ways,
                    "failures": failures,
                    "seconds": elapsed,
                    "jobs": [job.to_dict() for job in jobs],
                    "job_rows": job_rows,
                    "job_runs": job_runs,
                },
                indent=1,
            )
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
