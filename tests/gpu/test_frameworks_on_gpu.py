"""Jobs written with the frameworks people train with (tests/support/jobs/framework_job.py), each attached
to a real server by `flexium.init()` alone and moved by the `flexium` command while it trains:
paused and resumed (one GPU), migrated there and back (two GPUs); jobs of two processes (Lightning's
strategy="ddp", `accelerate launch` with two processes) paused, resumed and their ranks swapped as
a whole. Each loss trace, every rank's, must match an undisturbed run of the same job bit for bit;
after each command every process holds memory on the GPUs it was sent to (NVML), and every GPU it
left is back to its idle reading."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from support.fresh_process import keep_log
from support.gpu import FRAMEWORK_JOB, assert_back_to_idle, idle_used, job_events, nccl_with_suspend
from support.served_job import ServedJob

pytest.importorskip("fastapi", reason="the server extra is not installed (ci/gpu-tests.sh installs .whl)")

STEPS = "240"
# A job that gets four or six commands, each with a job operation or the driver path, trains long
# enough to meet them all (its ranks become movable a heartbeat after their process group exists).
MANY_MOVES_STEPS = "1500"
PACE_S = "0.03"
FRAMEWORKS = [
    "lightning",
    "hf-trainer",
    "accelerate",
    "timm",
    "torchvision",
    "fastai",
]  # fastai: ci/framework-wheels.sh
# One process on two GPUs (framework_job.py): its pool spans both, which the fast path does not
# move, so every operation takes the driver path, all its GPUs at once.
ON_TWO_GPUS = ["split", "data-parallel"]
# Two processes, one GPU each, NCCL between them: moved as a whole job (its ranks agree on a step).
TWO_PROCESSES = ["lightning-ddp", "accelerate-ddp"]
SWAP = ("--ranks", "0=cuda:1,1=cuda:0")
UNSWAP = ("--ranks", "0=cuda:0,1=cuda:1")
# A command ({id}: the job's process) and the GPUs (indexes) each process is on after it.
Move = tuple[tuple[str, ...], list[list[int]]]


def _command(job: str) -> list[str]:
    script = str(FRAMEWORK_JOB)
    if job == "accelerate-ddp":
        launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
        return [sys.executable, *launch, "--mixed_precision", "no", "--dynamo_backend", "no", script, "accelerate"]
    return [sys.executable, script, job]  # lightning-ddp: Lightning starts its rank 1 itself


def _losses(events: list[dict[str, Any]]) -> dict[int, list[str]]:
    """Each rank's loss trace from a job's events."""
    traces: dict[int, list[str]] = {}
    for event in events:
        if event["event"] == "loss":
            traces.setdefault(event["rank"], []).append(event["loss"])
    return traces


def _moved_while_training(
    job: str, tmp_path: Path, host_gpus: list[Any], moves: list[Move], path: str = "fast", steps: str = STEPS
) -> None:
    from support.live_server import clean_env, wait_until

    ranks = 2 if job in TWO_PROCESSES else 1
    # Both runs of a job of several processes load the same NCCL: one with ncclCommSuspend.
    nccl = nccl_with_suspend() if ranks > 1 else None
    home = tmp_path / "undisturbed"
    home.mkdir()
    preload = {"LD_PRELOAD": nccl} if nccl else {}
    reference = subprocess.run(
        [*_command(job), "--steps", steps],
        env={**clean_env(home), **preload},
        capture_output=True,
        text=True,
        timeout=600,
    )
    keep_log((job, "(undisturbed)"), preload, reference.returncode, reference.stdout, reference.stderr)
    assert reference.returncode == 0, reference.stderr[-4000:]
    expected = _losses(job_events(reference.stdout.splitlines()))
    assert sorted(expected) == list(range(ranks)) and all(len(t) >= int(steps) for t in expected.values())

    uuid = [gpu.uuid for gpu in host_gpus]
    idle = idle_used()
    argv = [*_command(job), "--steps", steps, "--pace", PACE_S]
    with ServedJob(tmp_path, argv, ranks, env={}, nccl=nccl, ready_s=300) as served:
        wait_until(  # training has begun: the commands meet optimizer steps
            lambda: sum(line.startswith('{"event": "loss"') for line in served.output.lines) >= 10, 180, f"{job} trains"
        )
        for planned, where in moves:
            results = served.command(*(word.format(id=served.process_id) for word in planned))
            assert {r["path"] for r in results} == {path}, results
            assert served.held() == [[uuid[i] for i in on] for on in where], f"{job} after {' '.join(planned)}"
            assert_back_to_idle(idle, {uuid[i] for on in where for i in on}, f"{job}'s {' '.join(planned)}")
        traces = _losses(served.finish(timeout=600))
    assert traces == expected, f"{job}: a loss trace differs from the undisturbed run"


# Lightning's strategy="ddp" on one GPU: an NCCL process group of one rank (torch's own NCCL), one
# process to flexium and the server.
@pytest.mark.parametrize("framework", [*FRAMEWORKS, "lightning-ddp-one-rank"])
def test_a_framework_job_is_paused_and_resumed_bit_identical(
    framework: str, tmp_path: Path, host_gpus: list[Any]
) -> None:
    _moved_while_training(framework, tmp_path, host_gpus, [(("pause", "{id}"), [[]]), (("resume", "{id}"), [[0]])])


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_framework_job_is_migrated_there_and_back_bit_identical(
    framework: str, tmp_path: Path, two_gpus: list[Any]
) -> None:
    there_and_back: list[Move] = [(("migrate", "{id}", "cuda:1"), [[1]]), (("migrate", "{id}", "cuda:0"), [[0]])]
    _moved_while_training(framework, tmp_path, two_gpus, there_and_back)


@pytest.mark.parametrize("job", ON_TWO_GPUS)
def test_a_job_on_two_gpus_is_paused_resumed_and_swapped_bit_identical(
    job: str, tmp_path: Path, two_gpus: list[Any]
) -> None:
    both = [[0, 1]]  # one process on both GPUs, whichever way round
    _moved_while_training(
        job,
        tmp_path,
        two_gpus,
        [
            (("pause", "{id}"), [[]]),
            (("resume", "{id}"), both),
            (("migrate", "{id}", "cuda:1"), both),
            (("migrate", "{id}", "cuda:0"), both),
            (("migrate", "{id}", "--gpus", "cuda:0=cuda:1,cuda:1=cuda:0"), both),  # GPU by GPU
            (("migrate", "{id}", "--gpus", "cuda:1=cuda:0,cuda:0=cuda:1"), both),
        ],
        path="driver",
        steps=MANY_MOVES_STEPS,
    )


@pytest.mark.parametrize("job", TWO_PROCESSES)
def test_a_job_of_two_processes_is_paused_resumed_and_swapped_as_a_whole_bit_identical(
    job: str, tmp_path: Path, two_gpus: list[Any]
) -> None:
    _moved_while_training(
        job,
        tmp_path,
        two_gpus,
        [
            (("pause", "{id}"), [[], []]),
            (("resume", "{id}"), [[0], [1]]),
            (("migrate", "{id}", *SWAP), [[1], [0]]),
            (("migrate", "{id}", *UNSWAP), [[0], [1]]),
        ],
        steps=MANY_MOVES_STEPS,
    )
