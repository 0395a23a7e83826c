"""The jobs the benchmark and the GPU tests share (bench/jobs/): their one plan grammar
(job_plan.py), the training job running a plan on CPU torch and the fake driver (a pause, its
resume, a migration there and back, one counted from the operation before, one refused; the loss
trace bit-identical to an undisturbed run), and every job's --help."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support import fake_driver

JOBS = Path(__file__).resolve().parents[2] / "bench" / "jobs"
sys.path.append(str(JOBS))

from job_plan import PlanItem, parse_plan, parse_rank_plan, rank_map  # noqa: E402

# A small job on CPU torch; the steps slow enough for the plan's operations to meet them.
SMALL = ("--device", "cpu", "--ballast-gb", "0.001", "--width", "32", "--batch", "8", "--step-sleep", "0.02")
UNKNOWN_GPU = "GPU-00000000-0000-0000-0000-000000000000"


def test_the_plan_grammar() -> None:
    plan = parse_plan(
        [
            "10:migrate:cuda:1@fast",
            "20:pause",
            "+0:resume",
            "20:resume:cuda:0",
            "8:occupy:+0.2",
            "10:handmove:cuda:1",
            "30:kept",
        ]
    )
    assert plan == [
        PlanItem(10, "migrate", "cuda:1", "fast"),
        PlanItem(20, "pause"),
        PlanItem(0, "resume", relative=True),
        PlanItem(20, "resume", "cuda:0"),
        PlanItem(8, "occupy", "+0.2"),
        PlanItem(10, "handmove", "cuda:1"),
        PlanItem(30, "kept"),
    ]
    assert [str(item) for item in plan][:3] == ["10:migrate:cuda:1@fast", "20:pause", "+0:resume"]
    (swap,) = parse_rank_plan(["25:migrate:0=1,1=0"])
    assert rank_map(swap) == {0: 1, 1: 0} and rank_map(PlanItem(10, "pause")) == {}


@pytest.mark.parametrize(
    ("item", "said"),
    [
        ("x:pause", "[+]STEP:OP[:ARG][@PATH]"),
        ("10", "[+]STEP:OP[:ARG][@PATH]"),
        ("10:jump", "OP is one of"),
        ("10:migrate", "migrate needs its ARG"),
        ("10:pause@slow", "@PATH is one of auto, fast, driver"),
        ("10:resume@fast", "for migrate and pause"),
        ("+5:handmove:cuda:1", "a handmove needs its own step"),
    ],
)
def test_a_plan_item_out_of_the_grammar_says_what_is_wrong(item: str, said: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"plan item '{item}'")) as wrong:
        parse_plan([item])
    assert said in str(wrong.value)


@pytest.mark.parametrize(
    ("item", "said"),
    [
        ("10:pause@fast", "a rank job's operations take no @PATH"),
        ("10:migrate:0:1", "ARG is RANK=GPU,..."),
        ("10:handmove:cuda:1", "OP is one of pause, resume, migrate"),
    ],
)
def test_a_rank_plan_takes_the_engine_operations_and_rank_maps(item: str, said: str) -> None:
    with pytest.raises(ValueError, match="plan item") as wrong:
        parse_rank_plan([item])
    assert said in str(wrong.value)


def run_train_job(*args: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, str(JOBS / "train_job.py"), *SMALL, *args],
        env=fake_driver.subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"event"')]


def one(events: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [e for e in events if e["event"] == name]
    return found


def test_the_training_job_runs_its_plan_on_the_fake_driver() -> None:
    undisturbed = one(run_train_job("--steps", "14"), "done")
    plan = ["2:pause", "2:resume", "5:migrate:cuda:1", "+2:migrate:cuda:0", f"11:migrate:{UNKNOWN_GPU}"]
    events = run_train_job("--steps", "14", "--pause-seconds", "0.1", *(a for item in plan for a in ("--plan", item)))
    ready, done = one(events, "ready"), one(events, "done")
    assert ready["device"] == "cpu" and ready["migration"] is True and ready["pool_active"] is False, ready
    ops = [e for e in events if e["event"] == "op"]
    assert [(op["op"], op["ok"]) for op in ops] == [
        ("pause", True),
        ("resume", True),
        ("migrate", True),
        ("migrate", True),
        ("migrate", False),
    ], ops
    pause, resume, there, back, refused = ops
    assert pause["path"] == "driver" and pause["result"]["steps"][0]["step"] == "prepare", pause  # no CUDA: no pool
    assert resume["physical"] == "cuda:0" and there["physical"] == "cuda:1" and back["physical"] == "cuda:0"
    assert there["own_wait"] is not None and there["logical"] == "cuda:0"
    # counted from the end of the migration before
    starts = {e["at_step"]: e["step"] for e in events if e["event"] == "op_start"}
    assert back["at_step"] >= there["at_step"] + 2 and starts[back["at_step"]] >= back["at_step"], events
    assert refused["error_type"] and refused["state"] == "RUNNING" and refused["physical"] == "cuda:0", refused
    assert one(events, "control_done") and done["engine_state"] == "RUNNING"
    assert done["steps"] == 14 and len(done["step_ends"]) == 14 and done["ballast_ok"] is True
    assert [entry["ok"] for entry in done["ops"]] == [True, True, True, True, False], done["ops"]
    assert all(entry["downtime"] is not None for entry in done["ops"][:4]), done["ops"]
    assert done["losses"] == undisturbed["losses"], "the loss trace differs from the undisturbed run"


def test_a_plan_waits_for_the_keeper_at_most_its_time_then_goes_on() -> None:
    """kept: until the keeper keeps the staging, at most ARG seconds (a CPU job has no keeper that would); the
    "kept" event says how long and what the keeper said, and the plan goes on."""
    plan = ["2:kept:1", "+0:pause", "+0:resume"]
    events = run_train_job("--steps", "10", "--pause-seconds", "0.1", *(a for item in plan for a in ("--plan", item)))
    kept = one(events, "kept")
    assert kept["seconds"] <= 1.5 and kept["step"] >= 2, kept
    assert [(op["op"], op["ok"]) for op in events if op["event"] == "op"] == [("pause", True), ("resume", True)]


@pytest.mark.parametrize("job", ["train_job.py", "rank_job.py", "bandwidth.py", "fill_gpu.py"])
def test_every_job_says_how_it_is_run(job: str) -> None:
    done = subprocess.run(
        [sys.executable, str(JOBS / job), "--help"], capture_output=True, text=True, timeout=120, env=None
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.startswith("usage: ") and "bench/jobs/" in done.stdout, done.stdout
    if job in ("train_job.py", "rank_job.py"):
        assert "[+]STEP:OP[:ARG][@PATH]" in done.stdout  # the plan grammar, once for both
