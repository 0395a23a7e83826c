"""`flexium demo`: the README's first command. A server on its default SQLite file (under a
home of the test's own), the demo job attached, the dashboard link; Ctrl-C stops both."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest
import requests

from support.e2e import clean_env, flexium_command, wait_until
from support.live_server import start_demo

pytestmark = pytest.mark.timeout(180)

# As the quick start says to write it: tensors on the CPU where the GPUs are simulated.
OWN_SCRIPT = """
import os
import time

import torch

import flexium
import flexium.simulated

flexium.init()
if os.environ.get("HOLD_BYTES"):  # simulated GPU memory, as the quick start says
    flexium.simulated.hold_job_memory(flexium.auto.get_device(), int(os.environ["HOLD_BYTES"]))
device = "cpu" if flexium.simulated.active() else flexium.auto.get_device()
model = torch.nn.Linear(8, 1).to(device)
model(torch.randn(4, 8, device=device)).sum().backward()
print("trained a step on", device, flush=True)
while True:
    time.sleep(0.1)
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); its state letter says it has exited.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_demo_starts_server_and_job_and_stops_both(tmp_path: Path) -> None:
    home = tmp_path / "home"
    demo, out, port, _env = start_demo(home)
    try:
        link = out.wait_for(rf"dashboard: http://127\.0\.0\.1:{port}/login#code=(\S+)  \(works once", 60)
        code = link.group(1)
        token = out.wait_for(r"admin token \(for the CLI and the dashboard\): (flx_\S+)$", 90).group(1)
        assert token not in link.group(0)
        server_pid = int(out.wait_for(r"server http://\S+ \(pid (\d+);", 1).group(1))
        job_pid = int(out.wait_for(r"demo training job started \(pid (\d+)\)", 30).group(1))
        registered = out.wait_for(r"job (gpu-[0-9a-f]+) registered \(RUNNING", 90)
        assert (home / ".flexium" / "server.db").exists()
        r = requests.get(
            f"http://127.0.0.1:{port}/api/w/default/processes", headers={"Authorization": f"Bearer {token}"}, timeout=10
        )
        assert r.status_code == 200
        processes = {p["process_id"]: p for p in r.json()}
        assert processes[registered.group(1)]["pid"] == job_pid
        assert requests.get(f"http://127.0.0.1:{port}/login", timeout=10).status_code == 200
        # the login link's code opens a dashboard session once
        login = f"http://127.0.0.1:{port}/login"
        assert requests.post(login, data={"code": code}, allow_redirects=False, timeout=10).status_code == 303
        assert requests.post(login, data={"code": code}, allow_redirects=False, timeout=10).status_code == 401
        # the job was handed a job token of its own, not the admin's
        tokens = requests.get(
            f"http://127.0.0.1:{port}/api/w/default/tokens", headers={"Authorization": f"Bearer {token}"}, timeout=10
        ).json()
        [job_token] = [t for t in tokens if t["name"] == "flexium demo job" and not t["revoked"]]
        [your_token] = [t for t in tokens if t["name"] == "your jobs beside flexium demo" and not t["revoked"]]
        assert job_token["role"] == your_token["role"] == "job"
        # the line for a job of one's own hands another job token: the audit log tells those jobs apart
        handed = out.wait_for(r"a job of yours.*: FLEXIUM_SERVER=\S+ FLEXIUM_TOKEN=(flx_\S+) .*python train\.py", 10)
        assert handed.group(1) != token and handed.group(1).startswith(your_token["prefix"])
        out.wait_for(r"\[demo job\] step", 30)

        demo.send_signal(signal.SIGINT)
        assert demo.wait(30) == 0, out.text
        out.wait_for(r"flexium demo: stopped$", 5)
        wait_until(lambda: _gone(server_pid) and _gone(job_pid), 10, "the server and the job to exit")
        with pytest.raises(requests.ConnectionError):
            requests.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        assert "Traceback" not in out.text, out.text
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()


def test_demo_says_what_is_missing_when_the_port_is_taken(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [*flexium_command(), "demo", "--port", str(port)],
            env=clean_env(home),
            cwd=home,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert re.search(rf"port {port} .* is in use", done.stderr), done.stderr


def test_a_second_demo_on_the_same_database_says_where_the_first_one_is(tmp_path: Path) -> None:
    """The demo's SQLite database takes one server: a second demo (another port, the same home) refuses
    before it makes anything, naming the first one's dashboard, and the first one goes on."""
    home = tmp_path / "home"
    demo, out, port, env = start_demo(home)
    try:
        out.wait_for(r"admin token \(for the CLI and the dashboard\): (flx_\S+)$", 90)
        done = subprocess.run(
            [*flexium_command(), "demo", "--port", str(port + 1)],
            env=env,
            cwd=home,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 1, done.stderr
        assert done.stderr.startswith("flexium demo: a flexium server already serves the demo's database "), done.stderr
        assert f"(its dashboard: http://127.0.0.1:{port})" in done.stderr and "revoked" not in done.stderr
        assert requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).ok
    finally:
        demo.send_signal(signal.SIGINT)
        if demo.wait(30) != 0:
            demo.kill()


def test_without_a_gpu_the_demo_job_runs_on_a_simulated_host_that_says_so(tmp_path: Path) -> None:
    """This machine has no NVIDIA GPU: the demo offers two simulated GPUs, and the job on them
    migrates, pauses and resumes by the command line; every GPU shown is named SIMULATED."""
    home = tmp_path / "home"
    demo, out, port, env = start_demo(home)
    try:
        out.wait_for(r"SIMULATED: no NVIDIA GPU is used; the job runs on a simulated host with two simulated GPUs", 60)
        process_id = out.wait_for(r"job (gpu-[0-9a-f]+) registered \(RUNNING on cuda:0, SIMULATED GPU", 90).group(1)
        token = out.wait_for(r"admin token \(for the CLI and the dashboard\): (flx_\S+)$", 10).group(1)
        out.wait_for(r"\[demo job\] step .* on cuda:0 \(simulated\)$", 30)
        assert "CPU-only build" not in out.text, out.text  # no warning about what does not apply
        cli_env = {**env, "FLEXIUM_SERVER": f"127.0.0.1:{port}/default", "FLEXIUM_TOKEN": token}

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*flexium_command(), *args], env=cli_env, capture_output=True, text=True, timeout=120, cwd=home
            )

        def job() -> dict[str, Any]:
            [shown] = [p for p in json.loads(cli("ps", "--json").stdout) if p["process_id"] == process_id]
            return cast(dict[str, Any], shown)

        # the demo job reports its loss (flexium.auto.report): its page draws the curve
        wait_until(lambda: job()["loss"] is not None, 30, "the demo job's loss to reach the server")
        devices = cli("devices", "--json")
        assert devices.returncode == 0, devices.stderr
        [host] = json.loads(devices.stdout)["hosts"]
        assert [d["name"] for d in host["devices"]] == ["SIMULATED GPU (flexium demo)"] * 2
        moved = cli("migrate", process_id, "cuda:1", "--json")
        assert moved.returncode == 0, moved.stderr
        assert json.loads(moved.stdout)["state"] == "succeeded"
        out.wait_for(r"\[demo job\] step .* on cuda:1 \(simulated\)$", 30)
        moved_job = job()
        assert moved_job["physical_device"] == "cuda:1" and moved_job["gpu_model"] == "SIMULATED GPU (flexium demo)"
        assert moved_job["memory_bytes"] == 6 << 30  # the simulated memory it holds moved with it
        assert moved_job["driver_version"] == moved_job["capabilities"]["driver_version"] == "580.159.04 (simulated)"
        assert moved_job["simulated"] is True  # the field that marks its figures as simulated
        listed = cli("ps")
        assert f"{process_id} runs on flexium's simulated host" in listed.stderr, listed.stderr
        paused = cli("pause", process_id)
        assert paused.returncode == 0, paused.stderr
        # Its timings and memory are the simulation's: said so, and no rate is made of them.
        assert "succeeded in " in paused.stdout and " s on simulated GPUs" in paused.stdout, paused.stdout
        assert "simulated operation" in paused.stdout and "GB/s" not in paused.stdout, paused.stdout
        assert cli("resume", process_id, "cuda:0").returncode == 0
        out.wait_for(r"\[demo job\] step .* on cuda:0 \(simulated\)$", 30)

        # The line the demo prints runs a script of one's own on the simulated host.
        line = out.wait_for(r"a job of yours on the simulated host: (.*) python train\.py  \(a job token", 10)
        own_env = dict(assignment.split("=", 1) for assignment in shlex.split(line.group(1)))
        script = home / "train.py"
        script.write_text(OWN_SCRIPT)
        own = subprocess.Popen(
            [sys.executable, str(script)], env={**env, **own_env}, cwd=home, stdout=subprocess.PIPE, text=True
        )
        try:
            assert own.stdout is not None and own.stdout.readline().strip() == "trained a step on cpu"
            wait_until(
                lambda: any(
                    p["pid"] == own.pid and p["gpu_model"] == "SIMULATED GPU (flexium demo)"
                    for p in json.loads(cli("ps", "--json").stdout)
                ),
                30,
                "the script of one's own to register on the simulated host",
            )
            # Every process of the simulated host sees the demo job's 6 GiB on GPU 0, as NVML shows
            # another process's memory on a real host: a job asking 76 of GPU 0's 80 GiB waits there.
            run = subprocess.Popen(
                [*flexium_command(), "run", "--gpu", "cuda:0", "--memory", "76GiB", "--", sys.executable, "-c", "1"],
                env={**env, **own_env, "FLEXIUM_TOKEN": token},
                cwd=home,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                assert run.stderr is not None
                said = run.stderr.readline()
                assert re.match(r"flexium run: placement \d+ waits .*: GPU 0: 74\.0 GiB free$", said), said
            finally:
                run.send_signal(signal.SIGINT)
                run.wait(30)
            [host] = json.loads(cli("devices", "--json").stdout)["hosts"]
            assert host["devices"][0]["memory_used"] == 6 << 30, host["devices"]

            # Simulated GPU memory is a count: a job holding twice this machine's memory pauses and resumes.
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            big_env = {**env, **own_env, "FAKE_CUDA_TOTAL_MIB": str(3 * ram >> 20), "HOLD_BYTES": str(2 * ram)}
            big = subprocess.Popen(
                [sys.executable, str(script)], env=big_env, cwd=home, stdout=subprocess.PIPE, text=True
            )
            try:
                assert big.stdout is not None and big.stdout.readline().strip() == "trained a step on cpu"
                wait_until(
                    lambda: any(p["pid"] == big.pid for p in json.loads(cli("ps", "--json").stdout)),
                    30,
                    "the large simulated job to register",
                )
                [big_id] = [p["process_id"] for p in json.loads(cli("ps", "--json").stdout) if p["pid"] == big.pid]
                paused_big = cli("pause", big_id)
                assert paused_big.returncode == 0, paused_big.stdout + paused_big.stderr
                assert cli("resume", big_id).returncode == 0
            finally:
                big.send_signal(signal.SIGINT)
                big.wait(30)
        finally:
            own.send_signal(signal.SIGINT)
            own.wait(30)
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)
            demo.wait(30)
