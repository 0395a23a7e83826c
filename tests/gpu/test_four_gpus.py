"""Distributed jobs among four GPUs (NCCL with suspend, FLEXIUM_TEST_NCCL_LIB): a 2-rank DDP
job on GPUs 0 and 1 whose rank 1 moves alone to GPU 2 (rank 0 stays), then the whole job to GPUs
2 and 3, then a pause and a resume on GPUs 0 and 1; a 4-rank FSDP2 job paused and resumed as a
whole and two of its ranks swapped. Every loss trace bit-identical to an undisturbed run, and
after each operation, rank by rank, every rank holds memory on the one GPU it was sent to and on
none it left, and every GPU no rank is on is back to its idle reading (NVML). Run by each rank's
control thread (bench/jobs/rank_job.py --plan) and through a real server and the `flexium` command.
Skipped, and listed as not run, where NVML sees fewer than four GPUs."""

from __future__ import annotations

from typing import Any

import pytest

from support.gpu import assert_back_to_idle, idle_used, nccl_with_suspend
from support.served_job import ServedJob
from support.torchrun import (
    check_left_idle,
    check_ops,
    check_placements,
    check_traces,
    steps_at_ops,
    torchrun,
    torchrun_argv,
)

# Steps enough for a pause's host staging, prepared while the ranks train on, to come before the
# last operation's agreed step (as tests/gpu/test_distributed_jobs.py found on two GPUs: a job that
# ended first would leave that operation waiting out its deadline).
STEPS = "120"
# Through the server: long enough for every command to land while the job trains.
SERVED_STEPS = 1500

# GPU index of each rank after each operation (None: paused, nothing on any GPU).
ALONE_THEN_WHOLE = {
    "plan": ("10:migrate:1=2", "25:migrate:0=2,1=3", "40:pause", "40:resume:0=0,1=1"),
    "kinds": ["migrate", "migrate", "pause", "resume"],
    "where": {0: [0, 2, None, 0], 1: [2, 3, None, 1]},
}
FOUR_RANKS_SWAP = {
    "plan": ("10:pause", "10:resume", "25:migrate:1=2,2=1"),
    "kinds": ["pause", "resume", "migrate"],
    "where": {0: [None, 0, 0], 1: [None, 1, 2], 2: [None, 2, 1], 3: [None, 3, 3]},
}


@pytest.mark.parametrize(
    "ranks, model, case",
    [(2, "ddp", ALONE_THEN_WHOLE), (4, "fsdp2", FOUR_RANKS_SWAP)],
    ids=["ddp-one-rank-then-the-job", "fsdp2-four-ranks-swap-two"],
)
def test_ranks_move_among_four_gpus_bit_identical(
    four_gpus: list[Any], ranks: int, model: str, case: dict[str, Any]
) -> None:
    nccl = nccl_with_suspend()
    common = ("--model", model, "--steps", STEPS)
    reference = torchrun(*common, nccl=nccl, ranks=ranks)
    assert reference.returncode == 0, reference.stderr[-4000:]
    idle = idle_used()
    plan = [arg for item in case["plan"] for arg in ("--plan", item)]
    moved = torchrun(*common, *plan, "--hold", "4", nccl=nccl, ranks=ranks)
    check_ops(moved, case["kinds"])
    for rank in range(ranks):
        assert moved.losses(rank) == reference.losses(rank), f"rank {rank}'s loss trace differs"
        assert sum(moved.of(rank, "paused")[0]["held"].values()) == 0, f"rank {rank} held memory while paused"
        for op in moved.of(rank, "op"):
            if op["kind"] == "migrate":
                assert "suspend_nccl" in op["steps"] and "resume_nccl" in op["steps"], op
    uuids = [gpu.uuid for gpu in four_gpus]
    check_placements(moved, uuids, case["where"])
    check_left_idle(moved, uuids, case["where"], idle)
    stops = steps_at_ops(moved)
    assert all(stop == stops[0] for stop in stops), stops  # every rank stopped at the same step


# Through the server: (flexium's arguments, the rank whose process they name, then where each
# rank holds memory after it: GPU indexes, [] while paused).
SERVED: dict[str, tuple[int, str, list[tuple[tuple[Any, ...], list[list[int]]]]]] = {
    "ddp-one-rank-then-the-job": (
        2,
        "ddp",
        [
            (("migrate", 1, "cuda:2"), [[0], [2]]),
            (("migrate", 0, "--ranks", "0=cuda:2,1=cuda:3"), [[2], [3]]),
            (("pause", 0), [[], []]),
            (("resume", 0, "--ranks", "0=cuda:0,1=cuda:1"), [[0], [1]]),
        ],
    ),
    "fsdp2-four-ranks-swap-two": (
        4,
        "fsdp2",
        [
            (("pause", 0), [[], [], [], []]),
            (("resume", 0), [[0], [1], [2], [3]]),
            (("migrate", 0, "--ranks", "1=cuda:2,2=cuda:1"), [[0], [2], [1], [3]]),
        ],
    ),
}


@pytest.mark.parametrize("case", SERVED)
def test_the_server_and_cli_move_ranks_among_four_gpus(four_gpus: list[Any], tmp_path: Any, case: str) -> None:
    pytest.importorskip("fastapi", reason="the server extra is not installed (ci/gpu-tests.sh installs .whl)")
    ranks, model, steps = SERVED[case]
    nccl = nccl_with_suspend()
    uuid = [gpu.uuid for gpu in four_gpus]
    job_args = ("--backend", "nccl", "--ballast-gb", "2", "--model", model, "--steps", str(SERVED_STEPS))
    reference = torchrun(*job_args, "--step-sleep", "0", nccl=nccl, ranks=ranks)
    assert reference.returncode == 0, reference.stderr[-4000:]
    idle = idle_used()
    argv = torchrun_argv(ranks, *job_args, "--step-sleep", "0.03")
    with ServedJob(tmp_path, argv, ranks, env={}, nccl=nccl) as job:
        assert job.held() == [[uuid[rank]] for rank in range(ranks)]
        processes = [p["process_id"] for p in job.processes()]
        for (kind, rank, *rest), where in steps:
            job.command(str(kind), processes[int(rank)], *map(str, rest))
            assert job.held() == [[uuid[i] for i in on] for on in where], f"after {kind} {rest}"
            assert_back_to_idle(idle, {uuid[i] for on in where for i in on}, f"{kind} {' '.join(map(str, rest))}")
        check_traces(job.finish(), reference, SERVED_STEPS)
