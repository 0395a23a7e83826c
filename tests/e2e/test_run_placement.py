"""``flexium run`` through the real server, on the simulated driver: a job started on the GPU of its
host with room (the other one filled by a neighbour, another program's memory), seeing every GPU
of its host, with a job token minted for it and revoked when it ends, its exit status flexium
run's; with both GPUs full it waits, saying so, and starts once the neighbour leaves; Ctrl-C while
it waits cancels its placement, and while the job runs reaches the job."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from support import fake_driver
from support.e2e import Output, Server, wait_until
from support.fake_driver import write_host_file
from support.live_server import clean_env, flexium_command

pytestmark = pytest.mark.timeout(240)

GPU_MIB = 143771  # the simulated driver's GPUs (FAKE_CUDA_TOTAL_MIB's default)
FULL = (GPU_MIB - 1024) << 20  # a neighbour that leaves 1 GiB on a GPU: less than the job asks for

# Holds 2 GiB on the GPU flexium run gave it (GPU_DEVICE), as a CUDA job would, and runs until told.
JOB = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path

    from support.fake_driver import FakeDriver

    import flexium
    import flexium.auto

    ordinal = int(os.environ["GPU_DEVICE"].split(":")[1])
    FakeDriver(Path(os.environ["FLEXIUM_LIBCUDA"])).set_process_memory(ordinal, 2 << 30)
    flexium.init()
    print("job", flexium.auto.get_process_id(), os.environ["GPU_DEVICE"], os.environ["FLEXIUM_PRIORITY"], flush=True)
    stop = Path(sys.argv[1])
    while not stop.exists():
        time.sleep(0.05)
    sys.exit(int(stop.read_text() or "0"))
    """
)


class Run:
    """``flexium run --memory 4GiB -- python job.py STOP`` in the background."""

    def __init__(self, server: Server, tmp: Path, host_file: Path, *options: str) -> None:
        self.stop_file = tmp / f"stop-{len(list(tmp.glob('job-*.py')))}"
        script = tmp / f"job-{len(list(tmp.glob('job-*.py')))}.py"
        script.write_text(JOB)
        env = clean_env(server.home)
        env.update(
            {k: v for k, v in fake_driver.subprocess_env().items() if k in ("FLEXIUM_LIBCUDA", "FLEXIUM_LIBNVML")}
        )
        env["PYTHONPATH"] = fake_driver.subprocess_env()["PYTHONPATH"]
        env.update({"FAKE_CUDA_HOST_FILE": str(host_file), "FLEXIUM_SERVER": server.address})
        env["FLEXIUM_TOKEN"] = server.token or ""
        command = [
            *flexium_command(),
            "run",
            "--memory",
            "4GiB",
            *options,
            "--",
            sys.executable,
            str(script),
            str(self.stop_file),
        ]
        self.proc = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=server.home
        )
        self.output = Output(self.proc)

    def started(self) -> tuple[str, str]:
        match = self.output.wait_for(r"^job (\S+) (cuda:\d+) (\d+)$", 60)
        return match.group(1), match.group(2)

    def end(self, code: int = 0) -> int:
        self.stop_file.write_text(str(code))
        return self.proc.wait(30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _placements(server: Server) -> list[dict[str, Any]]:
    answer: list[dict[str, Any]] = server.get("/placements", params={"all": "true"}).json()
    return answer


def test_a_job_starts_on_the_gpu_with_room(server: Server, tmp_path: Path) -> None:
    host_file = tmp_path / "neighbours"
    write_host_file(host_file, {0: FULL})
    run = Run(server, tmp_path, host_file, "--priority", "high")
    try:
        process_id, device = run.started()
        assert device == "cuda:1"
        process = wait_until(lambda: server.process(process_id), 20, "the job to register")
        assert process["gpu_index"] == 1 and len(process["visible_gpus"]) == 2  # it sees every GPU
        assert process["priority"] == 90
        placement = _placements(server)[0]
        assert placement["state"] == "started" and placement["process_id"] == process_id
        assert placement["placed_index"] == 1 and placement["reservation"] is None
        tokens = {t["name"]: t for t in server.get("/tokens").json()}
        minted = tokens[f"flexium run, placement {placement['id']}"]
        assert minted["role"] == "job" and not minted["revoked"]
        assert run.end(3) == 3, run.output.text[-3000:]  # the job's exit status is flexium run's
        tokens = {t["name"]: t for t in server.get("/tokens").json()}
        assert tokens[f"flexium run, placement {placement['id']}"]["revoked"]
    finally:
        run.kill()


def test_with_both_gpus_full_it_waits_then_starts_when_the_neighbour_leaves(server: Server, tmp_path: Path) -> None:
    host_file = tmp_path / "neighbours"
    write_host_file(host_file, {0: FULL, 1: FULL})
    run = Run(server, tmp_path, host_file)
    try:
        run.output.wait_for(r"^flexium run: placement (\d+) waits \(place 1 in line\): waits for 4.5 GiB", 60)
        waiting = [p for p in _placements(server) if p["state"] == "waiting"]
        assert len(waiting) == 1 and "GPU 0: 1.0 GiB free; GPU 1: 1.0 GiB free" in waiting[0]["note"]
        write_host_file(host_file, {1: FULL})
        _, device = run.started()
        assert device == "cuda:0"
        assert run.end() == 0
    finally:
        run.kill()


def test_ctrl_c_while_it_waits_cancels_and_while_the_job_runs_reaches_the_job(server: Server, tmp_path: Path) -> None:
    host_file = tmp_path / "neighbours"
    write_host_file(host_file, {0: FULL, 1: FULL})
    waiting = Run(server, tmp_path, host_file)
    try:
        waiting.output.wait_for(r"^flexium run: placement (\d+) waits", 60)
        waiting.proc.send_signal(signal.SIGINT)
        assert waiting.proc.wait(30) == 130
        assert _placements(server)[0]["state"] == "cancelled"
    finally:
        waiting.kill()
    write_host_file(host_file, {})
    running = Run(server, tmp_path, host_file)
    try:
        running.started()
        running.proc.send_signal(signal.SIGINT)
        assert running.proc.wait(30) == 130  # the job ended by the SIGINT passed on to it
    finally:
        running.kill()
