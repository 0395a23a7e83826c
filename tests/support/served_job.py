"""A GPU test job attached to a real server of its own and moved by the `flexium` command: one
process or the ranks of one job, each printing a JSON "ready" event with its rank and pid. What
the server lists of it, each operation's outcome, and what it holds on the GPUs by NVML."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from support.fresh_process import end_process_group, keep_log
from support.gpu import job_events

# Longer than the CLI's own wait for an outcome (cli/waiting.py, 300 s): its output is kept.
CLI_TIMEOUT_S = 360


class ServedJob:
    """``argv`` started with a job token for a server started in ``tmp`` (``nccl``: the
    libnccl.so.2 it loads). A context manager: on entering, its ``world`` processes are registered
    and movable; on leaving, the job (every process of its session) and the server end, and the
    job's output is kept with the test's logs."""

    def __init__(
        self,
        tmp: Any,
        argv: list[str],
        world: int,
        *,
        env: dict[str, str],
        nccl: str | None,
        ready_s: float = 180,
    ) -> None:
        from support.live_server import ProcessOutput, ServerProcess, clean_env

        self.argv, self.world, self.ready_s = argv, world, ready_s
        self.server = ServerProcess(tmp / "server").start()
        home = tmp / "home"
        home.mkdir()
        base = clean_env(home)
        base.update(env, FLEXIUM_SERVER=f"127.0.0.1:{self.server.port}/default", FLEXIUM_TOKEN=self.server.token or "")
        base.pop("LD_PRELOAD", None)
        self.cli_env = dict(base)
        job_env = {**base, "FLEXIUM_TOKEN": self.server.issue_job_token()}
        if nccl:
            job_env["LD_PRELOAD"] = nccl
        self.job = subprocess.Popen(
            argv,
            env=job_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a job that fails a test ends with every process it started
        )
        self.output = ProcessOutput(self.job)

    def __enter__(self) -> ServedJob:
        from support.live_server import wait_until

        try:
            ready = [
                json.loads(self.output.wait_for(rf'^\{{"event": "ready", "rank": {rank},', self.ready_s).string)
                for rank in range(self.world)
            ]
            self.pids = [event["pid"] for event in ready]
            found = wait_until(self._movable, 120, f"{self.world} process(es) registered as movable")
        except BaseException:
            self.__exit__()  # a job that never became movable ends too: __exit__ only follows a return
            raise
        self.process_id = found[0]["process_id"]  # rank 0's: a job operation names any of its ranks
        return self

    def __exit__(self, *exc: object) -> None:
        if self.job.poll() is None:
            end_process_group(self.job, lambda seconds: self.job.wait(timeout=seconds))
            self.job.wait()
        keep_log((*self.argv[1:], "(attached to a server)"), None, self.job.returncode, self.output.text, "")
        self.server.stop()

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        from support.live_server import flexium_command

        return subprocess.run(
            [*flexium_command(), *args], env=self.cli_env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S
        )

    def processes(self) -> list[dict[str, Any]]:
        """The job's processes as `flexium ps` lists them, in rank order."""
        done = self.cli("ps", "--json")
        assert done.returncode == 0, done.stderr
        ours = [p for p in json.loads(done.stdout) if p["pid"] in self.pids]
        return sorted(ours, key=lambda p: (p.get("job") or {}).get("rank", 0))

    def _movable(self) -> list[dict[str, Any]] | None:
        found = self.processes()
        capability = "job_operations" if self.world > 1 else "pause_resume"
        ok = len(found) == self.world and all(p["capabilities"].get(capability) for p in found)
        if ok and self.world > 1:  # one job, whatever launched its ranks
            ok = all(p.get("job") for p in found) and len({p["job"]["key"] for p in found}) == 1
        return found if ok else None

    def command(self, *args: str) -> list[dict[str, Any]]:
        """``flexium ARGS --json``, succeeded on every process: each one's result, in rank order."""
        done = self.cli(*args, "--json")
        assert done.returncode == 0, (
            f"flexium {' '.join(args)}: {done.stdout}\n{done.stderr}\n{self.output.text[-4000:]}"
        )
        outcome = json.loads(done.stdout)
        assert outcome["state"] == "succeeded", outcome
        if self.world == 1:
            return [outcome["result"]]
        assert len(outcome["commands"]) == self.world, outcome
        return [c["result"] for c in outcome["commands"]]

    def held(self) -> list[list[str]]:
        """The GPUs (UUIDs) each process holds memory on now, by NVML, in rank order."""
        from flexium.engine import nvml

        gpus = nvml.host_gpus()
        return [sorted(gpu.uuid for gpu in gpus if (gpu.used_by(pid) or 0) > 0) for pid in self.pids]

    def finish(self, timeout: float = 300) -> list[dict[str, Any]]:
        """The job ended well: the JSON events it printed."""
        assert self.job.wait(timeout=timeout) == 0, self.output.text[-4000:]
        return job_events(self.output.lines)
