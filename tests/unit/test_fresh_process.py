"""tests/gpu's one helper for running a check in a fresh process (tests/support/fresh_process.py), on the
CPU: a body runs in a process of its own, started with the environment given, and hands back what
it returned; a body that fails, dies of a signal or outlives its time fails the test, and what it
printed shows."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from support.fresh_process import run_in_fresh_process


def passes(value: int, name: str) -> dict[str, Any]:
    print("the body's own output")
    return {"value": value, "env": os.environ.get(name), "pid": os.getpid()}


def fails() -> None:
    print("what it printed before", file=sys.stderr)
    raise AssertionError("the body's own message")


def crashes() -> None:
    ctypes.string_at(0)  # reads address 0: SIGSEGV


def hangs() -> None:
    time.sleep(600)


def leaves_a_thread_that_never_ends() -> str:
    threading.Thread(target=time.sleep, args=(600,)).start()  # an orderly exit would wait for it
    return "handed back"


@pytest.fixture(autouse=True)
def job_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OUT", str(tmp_path))
    return tmp_path / "jobs.log"


def test_a_body_runs_in_a_process_of_its_own_with_the_environment_given(job_logs: Path) -> None:
    seen = run_in_fresh_process(passes, 42, "FRESH_PROCESS_PROBE", env={"FRESH_PROCESS_PROBE": "set"}, timeout=60)
    assert seen["value"] == 42 and seen["env"] == "set" and seen["pid"] != os.getpid()
    assert "FRESH_PROCESS_PROBE" not in os.environ
    kept = job_logs.read_text()
    assert "test_fresh_process.passes (a fresh process) 42 'FRESH_PROCESS_PROBE'" in kept and "exit=0" in kept
    assert "the body's own output" in kept


def test_a_body_that_fails_fails_the_test_with_its_traceback() -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        run_in_fresh_process(fails, timeout=60)
    said = str(failed.value)
    assert said.startswith("test_fresh_process.fails failed in its fresh process (exit 1):"), said
    assert "AssertionError: the body's own message" in said and "what it printed before" in said, said


def test_a_body_that_dies_of_a_signal_fails_the_test_with_its_stacks() -> None:
    with pytest.raises(pytest.fail.Exception) as failed:
        run_in_fresh_process(crashes, timeout=60)
    said = str(failed.value)
    assert said.startswith("test_fresh_process.crashes died of SIGSEGV in its fresh process:"), said
    assert "Fatal Python error: Segmentation fault" in said and "in crashes" in said, said


def test_a_body_that_outlives_its_time_fails_the_test_with_its_stacks() -> None:
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        run_in_fresh_process(hangs, timeout=16)  # its stacks after 1 s
    said = str(failed.value)
    assert "Timeout (0:00:01)!" in said and "in hangs" in said, said
    assert time.monotonic() - started < 15


def test_a_body_that_leaves_its_process_unable_to_exit_hands_back_its_result_at_once() -> None:
    assert run_in_fresh_process(leaves_a_thread_that_never_ends, timeout=60, exit_at_once=True) == "handed back"
