"""``flexium run`` in the e2e tests: a job that holds 2 GiB on the GPU flexium run gave it (as a CUDA
job would, on the simulated driver) and runs until told, started through the real command in the
background."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from support import fake_driver
from support.e2e import Output, Server
from support.live_server import clean_env, flexium_command

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
