"""Runs one measurement in a fresh process and reads back its result line, for the probes that
test one thing per process (a checkpoint is process-wide)."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Child:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float

    def result(self, *, failed: dict[str, Any], timeout: float) -> dict[str, Any]:
        """The last `{"event": "result", ...}` line it printed, with how it ended; `failed` (plus
        an error) when it printed none, and its stderr tail whenever it did not end well."""
        records = []
        for line in self.stdout.splitlines():
            if line.startswith('{"event": "result"'):
                try:
                    records.append(json.loads(line))
                except ValueError:
                    pass
        if records:
            result = records[-1]
        else:
            error = f"killed after {timeout:g} s" if self.timed_out else f"exit status {self.returncode}, no result"
            result = {**failed, "ok": False, "error": error}
        result.update(returncode=self.returncode, wall_s=self.wall_s, timed_out=self.timed_out)
        if result.get("ok") and self.returncode != 0:
            result.update(ok=False, error=f"exit status {self.returncode} after its result")
        if not result.get("ok"):
            result["stderr_tail"] = self.stderr[-4000:]
        return result


def run_child(argv: list[str], env: dict[str, str], timeout: float) -> Child:
    """Runs `argv` in a process group of its own; past `timeout` the whole group is killed, and
    anything of the group left after it exits (a helper it started) too."""
    started = time.perf_counter()
    timed_out = False
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            returncode = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if returncode is None:
            returncode = proc.wait()
        out.seek(0)
        err.seek(0)
        return Child(
            returncode,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            timed_out,
            time.perf_counter() - started,
        )


class Talking:
    """A probe's own script run as a child that answers each order (a line on its stdin) with a
    JSON line: for the probes whose child holds a GPU job across several steps of the parent's."""

    def __init__(self, argv: list[str], *, pass_fds: tuple[int, ...] = ()) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=pass_fds
        )

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the job exited ({self.proc.wait()})")
        return dict(json.loads(line))

    def order(self, what: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()

    def ask(self, what: str) -> dict[str, Any]:
        self.order(what)
        said = self.read()
        if "error" in said:
            raise RuntimeError(f"{what}: {said['error']}")
        return said

    def end(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def run_parts(script: str, parts: list[str], timeout: float) -> list[dict[str, Any]]:
    """Runs `script --part PART` for each part, each in a fresh process; their results, each also
    printed as it comes (a run cut short keeps them)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_MODULE_LOADING": "LAZY"}
    results = []
    for part in parts:
        child = run_child([sys.executable, script, "--part", part], env, timeout)
        result = child.result(failed={"part": part}, timeout=timeout)
        results.append(result)
        print(json.dumps(result, default=str)[:1500], flush=True)
    return results


def report_part(part: str, measure: Callable[[dict[str, Any]], None]) -> int:
    """In a part's process: runs `measure` on its result and prints the result line run_parts
    reads, its failure included; the exit status says whether it went well."""
    faulthandler.enable()
    result: dict[str, Any] = {"part": part, "ok": False}
    try:
        measure(result)
    except BaseException as exc:  # reported in the result line, which the parent reads
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    print(json.dumps({"event": "result", **result}, default=str), flush=True)
    return 0 if result.get("ok") else 1
