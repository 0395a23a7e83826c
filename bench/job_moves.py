"""Downtime of whole-job operations of a torchrun job, per stage, beside the floor
(bench/migrate.py --job-sizes runs it with its own bandwidth and fixed-cost readings).

    python bench/job_moves.py --sizes 16 [--scenarios gloo-one-gpu,swap,four-gpus,four-ranks]
        [--nccl /path/libnccl.so.2] [--json out.json]

One job per size (GiB of training state per rank, bench/jobs/rank_job.py) and scenario (SCENARIOS):
"swap", a 2-rank DDP job: a whole-job pause held --hold seconds and its resume in place, a swap of
the two ranks' GPUs, the swap back; on four GPUs, "four-gpus", a 2-rank DDP job: rank 1 alone to
GPU 2, the whole job to GPUs 2 and 3, a pause, its resume on GPUs 0 and 1; "four-ranks", a 4-rank
FSDP2 job: a pause, its resume, ranks 1 and 2 swapped; on one GPU, "gloo-one-gpu", a 2-rank DDP
job over gloo with both ranks on cuda:0 (NCCL refuses that): a whole-job pause and its resume, the
protocol and the real driver without NCCL, its ranks sharing the GPU's copies (its floor counts both).
A job's downtime is its slowest rank's: for a migration on the ranks' step clock (the stop step's
length minus the median normal step), for a pause and a resume the time each rank spent in the
operation (a pause's step also holds the time it stayed paused). Stages: the ranks meeting at
the stop step, NCCL suspend, the wait for torch's NCCL watchdog before a rank locks (what the
suspend left of 0.25 s after the drain), the rank's own transaction, meeting again, NCCL resume
and the check all-reduce. Floors: pause S/D2H + checkpoint, resume S/H2D + restore, migrate S/peer +
checkpoint + restore, for S the rank's reserved bytes. Goal: each at most 1.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tables import print_table

JOBS = Path(__file__).resolve().parent / "jobs"
sys.path.insert(0, str(JOBS))

from job_plan import parse_rank_plan, rank_map  # noqa: E402

JOB = JOBS / "rank_job.py"
# How the benchmark runs the job: its ranks' model 4096 wide, batches of 256, no autocast, 80 steps
# and no sleep between steps (it would count in the downtime).
MEASURING = ("--width", "4096", "--batch", "256", "--no-amp", "--steps", "80", "--step-sleep", "0")
GOAL_S = 1.5
PROTOCOL_STAGES = ("meet", "suspend_nccl", "watchdog", "meet_again", "resume_nccl", "check_nccl")
STOPPED = re.compile(r"the job stopped at optimizer step (\d+)")
COLUMNS = (
    "GiB/rank",
    "job",
    "op",
    "path",
    "downtime s",
    "meet s",
    "suspend s",
    "watchdog s",
    "own op s",
    "meet again s",
    "resume s",
    "check s",
    "floor s",
    "vs floor",
    "goal",
)


@dataclass(frozen=True)
class Scenario:
    """A job (its ranks, rank_job.py's --model) and what is done to it: the ranks' plan (STEP:KIND
    or STEP:KIND:RANK=GPU,..., bench/jobs/job_plan.py) and a row name for each operation."""

    ranks: int
    model: str
    plan: tuple[str, ...]
    ops: tuple[str, ...]
    backend: str = "nccl"  # gloo: every rank on cuda:0

    @property
    def ranks_per_gpu(self) -> int:
        return self.ranks if self.backend == "gloo" else 1

    @property
    def gpus(self) -> int:
        """The GPUs it needs: one per rank (one in all over gloo), and every GPU its plan names."""
        named = [gpu for item in parse_rank_plan(list(self.plan)) for gpu in rank_map(item).values()]
        return max([self.ranks // self.ranks_per_gpu, *(g + 1 for g in named)])

    @property
    def job(self) -> str:
        return f"{self.ranks} ranks {self.model.upper()}" + (" gloo, 1 GPU" if self.backend == "gloo" else "")

    def kind(self, index: int) -> str:
        return parse_rank_plan([self.plan[index]])[0].op


SCENARIOS = {
    "gloo-one-gpu": Scenario(2, "ddp", ("30:pause", "30:resume"), ("pause", "resume"), backend="gloo"),
    "swap": Scenario(
        2,
        "ddp",
        ("20:pause", "20:resume", "40:migrate:0=1,1=0", "60:migrate:0=0,1=1"),
        ("pause", "resume", "swap", "swap back"),
    ),
    "four-gpus": Scenario(
        2,
        "ddp",
        ("20:migrate:1=2", "40:migrate:0=2,1=3", "60:pause", "60:resume:0=0,1=1"),
        ("rank 1 alone to GPU 2", "job to GPUs 2, 3", "pause", "resume on GPUs 0, 1"),
    ),
    "four-ranks": Scenario(
        4,
        "fsdp2",
        ("20:pause", "20:resume", "40:migrate:1=2,2=1"),
        ("pause", "resume", "ranks 1, 2 swapped"),
    ),
}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_job(size: float, name: str, *, nccl: str | None, hold: float, timeout: float) -> dict[str, Any]:
    scenario = SCENARIOS[name]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}
    if nccl:
        env["LD_PRELOAD"] = nccl
    nproc = str(scenario.ranks)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nproc, str(JOB)]
    argv += [*MEASURING, "--gb", str(size), "--hold", str(hold), "--model", scenario.model]
    argv += ["--backend", scenario.backend]
    argv += [a for item in scenario.plan for a in ("--plan", item)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, stdout, stderr = None, _text(exc.stdout), _text(exc.stderr)
    return {
        "size": size,
        "scenario": name,
        "returncode": code,
        "ranks": ranks_of(stdout.splitlines()),
        "stderr_tail": stderr[-4000:],
        "seconds": time.perf_counter() - started,
    }


def _text(output: Any) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else str(output or "")


def ranks_of(lines: list[str]) -> dict[int, dict[str, Any]]:
    """Each rank's step end times, operations, reserved bytes and whether its ballast came through,
    from the JSON events the ranks printed (a rank that never finished has no entry)."""
    events = [json.loads(line) for line in lines if line.startswith('{"event"')]
    ranks = {}
    for done in (e for e in events if e["event"] == "done"):
        rank = done["rank"]
        ranks[rank] = {
            "rank": rank,
            "ends": [e["end"] for e in events if e["event"] == "step" and e["rank"] == rank],
            "ops": [e for e in events if e["event"] == "op" and e["rank"] == rank],
            "reserved": done["reserved"],
            "ballast_ok": done["ballast_intact"],
        }
    return ranks


def _stage(op: dict[str, Any], name: str) -> float:
    return float(op.get("steps", {}).get(name, 0.0))


def _own(op: dict[str, Any]) -> float:
    return sum(seconds for step, seconds in op.get("steps", {}).items() if step not in PROTOCOL_STAGES)


def _step_clock(rank: dict[str, Any], op: dict[str, Any]) -> float | None:
    """The stop step's length minus the median normal step, by this rank's clock."""
    found = next((STOPPED.search(note) for note in op.get("notes", []) if STOPPED.search(note)), None)
    ends = rank["ends"]
    if found is None:
        return None
    k = int(found.group(1)) - 1  # the loop iteration whose optimizer step ran the operation
    if not 0 < k < len(ends):
        return None
    normal = statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False))
    return ends[k] - ends[k - 1] - normal


def rows_of(job: dict[str, Any], bandwidth: dict[str, Any] | None, fixed: dict[str, Any] | None):
    rows: list[dict[str, Any]] = []
    scenario = SCENARIOS[job["scenario"]]
    ranks = [job["ranks"].get(r) for r in range(scenario.ranks)]
    if any(r is None for r in ranks):
        return rows
    for index, name in enumerate(scenario.ops):
        ops = [r["ops"][index] for r in ranks if index < len(r["ops"])]
        if len(ops) < scenario.ranks:
            continue
        kind = scenario.kind(index)
        if kind == "migrate":
            clocks = [_step_clock(r, op) for r, op in zip(ranks, ops, strict=True)]
            downtime = max(c for c in clocks if c is not None) if any(c is not None for c in clocks) else None
        else:
            downtime = max(op.get("seconds", 0.0) for op in ops)
        if not all(op["ok"] for op in ops):
            downtime = None  # a failed operation's time is no downtime of a move
        size_bytes = max(r["reserved"] for r in ranks)
        rows.append(
            {
                "size": job["size"],
                "job": scenario.job,
                "op": name,
                "ok": all(op["ok"] for op in ops),
                "path": "/".join(sorted({op.get("path", "?") for op in ops})),
                "downtime": downtime,
                **{stage: max(_stage(op, stage) for op in ops) for stage in PROTOCOL_STAGES},
                "own": max(_own(op) for op in ops),
                "floor": floor(kind, size_bytes * scenario.ranks_per_gpu, bandwidth, fixed),
                "errors": [op.get("error") for op in ops if not op["ok"]],
            }
        )
    return rows


def floor(kind: str, size: int, bandwidth: dict[str, Any] | None, fixed: dict[str, Any] | None):
    if not bandwidth or not fixed:
        return None
    gb = size / 1e9
    if kind == "pause":
        return gb / bandwidth["d2h_gbps"] + fixed["checkpoint"]
    if kind == "resume":
        return gb / bandwidth["h2d_gbps"] + fixed["restore"]
    peer = bandwidth.get("peer_gbps")
    return gb / peer + fixed["checkpoint"] + fixed["restore"] if peer else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_rows(rows: list[dict[str, Any]]) -> None:
    table = []
    for r in rows:
        ratio = r["downtime"] / r["floor"] if r["downtime"] is not None and r["floor"] else None
        met = "-" if r["downtime"] is None else ("met" if r["downtime"] <= GOAL_S else "MISSED")
        table.append(
            (
                f"{r['size']:g}",
                r["job"],
                r["op"],
                r["path"],
                _fmt(r["downtime"]),
                *(_fmt(r[s]) for s in ("meet", "suspend_nccl", "watchdog")),
                _fmt(r["own"]),
                *(_fmt(r[s]) for s in ("meet_again", "resume_nccl", "check_nccl")),
                _fmt(r["floor"]),
                "-" if ratio is None else f"{ratio:.2f}x",
                f"{met} (<= {GOAL_S:g} s)",
            )
        )
    print_table(COLUMNS, table)
    print(
        "whole-job operations of torchrun jobs: the slowest rank's downtime; migrations on the"
        " ranks' step clock minus a normal step, pause / resume: each rank's time in the operation;"
        " floor: for the bytes of every rank on one GPU."
    )
    for r in rows:
        if not r["ok"]:
            print(f"FAILED {r['size']:g} GiB/rank {r['op']}: {r['errors']}")


def measure(
    sizes: list[float],
    scenarios: list[str],
    *,
    nccl: str | None,
    hold: float,
    timeout: float,
    bandwidth: dict[str, Any] | None = None,
    fixed: dict[str, Any] | None = None,
):
    """(rows, jobs, failures)."""
    rows: list[dict[str, Any]] = []
    jobs, failures = [], []
    for size in sizes:
        for name in scenarios:
            scenario = SCENARIOS[name]
            log(f"-- {size:g} GiB per rank, {scenario.job}: {', '.join(scenario.ops)}")
            job = run_job(size, name, nccl=nccl, hold=hold, timeout=timeout)
            jobs.append(job)
            found = rows_of(job, bandwidth, fixed)
            rows += found
            intact = all(r.get("ballast_ok") for r in job["ranks"].values())
            ok = job["returncode"] == 0 and len(found) == len(scenario.ops) and all(r["ok"] for r in found)
            if not ok or not intact:
                failures.append(f"{size:g} GiB/rank {name} job")
                log(f"!! {size:g} GiB/rank {name} job: exit {job['returncode']}, ballast intact {intact}")
                log(job["stderr_tail"])
    return rows, jobs, failures


def scenarios_for(names: str, gpus: int) -> list[str]:
    """The scenarios named (comma-separated; "" for those this many GPUs allow, the gloo one only on
    one GPU, where no NCCL job fits); ValueError for an unknown one or one that needs more GPUs."""
    chosen = [n.strip() for n in names.split(",") if n.strip()] or [
        n for n, s in SCENARIOS.items() if s.gpus <= gpus and (s.backend == "nccl" or gpus == 1)
    ]
    for name in chosen:
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}: choose from {', '.join(SCENARIOS)}")
        if SCENARIOS[name].gpus > gpus:
            raise ValueError(f"scenario {name!r} needs {SCENARIOS[name].gpus} GPUs, torch sees {gpus}")
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16", help="GiB of training state per rank, comma-separated")
    parser.add_argument(
        "--nccl",
        default=os.environ.get("FLEXIUM_TEST_NCCL_LIB"),
        help="a libnccl.so.2 with ncclCommSuspend to LD_PRELOAD (torch < 2.12)",
    )
    parser.add_argument(
        "--scenarios", default="", help=f"comma-separated, of {', '.join(SCENARIOS)} (default: those the GPUs allow)"
    )
    parser.add_argument("--hold", type=float, default=1.0, help="seconds the pause lasts")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import torch

    try:
        scenarios = scenarios_for(args.scenarios, torch.cuda.device_count())
    except ValueError as exc:
        parser.error(str(exc))
    rows, jobs, failures = measure(
        [float(s) for s in args.sizes.split(",")], scenarios, nccl=args.nccl, hold=args.hold, timeout=args.timeout
    )
    print_rows(rows)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "jobs": jobs, "failures": failures}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
