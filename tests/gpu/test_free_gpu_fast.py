"""Freeing a GPU fast on real GPUs (docs/fast-path.md fact 18): a job's pause kept ready between
pauses (the host staging pinned by the copier ahead of time, within the pinned host memory
budget) only copies and checkpoints, and the job's own memory comes first.

How long it takes is the benchmark's (bench/migrate.py, "free s"); these tests check what happens:
where the staging came from, that nothing of the job (its copier included) stays on the GPU while
paused, that training is bit-identical, and that the copier gives its GPU memory to the job.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from conftest import assert_left, run_job, uuid_of
from test_fast_path import JOB_TIMEOUT, idle_used, ok_run, reference, summary

COMMON = ("--ballast-gb", "2", "--steps", "80", "--step-sleep", "0.1", "--pause-seconds", "0.5")
# The keeper looks every 2 s and waits for the pool to stay the same size between two looks: by
# step 50 (5 s of training) the staging is kept.
PLAN = ("--plan", "50:pause", "--plan", "50:resume", "--plan", "60:pause", "--plan", "60:resume")


def newly_mapped_gib(pause: dict[str, Any]) -> float:
    for note in pause["result"]["notes"]:
        match = re.search(r"\(([0-9.]+) GiB of it newly mapped and touched, ", note)
        if match:
            return float(match.group(1))
    raise AssertionError(f"the pause says nothing of its staging: {pause['result']['notes']}")


@pytest.mark.parametrize("budget", ["default", "0"])
def test_a_pause_kept_ready_only_copies(host_gpus: list[Any], budget: str) -> None:
    """With the default budget both pauses find their staging kept (the first from the keeper, the
    second from the first pause); with FLEXIUM_PINNED_HOST_MEMORY=0 each pause makes its own. Either
    way the paused job (and its copier) holds nothing on the GPU and the loss trace is unchanged."""
    gpu0 = uuid_of(host_gpus, 0)
    idle = idle_used()
    expected = reference(*COMMON)
    env = {} if budget == "default" else {"FLEXIUM_PINNED_HOST_MEMORY": budget}
    run = ok_run(run_job(*COMMON, *PLAN, env=env, timeout=JOB_TIMEOUT))
    assert [op["ok"] for op in run.ops] == [True] * 4, summary(run.ops)
    assert [op["result"]["path"] for op in run.ops] == ["fast"] * 4, summary(run.ops)
    pauses = run.ops[0::2]
    for pause in pauses:
        assert_left(pause, gpu0, idle)
    made = [newly_mapped_gib(p) for p in pauses]
    if budget == "default":
        assert made == [0.0, 0.0], summary(run.ops)
    else:
        assert all(m > 0 for m in made), summary(run.ops)
    assert tuple(run.one("done")["losses"]) == expected, "loss trace differs from the undisturbed run"


def test_the_copier_gives_its_gpu_memory_to_the_job() -> None:
    """The job fills its GPU while the copier keeps its pause ready there: the allocation that
    runs short kills the copier and succeeds; the job still pauses and resumes intact."""
    run = ok_run(run_job(script="yield_job.py", timeout=150))
    result = run.one("result")
    assert result["kept"] is True, result
    assert result["copier_bytes_before"] and result["copier_bytes_before"] >= 256 << 20, result
    assert result["extra_ok"] is True and result["yields"] == 1, result
    assert not result["copier_bytes_after"], result
    assert result.get("pause") == "fast" and result.get("resume") == "fast", result
    assert result["intact"] is True, result
