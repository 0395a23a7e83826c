"""Jobs written with the frameworks people train with (tests/gpu/framework_job.py), each attached
to a real server by `flexium.init()` alone and moved by the `flexium` command while it trains:
paused and resumed (one GPU), migrated there and back (two GPUs). Each loss trace must match an
undisturbed run of the same job bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from conftest import HERE, _keep_log, run_job

pytest.importorskip("fastapi", reason="the server extra is not installed (ci/gpu-tests.sh installs .whl)")

STEPS = "240"
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


def _moved_while_training(framework: str, tmp_path: Path, moves: list[tuple[str, ...]], path: str = "fast") -> None:
    from flexium.engine import nvml
    from live_server import ProcessOutput, ServerProcess, clean_env, flexium_command, wait_until

    reference = run_job(framework, "--steps", STEPS, script="framework_job.py")
    assert reference.returncode == 0, reference.stderr[-4000:]
    expected = [e["loss"] for e in reference.events if e["event"] == "loss"]
    assert len(expected) >= int(STEPS)

    server = ServerProcess(tmp_path / "server").start()
    job: Optional[subprocess.Popen[str]] = None
    output: Optional[ProcessOutput] = None
    try:
        home = tmp_path / "home"
        home.mkdir()
        env = clean_env(home)
        env.update(FLEXIUM_SERVER=f"127.0.0.1:{server.port}/default", FLEXIUM_TOKEN=server.token or "")
        job = subprocess.Popen(
            [sys.executable, str(HERE / "framework_job.py"), framework, "--steps", STEPS, "--pace", PACE_S],
            env={**env, "FLEXIUM_TOKEN": server.issue_job_token()},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        output = ProcessOutput(job)
        ready = json.loads(output.wait_for(r'^\{"event": "ready"', 180).string)
        process_id, pid = ready["process_id"], ready["pid"]

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*flexium_command(), *args], env=env, capture_output=True, text=True, timeout=180)

        def registered() -> Optional[dict[str, Any]]:
            done = cli("ps", "--json")
            found = [p for p in json.loads(done.stdout or "[]") if p["process_id"] == process_id]
            return found[0] if found and found[0]["capabilities"].get("pause_resume") else None

        wait_until(registered, 60, f"{framework} job registered and movable")
        for _ in range(10):  # training has begun: the commands meet optimizer steps
            output.wait_for(r'^\{"event": "loss"', 180)
        for planned in moves:
            move = tuple(word.format(id=process_id) for word in planned)
            done = cli(*move, "--json")
            assert done.returncode == 0, (
                f"flexium {' '.join(move)}: {done.stdout}\n{done.stderr}\n{output.text[-3000:]}"
            )
            outcome = json.loads(done.stdout)
            assert outcome["state"] == "succeeded" and outcome["result"]["path"] == path, outcome
            if move[0] == "pause":
                held = {gpu.uuid: gpu.used_by(pid) or 0 for gpu in nvml.host_gpus()}
                assert sum(held.values()) == 0, f"the paused {framework} job holds {held}"
        assert job.wait(timeout=300) == 0, output.text[-4000:]
        losses = [json.loads(line)["loss"] for line in output.lines if line.startswith('{"event": "loss"')]
        assert losses == expected, f"{framework}: the loss trace differs from the undisturbed run"
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        if output is not None:
            code = job.returncode if job is not None and job.returncode is not None else -1
            _keep_log(("framework_job.py", framework, "(attached to a server)"), None, code, output.text, "")
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
        [("pause", "{id}"), ("resume", "{id}"), ("migrate", "{id}", "cuda:1"), ("migrate", "{id}", "cuda:0")],
        path="driver",
    )
