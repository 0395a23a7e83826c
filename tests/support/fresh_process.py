"""A GPU test's work in a fresh Python process, through one helper: the checkpoint state of a process
and the driver flexium._C loads are process-wide, so no two checks may share a process, and none
may run in pytest's (which only reads NVML).

``run_in_fresh_process(body, *args, env=...)`` runs ``body(*args)``, a function of a test module,
in a new interpreter of its own process group, started with ``env`` over this environment (so that
FLEXIUM_LIBCUDA, LD_PRELOAD and the like hold before anything loads), and hands back what it
returned (pickled). A body that raises fails the test with its traceback; one that dies of a signal
or outlives its time fails it with its output and Python stacks (faulthandler). Every run's output
is kept in $OUT/jobs.log (keep_log), as are the jobs' that tests start themselves (their scripts:
programs that must be separate, torchrun's ranks, a job a server drives, bench/jobs/).

Run as a script, this file is the child's side: it reads the request from stdin."""

from __future__ import annotations

import faulthandler
import importlib
import inspect
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

HERE = Path(__file__).resolve().parent
T = TypeVar("T")


def keep_log(args: tuple[str, ...], env: dict[str, str] | None, code: int | None, stdout: str, stderr: str) -> None:
    """Every job's output, appended to one file in $OUT, survives a run that is cut short."""
    folder = Path(os.environ.get("OUT") or HERE.parent.parent / "gpu-results")
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "jobs.log", "a") as log:
        log.write(
            f"\n===== job {' '.join(args)} env={env or {}} exit={code}\n{stdout}\n----- stderr\n{stderr[-40000:]}\n"
        )


def end_process_group(proc: subprocess.Popen[Any], settle: Callable[[float], T]) -> T | None:
    """Ends a job started in its own process group (``start_new_session``), its launcher and every
    process: SIGABRT first (with PYTHONFAULTHANDLER each writes its Python stacks), SIGKILL if
    ``settle`` (which waits for it, draining its output) times out after 20 s. ``settle``'s result;
    None if it was killed."""
    try:
        os.killpg(proc.pid, signal.SIGABRT)
        try:
            return settle(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # every process of the group has ended already
        pass
    return None


def run_in_fresh_process(
    body: Callable[..., T],
    *args: Any,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    exit_at_once: bool = False,
) -> T:
    """``exit_at_once``: the process ends with os._exit once the result is handed back, for a body
    that leaves it unable to shut down (a checkpointed process whose CUDA calls never return)."""
    name = f"{body.__module__}.{body.__qualname__}"
    with tempfile.TemporaryDirectory(prefix="flexium-fresh-process-") as folder:
        result = Path(folder) / "result.pickle"
        request = {
            # the body's folder first: its module is imported by the bare name pytest gave it
            "path": [str(Path(inspect.getfile(body)).parent), *sys.path],
            "module": body.__module__,
            "name": body.__qualname__,
            "args": args,
            "result": str(result),
            "exit_at_once": exit_at_once,
            # its stacks, and an exit, before this process would end it
            "hang_s": max(1.0, timeout - 15),
        }
        proc = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,  # whatever it starts ends with it
        )
        hung = False
        try:
            out, err = proc.communicate(pickle.dumps(request), timeout=timeout)
        except subprocess.TimeoutExpired:
            hung = True
            ended = end_process_group(proc, lambda seconds: proc.communicate(timeout=seconds))
            out, err = ended if ended is not None else proc.communicate()
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        keep_log((f"{name} (a fresh process)", *map(repr, args)), env, proc.returncode, stdout, stderr)
        if proc.returncode != 0:
            try:  # what a failed body started (flexium's copier, its NVML reader) goes with it
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        tail = f"\n{stderr[-6000:]}"
        if hung:
            pytest.fail(f"{name} did not end within {timeout:g} s in its fresh process:{tail}", pytrace=False)
        if proc.returncode < 0:
            died = signal.Signals(-proc.returncode).name
            pytest.fail(f"{name} died of {died} in its fresh process:{tail}", pytrace=False)
        if proc.returncode != 0:
            pytest.fail(f"{name} failed in its fresh process (exit {proc.returncode}):{tail}", pytrace=False)
        if not result.exists():
            pytest.fail(f"{name} ended without handing back its result:{tail}", pytrace=False)
        return pickle.loads(result.read_bytes())


def _child() -> None:
    request = pickle.loads(sys.stdin.buffer.read())
    faulthandler.enable()  # a death by a signal shows where each thread was
    faulthandler.dump_traceback_later(request["hang_s"], exit=True)
    sys.path[:] = [*request["path"], *(entry for entry in sys.path if entry not in request["path"])]
    try:
        body: Any = importlib.import_module(request["module"])
        for part in request["name"].split("."):
            body = getattr(body, part)
        result = body(*request["args"])
        Path(request["result"]).write_bytes(pickle.dumps(result))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # a failed body may leave threads or a driver that would hang an orderly exit
    sys.stdout.flush()
    sys.stderr.flush()
    if request["exit_at_once"]:
        os._exit(0)


if __name__ == "__main__":
    _child()
