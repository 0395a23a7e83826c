"""Real 2-rank jobs (gloo, CPU torch, the fake driver) attached to a real server and moved as a
whole by the `flexium` command: both ranks register as one job, a pause and a resume reach every
rank, a swap moves both, a move that would put two ranks on one GPU is refused, and the loss
traces match an undisturbed run bit for bit. Two launchers: torchrun (the ranks are children of
its agent) and PyTorch Lightning's `strategy="ddp"` (rank 0 is the process started, which starts
rank 1 itself)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

import fake_driver
from e2e_helpers import HERE, Server, clean_env, wait_until
from live_server import ProcessOutput

pytestmark = pytest.mark.timeout(480)

LAUNCHES = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    + [str(HERE / "torchrun_job.py")],
    "lightning-ddp": [sys.executable, str(HERE / "lightning_ddp_job.py")],
}


def _launch(how: str, env: dict[str, str]) -> subprocess.Popen[str]:
    if how == "lightning-ddp":
        import importlib.util

        if importlib.util.find_spec("lightning") is None:
            pytest.fail("this test needs lightning==2.6.6 (ci/test.sh installs it)", pytrace=False)
    return subprocess.Popen(LAUNCHES[how], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _env(server: Server, **extra: str) -> dict[str, str]:
    env = clean_env(server.home)
    env["PYTHONFAULTHANDLER"] = "1"
    fake = fake_driver.subprocess_env(fake_driver.build())
    env.update({k: v for k, v in fake.items() if k in ("FLEXIUM_LIBCUDA", "FLEXIUM_LIBNVML", "PYTHONPATH")})
    env.update(extra)
    return env


def _traces(output: ProcessOutput) -> dict[int, dict[str, Any]]:
    found = [json.loads(line) for line in output.lines if line.startswith('{"rank"')]
    return {entry["rank"]: entry for entry in found}


@pytest.mark.parametrize("how", LAUNCHES)
def test_a_distributed_job_is_paused_resumed_and_swapped_as_a_whole(how: str, server: Server, tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    job = _launch(
        how, _env(server, FLEXIUM_SERVER=server.address, FLEXIUM_TOKEN=server.job_token or "", E2E_STOP=str(stop))
    )
    output = ProcessOutput(job)
    reference: Optional[subprocess.Popen[str]] = None
    try:
        try:
            for rank in (0, 1):
                output.wait_for(rf"^ready {rank} gpu-", 240)
        except AssertionError:
            job.send_signal(signal.SIGABRT)  # faulthandler: where torchrun and its ranks wait
            time.sleep(3)
            raise AssertionError(f"the {how} job did not start:\n{output.text[-6000:]}") from None

        def ranks() -> Optional[list[dict[str, Any]]]:
            listed = server.get("/processes").json()
            found = sorted((p for p in listed if p.get("job")), key=lambda p: p["job"]["rank"])
            ok = len(found) == 2 and all(p["capabilities"].get("job_operations") for p in found)
            return found if ok else None

        found = wait_until(ranks, 60, "both ranks registered as one movable job")
        assert found[0]["job"]["key"] == found[1]["job"]["key"]
        rank0 = found[0]["process_id"]

        def job_command(*args: str) -> dict[str, Any]:
            done = server.cli(*args, "--json", timeout=120)
            assert done.returncode == 0, (
                f"flexium {' '.join(args)}:\n{done.stdout}\n{done.stderr}\n{output.text[-3000:]}"
            )
            operation = json.loads(done.stdout)
            assert operation["state"] == "succeeded" and len(operation["commands"]) == 2, operation
            return operation

        job_command("pause", rank0)
        assert [p["state"] for p in server.get("/processes").json() if p.get("job")] == ["PAUSED", "PAUSED"]
        job_command("resume", rank0)
        before = {p["job"]["rank"]: p["gpu_uuid"] for p in ranks() or []}
        swapped = job_command("migrate", rank0, "--ranks", "0=cuda:1,1=cuda:0")
        assert swapped["moves"] == {"0": before[1], "1": before[0]}
        after = {p["job"]["rank"]: p["gpu_uuid"] for p in ranks() or []}
        assert after == {0: before[1], 1: before[0]}
        refused = server.cli("migrate", rank0, "cuda:0")  # onto rank 1's GPU
        assert refused.returncode == 1 and "rank" in refused.stderr, refused.stderr

        stop.touch()
        assert job.wait(timeout=120) == 0, output.text[-4000:]
        moved = _traces(output)
        steps = len(moved[0]["losses"])
        reference = _launch(how, _env(server, E2E_STEPS=str(steps)))
        undisturbed = ProcessOutput(reference)
        assert reference.wait(timeout=120) == 0, undisturbed.text[-4000:]
        for rank in (0, 1):
            assert moved[rank]["losses"] == _traces(undisturbed)[rank]["losses"], f"rank {rank} differs"
        assert moved[0]["device"] == "cuda:1" and moved[1]["device"] == "cuda:0"
    finally:
        for proc in (job, reference):
            if proc is not None and proc.poll() is None:
                proc.kill()
