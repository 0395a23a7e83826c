"""Real 2-rank jobs (gloo, CPU torch, the fake driver) attached to a real server and moved as a
whole by the `flexium` command: both ranks register as one job, a pause and a resume reach every
rank, a swap moves both, a move that would put two ranks on one GPU is refused, and the loss
traces match an undisturbed run bit for bit. Two launchers: torchrun (the ranks are children of
its agent) and PyTorch Lightning's `strategy="ddp"` (rank 0 is the process started, which starts
rank 1 itself). And on four fake GPUs, the four-GPU cases of tests/gpu/test_four_gpus.py: one
rank moved alone, then the whole job, paused and resumed elsewhere; a job of four ranks paused,
resumed and two of its ranks swapped."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from support import fake_driver
from support.e2e import JOBS, Server, clean_env, wait_until
from support.live_server import ProcessOutput

pytestmark = pytest.mark.timeout(480)


def _torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] + [
        str(JOBS / "torchrun_job.py")
    ]


LAUNCHES = {
    "torchrun": _torchrun(2),
    "lightning-ddp": [sys.executable, str(JOBS / "lightning_ddp_job.py")],
}


def _launch(argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    if argv == LAUNCHES["lightning-ddp"]:
        import importlib.util

        if importlib.util.find_spec("lightning") is None:
            pytest.fail("this test needs lightning==2.6.6 (ci/test.sh installs it)", pytrace=False)
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


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


class MovedJob:
    """A distributed job attached to the server, moved by the `flexium` command, then compared
    bit for bit with an undisturbed run of as many steps. ``extra``: the environment of both
    runs (``FAKE_CUDA_GPUS``)."""

    def __init__(self, server: Server, tmp_path: Path, argv: list[str], world: int, **extra: str) -> None:
        self.server, self.argv, self.world, self.extra = server, argv, world, extra
        self.stop = tmp_path / "stop"
        env = _env(server, FLEXIUM_SERVER=server.address, FLEXIUM_TOKEN=server.job_token or "", **extra)
        self.job = _launch(argv, {**env, "E2E_STOP": str(self.stop)})
        self.output = ProcessOutput(self.job)
        self.reference: subprocess.Popen[str] | None = None

    def __enter__(self) -> MovedJob:
        try:
            for rank in range(self.world):
                self.output.wait_for(rf"^ready {rank} gpu-", 240)
        except AssertionError:
            self.job.send_signal(signal.SIGABRT)  # faulthandler: where the launcher and its ranks wait
            time.sleep(3)
            self.__exit__()
            raise AssertionError(f"the job did not start:\n{self.output.text[-6000:]}") from None
        found = wait_until(self._movable, 60, f"{self.world} ranks registered as one movable job")
        assert len({p["job"]["key"] for p in found}) == 1
        self.rank0 = found[0]["process_id"]
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in (self.job, self.reference):
            if proc is not None and proc.poll() is None:
                proc.kill()

    def ranks(self) -> list[dict[str, Any]]:
        """Its ranks as the server lists them, by rank (a job of this size that is not stale)."""
        listed = self.server.get("/processes").json()
        found = [p for p in listed if p.get("job") and p["job"]["world_size"] == self.world and not p["stale"]]
        return sorted(found, key=lambda p: p["job"]["rank"])

    def _movable(self) -> list[dict[str, Any]] | None:
        found = self.ranks()
        ok = len(found) == self.world and all(p["capabilities"].get("job_operations") for p in found)
        return found if ok else None

    def gpus(self) -> dict[int, tuple[str, list[str]]]:
        """rank -> (its GPU, the other GPUs it holds memory on)."""
        return {p["job"]["rank"]: (p["gpu_uuid"], p["other_gpus"]) for p in self.ranks()}

    def command(self, *args: str) -> dict[str, Any]:
        """``flexium ARGS --json``: one job operation, succeeded on every rank."""
        done = self.server.cli(*args, "--json", timeout=120)
        assert done.returncode == 0, (
            f"flexium {' '.join(args)}:\n{done.stdout}\n{done.stderr}\n{self.output.text[-3000:]}"
        )
        operation = json.loads(done.stdout)
        assert operation["state"] == "succeeded" and len(operation["commands"]) == self.world, operation
        return operation

    def finish(self) -> dict[int, dict[str, Any]]:
        """Stops it, and checks each rank's loss trace against an undisturbed run's; its traces."""
        self.stop.touch()
        assert self.job.wait(timeout=120) == 0, self.output.text[-4000:]
        moved = _traces(self.output)
        steps = len(moved[0]["losses"])
        self.reference = _launch(self.argv, _env(self.server, E2E_STEPS=str(steps), **self.extra))
        undisturbed = ProcessOutput(self.reference)
        assert self.reference.wait(timeout=120) == 0, undisturbed.text[-4000:]
        for rank in range(self.world):
            assert moved[rank]["losses"] == _traces(undisturbed)[rank]["losses"], f"rank {rank} differs"
        return moved


@pytest.mark.parametrize("how", LAUNCHES)
def test_a_distributed_job_is_paused_resumed_and_swapped_as_a_whole(how: str, server: Server, tmp_path: Path) -> None:
    with MovedJob(server, tmp_path, LAUNCHES[how], 2) as job:
        job.command("pause", job.rank0)
        assert [p["state"] for p in job.ranks()] == ["PAUSED", "PAUSED"]
        job.command("resume", job.rank0)
        before = job.gpus()
        swapped = job.command("migrate", job.rank0, "--ranks", "0=cuda:1,1=cuda:0")
        assert swapped["moves"] == {"0": before[1][0], "1": before[0][0]}
        assert job.gpus() == {0: before[1], 1: before[0]}
        refused = server.cli("migrate", job.rank0, "cuda:0")  # onto rank 1's GPU
        assert refused.returncode == 1 and "rank" in refused.stderr, refused.stderr
        moved = job.finish()
        assert moved[0]["device"] == "cuda:1" and moved[1]["device"] == "cuda:0"


FOUR_GPUS = {"FAKE_CUDA_GPUS": "4"}


def test_one_rank_moves_alone_then_the_whole_job_then_it_resumes_where_it_started(
    server: Server, tmp_path: Path
) -> None:
    """A 2-rank job on GPUs 0 and 1: rank 1 alone to GPU 2 (rank 0 stays, though it stops at the
    same step), the whole job to GPUs 2 and 3, paused, and resumed on GPUs 0 and 1; after each
    move every rank is shown on its one GPU."""
    with MovedJob(server, tmp_path, _torchrun(2), 2, **FOUR_GPUS) as job:
        gpu = job.ranks()[0]["visible_gpus"]
        assert len(gpu) == 4 and job.gpus() == {0: (gpu[0], []), 1: (gpu[1], [])}
        alone = job.command("migrate", job.ranks()[1]["process_id"], "cuda:2")
        assert alone["moves"] == {"1": gpu[2]}
        assert [c["result"]["kind"] for c in alone["commands"]] == ["migrate", "migrate"]
        assert job.gpus() == {0: (gpu[0], []), 1: (gpu[2], [])}
        whole = job.command("migrate", job.rank0, "--ranks", "0=cuda:2,1=cuda:3")
        assert whole["moves"] == {"0": gpu[2], "1": gpu[3]}
        assert job.gpus() == {0: (gpu[2], []), 1: (gpu[3], [])}
        job.command("pause", job.rank0)
        assert [p["state"] for p in job.ranks()] == ["PAUSED", "PAUSED"]
        assert all(p["memory_bytes"] == 0 for p in job.ranks())
        home = job.command("resume", job.rank0, "--ranks", "0=cuda:0,1=cuda:1")
        assert {c["target_uuid"] for c in home["commands"]} == {gpu[0], gpu[1]}
        assert job.gpus() == {0: (gpu[0], []), 1: (gpu[1], [])}
        moved = job.finish()
        assert moved[0]["device"] == "cuda:0" and moved[1]["device"] == "cuda:1"


def test_a_four_rank_job_is_paused_resumed_and_two_of_its_ranks_swapped(server: Server, tmp_path: Path) -> None:
    """Four ranks (gloo; on GPUs, FSDP2 over NCCL) paused and resumed as a whole, then ranks 1 and
    2 swap GPUs while ranks 0 and 3 stay."""
    with MovedJob(server, tmp_path, _torchrun(4), 4, **FOUR_GPUS) as job:
        gpu = job.ranks()[0]["visible_gpus"]
        job.command("pause", job.rank0)
        assert [p["state"] for p in job.ranks()] == ["PAUSED"] * 4
        job.command("resume", job.rank0)
        swapped = job.command("migrate", job.rank0, "--ranks", "1=cuda:2,2=cuda:1")
        assert swapped["moves"] == {"1": gpu[2], "2": gpu[1]}
        assert job.gpus() == {0: (gpu[0], []), 1: (gpu[2], []), 2: (gpu[1], []), 3: (gpu[3], [])}
        moved = job.finish()
        assert [moved[rank]["device"] for rank in range(4)] == ["cuda:0", "cuda:2", "cuda:1", "cuda:3"]
