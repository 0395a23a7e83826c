"""The whole product on real GPUs.

* A real `flexium server` (SQLite), a training job on GPU 0 that only calls `flexium.init()` and
  finds the server through FLEXIUM_SERVER, and the `flexium` command moving it over HTTP (the
  requests the dashboard's buttons send). The server must show the host's real GPUs and where
  the job is; migrate, pause and resume must take the fast path, leave nothing behind on the GPU
  the job left (NVML, read from this process), and the loss trace must match an undisturbed run
  bit for bit.
* The README's first command, `flexium demo`: its job lands on GPU 0 and the command line moves,
  pauses and resumes it; Ctrl-C stops everything.

Each runs two ways: paused and resumed in place (any machine with a GPU), and migrated to GPU 1,
paused and resumed on GPU 0 (two GPUs)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from support.fresh_process import keep_log
from support.gpu import GIB, RESIDUE_SLACK, TRAIN_JOB, run_job, uuid_of
from support.live_server import ProcessOutput, ServerProcess, clean_env, flexium_command, start_demo, wait_until

pytest.importorskip(
    "fastapi",
    reason='the server extra is not installed: pip install ".[server]" '
    "(ci/gpu-tests.sh installs the wheels carried in .whl)",
)

# What the command line does, in order: (command, the job's GPU after it; None: paused).
MOVES = {
    "in-place": (("pause", None), ("resume", 0)),
    "across-gpus": (("migrate", 1), ("pause", None), ("resume", 0)),
}


@pytest.fixture(params=list(MOVES))
def moves(request: pytest.FixtureRequest, host_gpus: list[Any]) -> tuple[tuple[str, int | None], ...]:
    """The commands of one way; "across-gpus" needs two GPUs (skipped, and listed, with fewer)."""
    sequence = MOVES[request.param]
    if any(gpu == 1 for _command, gpu in sequence):
        request.getfixturevalue("two_gpus")
    return sequence


BALLAST_GB = 2.0
# Long enough for three commands and their checks; the job's step sleep paces it.
JOB_ARGS = ("--ballast-gb", str(BALLAST_GB), "--steps", "600")
STEP_SLEEP_S = "0.05"


def test_commands_from_the_server_move_a_gpu_job(
    host_gpus: list[Any], moves: tuple[tuple[str, int | None], ...], tmp_path: Path
) -> None:
    from flexium.engine import nvml

    uuids = [uuid_of(host_gpus, index) for index in range(min(2, len(host_gpus)))]
    gpu0 = uuids[0]
    idle = {gpu.uuid: gpu.memory_used for gpu in host_gpus}
    reference = run_job(*JOB_ARGS, "--step-sleep", "0")
    assert reference.returncode == 0, reference.stderr[-3000:]

    server = ServerProcess(tmp_path / "server").start()
    job: subprocess.Popen[str] | None = None
    try:
        assert server.token, "the server printed no token for its default workspace:\n" + "\n".join(server.lines)
        home = tmp_path / "home"
        home.mkdir()
        env = clean_env(home)
        env.update(FLEXIUM_SERVER=f"127.0.0.1:{server.port}/default", FLEXIUM_TOKEN=server.token)
        job = subprocess.Popen(
            [sys.executable, str(TRAIN_JOB), *JOB_ARGS, "--step-sleep", STEP_SLEEP_S],
            env={**env, "FLEXIUM_TOKEN": server.issue_job_token()},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        output = ProcessOutput(job)
        ready = json.loads(output.wait_for(r'^\{"event": "ready"', 180).string)
        assert ready["migration"] is True and ready["pool_active"] is True, ready
        process_id, pid = ready["process_id"], ready["pid"]

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*flexium_command(), *args], env=env, capture_output=True, text=True, timeout=180)

        def listed() -> dict[str, Any]:
            done = cli("ps", "--json")
            assert done.returncode == 0, done.stderr
            return next((p for p in json.loads(done.stdout) if p["process_id"] == process_id), {})

        def command(*args: str) -> dict[str, Any]:
            done = cli(*args, "--json")
            assert done.returncode == 0, (
                f"flexium {' '.join(args)}: {done.stdout}\n{done.stderr}\n{output.text[-3000:]}"
            )
            final = json.loads(done.stdout)
            assert final["state"] == "succeeded" and final["result"]["path"] == "fast", final
            return final

        def job_memory(settled: Callable[[dict[str, int]], bool], what: str) -> dict[str, int]:
            """This job's bytes per GPU as NVML shows them, once `settled` holds."""

            def reading() -> dict[str, int] | None:
                ours = {gpu.uuid: gpu.used_by(pid) or 0 for gpu in nvml.host_gpus()}
                return ours if settled(ours) else None

            return wait_until(reading, 30, what)

        # The server shows the job where it is, and the host's real GPUs.
        p = wait_until(listed, 30, f"process {process_id} in `flexium ps`")
        assert p["state"] == "RUNNING" and p["gpu_uuid"] == gpu0 and p["physical_device"] == "cuda:0", p
        assert p["capabilities"]["migration"] is True and p["capabilities"]["pause_resume"] is True, p
        assert p["pid"] == pid
        done = cli("devices", "--json")
        assert done.returncode == 0, done.stderr
        hosts = json.loads(done.stdout)["hosts"]
        devices = {d["uuid"]: d for host in hosts for d in host["devices"]}
        assert set(uuids) <= set(devices), devices
        assert process_id in devices[gpu0]["processes"] and devices[gpu0]["memory_total"] > 100 * GIB

        ballast = int(BALLAST_GB * GIB)
        # Training has begun: a command before the first optimizer step takes the driver path at once.
        output.wait_for(r'^\{"event": "first_step"', 120)
        for name, index in moves:
            if index is None:
                command(name, process_id)
                job_memory(lambda ours: not any(ours.values()), "the paused job to hold nothing on any GPU")
                above_idle = {
                    gpu.uuid: f"{gpu.memory_used >> 20} MiB used, idle was {idle[gpu.uuid] >> 20} MiB"
                    for gpu in nvml.host_gpus()
                    if gpu.memory_used > idle[gpu.uuid] + RESIDUE_SLACK
                }
                assert not above_idle, f"paused: {above_idle}"
                p = listed()
                assert p["state"] == "PAUSED" and p["memory_bytes"] == 0, p
                continue
            done_by = command(name, process_id, f"cuda:{index}")
            if name == "migrate":
                assert done_by["result"]["bytes_moved"] >= ballast
            there = uuids[index]

            def all_there(ours: dict[str, int], there: str = there) -> bool:
                return ours[there] >= ballast and not any(held for uuid, held in ours.items() if uuid != there)

            job_memory(all_there, f"the job's memory to be all on GPU {index} after {name}")
            p = listed()
            assert p["state"] == "RUNNING" and p["physical_device"] == f"cuda:{index}" and p["gpu_uuid"] == there, p

        assert job.wait(300) == 0, output.text[-3000:]
        done_line = output.wait_for(r'^\{"event": "done"', 10).string
        finished = json.loads(done_line)
        assert finished["ballast_ok"] is True
        assert finished["losses"] == reference.one("done")["losses"], "loss trace differs from the undisturbed run"
        wait_until(lambda: not listed(), 30, "the finished job to unregister")
    finally:
        if job is not None:
            if job.poll() is None:
                job.kill()
                job.wait()
            keep_log(("(attached to a server)", *JOB_ARGS), None, job.returncode, output.text, "")
        server.stop()


def test_flexium_demo_trains_on_a_gpu_and_the_command_line_moves_it(
    moves: tuple[tuple[str, int | None], ...], tmp_path: Path
) -> None:
    home = tmp_path / "home"
    demo, out, port, env = start_demo(home)
    try:
        out.wait_for(rf"dashboard: http://127\.0\.0\.1:{port}/login#code=\S+", 90)
        registered = out.wait_for(r"job (gpu-[0-9a-f]+) registered \((\w+) on ([^,)]+), ([^)]+)\)", 180)
        process_id = registered.group(1)
        assert registered.group(2, 3) == ("RUNNING", "cuda:0"), registered.group(0)
        assert "SIMULATED" not in registered.group(4) and "SIMULATED" not in out.text, out.text  # real GPUs here
        token = out.wait_for(r"admin token \(for the CLI and the dashboard\): (flx_\S+)$", 10).group(1)
        # Training has begun: a command before the first optimizer step takes the driver path at once.
        out.wait_for(r"\[demo job\] step +1 +loss \S+ +on cuda:0$", 120)
        cli_env = {**env, "FLEXIUM_SERVER": f"127.0.0.1:{port}/default", "FLEXIUM_TOKEN": token}
        for name, index in moves:
            lands_on = None if index is None else f"cuda:{index}"
            args = (name, process_id) if lands_on is None else (name, process_id, lands_on)
            start = len(out.lines)
            done = subprocess.run([*flexium_command(), *args], env=cli_env, capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, f"flexium {' '.join(args)}:\n{done.stdout}\n{done.stderr}\n{out.text[-3000:]}"
            assert "succeeded" in done.stdout and "fast path" in done.stdout, done.stdout
            if lands_on is not None:
                assert f"RUNNING on {lands_on}" in done.stdout, done.stdout
                # The demo prints every 50 steps (5 s): the job trains on where it was sent.
                out.wait_for(rf"\[demo job\] step +\d+ +loss \S+ +on {lands_on}$", 30, start=start)
            else:
                assert "PAUSED" in done.stdout, done.stdout
        demo.send_signal(signal.SIGINT)
        assert demo.wait(60) == 0, out.text[-3000:]
        out.wait_for(r"flexium demo: stopped$", 5)
        assert "Traceback" not in out.text, out.text[-3000:]
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
