"""Jobs written with the frameworks people train with (tests/gpu/framework_job.py), each attached
to a real server by `flexium.init()` alone and moved by the `flexium` command while it trains:
paused and resumed (one GPU), migrated there and back (two GPUs); jobs of two processes (Lightning's
strategy="ddp", `accelerate launch` with two processes) paused, resumed and their ranks swapped as
a whole. Each loss trace, every rank's, must match an undisturbed run of the same job bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from conftest import HERE, _keep_log, nccl_with_suspend

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


def _command(job: str) -> list[str]:
    script = str(HERE / "framework_job.py")
    if job == "accelerate-ddp":
        launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
        return [sys.executable, *launch, "--mixed_precision", "no", "--dynamo_backend", "no", script, "accelerate"]
    return [sys.executable, script, job]  # lightning-ddp: Lightning starts its rank 1 itself


def _losses(lines: list[str]) -> dict[int, list[str]]:
    """Each rank's loss trace from a job's output."""
    traces: dict[int, list[str]] = {}
    for line in lines:
        if line.startswith('{"event": "loss"'):
            event = json.loads(line)
            traces.setdefault(event["rank"], []).append(event["loss"])
    return traces


def _moved_while_training(
    job: str, tmp_path: Path, moves: list[tuple[str, ...]], path: str = "fast", steps: str = STEPS
) -> None:
    from flexium.engine import nvml
    from live_server import ProcessOutput, ServerProcess, clean_env, flexium_command, wait_until

    ranks = 2 if job in TWO_PROCESSES else 1
    # Both runs of a job of several processes load the same NCCL: one with ncclCommSuspend.
    preload = {"LD_PRELOAD": nccl_with_suspend()} if ranks > 1 else {}
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(home)
    reference = subprocess.run(
        [*_command(job), "--steps", steps], env={**env, **preload}, capture_output=True, text=True, timeout=600
    )
    _keep_log((job, "(undisturbed)"), preload, reference.returncode, reference.stdout, reference.stderr)
    assert reference.returncode == 0, reference.stderr[-4000:]
    expected = _losses(reference.stdout.splitlines())
    assert sorted(expected) == list(range(ranks)) and all(len(t) >= int(steps) for t in expected.values())

    server = ServerProcess(tmp_path / "server").start()
    process: Optional[subprocess.Popen[str]] = None
    output: Optional[ProcessOutput] = None
    try:
        env.update(FLEXIUM_SERVER=f"127.0.0.1:{server.port}/default", FLEXIUM_TOKEN=server.token or "")
        process = subprocess.Popen(
            [*_command(job), "--steps", steps, "--pace", PACE_S],
            env={**env, **preload, "FLEXIUM_TOKEN": server.issue_job_token()},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        output = ProcessOutput(process)
        ready = [json.loads(output.wait_for(rf'^\{{"event": "ready", "rank": {r},', 300).string) for r in range(ranks)]
        process_id, pids = ready[0]["process_id"], [event["pid"] for event in ready]

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*flexium_command(), *args], env=env, capture_output=True, text=True, timeout=360)

        def registered() -> Optional[list[dict[str, Any]]]:
            listed = json.loads(cli("ps", "--json").stdout or "[]")
            ours = [p for p in listed if p["pid"] in pids]
            movable = "job_operations" if ranks > 1 else "pause_resume"
            ok = len(ours) == ranks and all(p["capabilities"].get(movable) for p in ours)
            if ok and ranks > 1:  # one job, whatever launched its ranks
                ok = len({p["job"]["key"] for p in ours}) == 1
            return ours if ok else None

        wait_until(registered, 120, f"{job}: {ranks} process(es) registered and movable")
        wait_until(  # training has begun: the commands meet optimizer steps
            lambda: sum(line.startswith('{"event": "loss"') for line in output.lines) >= 10, 180, f"{job} trains"
        )
        for planned in moves:
            move = tuple(word.format(id=process_id) for word in planned)
            done = cli(*move, "--json")
            assert done.returncode == 0, (
                f"flexium {' '.join(move)}: {done.stdout}\n{done.stderr}\n{output.text[-3000:]}"
            )
            outcome = json.loads(done.stdout)
            assert outcome["state"] == "succeeded", outcome
            results = [c["result"] for c in outcome["commands"]] if ranks > 1 else [outcome["result"]]
            assert len(results) == ranks and {r["path"] for r in results} == {path}, outcome
            if move[0] == "pause":
                held = {gpu.uuid: sum(gpu.used_by(pid) or 0 for pid in pids) for gpu in nvml.host_gpus()}
                assert sum(held.values()) == 0, f"the paused {job} job holds {held}"
        assert process.wait(timeout=600) == 0, output.text[-4000:]
        assert _losses(output.lines) == expected, f"{job}: a loss trace differs from the undisturbed run"
    finally:
        if process is not None and process.poll() is None:
            process.kill()
        if output is not None:
            code = process.returncode if process is not None and process.returncode is not None else -1
            _keep_log(("framework_job.py", job, "(attached to a server)"), None, code, output.text, "")
        server.stop()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_framework_job_is_paused_and_resumed_bit_identical(framework: str, tmp_path: Path) -> None:
    _moved_while_training(framework, tmp_path, [("pause", "{id}"), ("resume", "{id}")])


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_framework_job_is_migrated_there_and_back_bit_identical(
    framework: str, tmp_path: Path, two_gpus: list[Any]
) -> None:
    _moved_while_training(framework, tmp_path, [("migrate", "{id}", "cuda:1"), ("migrate", "{id}", "cuda:0")])


@pytest.mark.parametrize("job", ON_TWO_GPUS)
def test_a_job_on_two_gpus_is_paused_resumed_and_swapped_bit_identical(
    job: str, tmp_path: Path, two_gpus: list[Any]
) -> None:
    _moved_while_training(
        job,
        tmp_path,
        [
            ("pause", "{id}"),
            ("resume", "{id}"),
            ("migrate", "{id}", "cuda:1"),
            ("migrate", "{id}", "cuda:0"),
            ("migrate", "{id}", "--gpus", "cuda:0=cuda:1,cuda:1=cuda:0"),  # GPU by GPU
            ("migrate", "{id}", "--gpus", "cuda:1=cuda:0,cuda:0=cuda:1"),
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
        [("pause", "{id}"), ("resume", "{id}"), ("migrate", "{id}", *SWAP), ("migrate", "{id}", *UNSWAP)],
        steps=MANY_MOVES_STEPS,
    )
