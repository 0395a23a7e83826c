"""Fixtures and helpers shared by the engine, identity, safe-point, API and capability tests.

Everything here drives the real flexium engine over the fake NVIDIA driver (support/fake_driver.py):
no part of the engine is replaced. Two things are adapted to the fake, each said where it is done:

* ``flexium._C`` loads its driver once per process. ``driver`` points it at the fake (the same
  way tests/unit/test_native_layer.py does, so both modules run in one pytest process in any
  order) and restores FLEXIUM_LIBCUDA / FLEXIUM_LIBNVML after the module. Other driver
  configurations (old driver, no checkpoint API, no driver) run in subprocesses.
* A pause needs host memory for what it stages; the engine reads MemAvailable. The fake GPUs
  hold tens of GiB that this machine's RAM need not match, so ``fake`` models the host's
  available memory too (``HOST_AVAILABLE``; tests change it through ``host_memory``).
* While the process is frozen, flexium reads NVML in a child process (python -m
  flexium.engine.nvml). On a real machine that child sees the same GPUs as its parent; with the
  fake, every process has its own modelled machine, so the child cannot see the memory a test
  configured in the parent. ``nvml_in_parent`` therefore answers those child reads from this
  process's fake, as another process's reads (``FakeDriver.nvml_of_another_process``: the fake's
  NVML blocks a frozen process's own calls, as the real one does), and counts them, so tests still
  see *that* the engine went through the child path; ``reader_in_parent`` does the same for the
  reader's "free UUID" answers. Tests in test_engine_safe_points.py run the real child path.

Test modules import what they use: ``from support.engine import driver, fake, make_engine``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from support import fake_driver
from support.fake_driver import FakeDriver, ProcessState

GiB = 1 << 30
MiB = 1 << 20
H200_BYTES = 143771 * MiB
PID = os.getpid()
MARGIN = 512 << 20  # target_rules.DEFAULT_MEMORY_MARGIN_BYTES, restated so a silent change shows up

# The checkpoint API calls that change state (GetState / GetRestoreThreadId only read it).
STATE_CHANGING = ("Lock", "Checkpoint", "Restore", "Unlock")

FLEXIUM_ENV = ("FLEXIUM_SERVER", "GPU_DEVICE", "FLEXIUM_TOKEN", "FLEXIUM_LOG_LEVEL")


# --------------------------------------------------------------------------------- the fake driver


@pytest.fixture(scope="module")
def driver() -> Iterator[FakeDriver]:
    with fake_driver.activated() as fake:
        _point_nvml_at(fake)
        yield fake


def _point_nvml_at(fake: FakeDriver) -> None:
    """flexium.engine.nvml initialises once per process. If something queried it before the fake
    was active (and so found no NVML), it is made to try again, now with FLEXIUM_LIBNVML set."""
    from flexium.engine import nvml

    if nvml.available():
        return
    import pynvml

    pynvml.nvmlLib = None
    with nvml._lock:
        nvml._state.update(initialized=False, error=None)
    assert nvml.available(), nvml.unavailable_reason()
    assert nvml.driver_version() == "580.159.04"


HOST_AVAILABLE = 2048 * GiB


@dataclass
class HostMemory:
    available: int | None = HOST_AVAILABLE


_host = HostMemory()


@pytest.fixture
def host_memory(fake: FakeDriver) -> HostMemory:
    return _host


@pytest.fixture
def fake(driver: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDriver]:
    from flexium.engine import nvml, target_rules

    _host.available = HOST_AVAILABLE
    monkeypatch.setattr(target_rules, "host_memory_available", lambda: _host.available)
    for name in fake_driver.FAKE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    driver.reset()
    nvml.set_frozen(False)
    yield driver
    # A test that failed half way must not leave the process locked or NVML "frozen", nor a context
    # current on this thread (a released one: the next test's driver calls would run in it).
    driver.library.cuCtxSetCurrent(None)
    driver.reset()
    nvml.set_frozen(False)


@dataclass
class ChildReads:
    """NVML reads the engine sent to a child process (made while this process was frozen)."""

    count: int = 0
    threads: list[int] = field(default_factory=list)


@pytest.fixture
def nvml_in_parent(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> ChildReads:
    """See the module docstring: child-process NVML reads answered from this process's fake."""
    from flexium.engine import nvml

    reads = ChildReads()

    def read_in_child(timeout: float = 30.0) -> list[Any]:
        reads.count += 1
        reads.threads.append(threading.get_ident())
        with fake.nvml_of_another_process():
            return nvml._read_here()

    monkeypatch.setattr(nvml, "_read_in_child", read_in_child)
    return reads


@pytest.fixture
def reader_in_parent(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The NVML reader's pipes as a room check inside the locked section uses them (csrc/room_check.h),
    answered by a thread of this process from its fake (see the module docstring: the reader child
    cannot see the memory a test configured here). The requests it answered, in order."""
    import contextlib

    from flexium.engine import nvml

    asked: list[str] = []

    @contextlib.contextmanager
    def pipes() -> Iterator[tuple[int, int]]:
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()

        def serve() -> None:
            with (
                fake.nvml_of_another_process(),
                os.fdopen(request_read) as requests,
                os.fdopen(reply_write, "w") as replies,
            ):
                for request in requests:
                    asked.append(request.strip())
                    replies.write(nvml._free_line(request) + "\n")
                    replies.flush()

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        try:
            yield request_write, reply_read
        finally:
            os.close(request_write)
            server.join(5)
            os.close(reply_read)

    monkeypatch.setattr(nvml, "reader_pipes", pipes)
    return asked


# --------------------------------------------------------------------------------- engines


@pytest.fixture
def make_engine(fake: FakeDriver) -> Iterator[Callable[..., Any]]:
    """make_engine(logical=0, start=True, capabilities=None, **Engine kwargs) -> a real Engine
    over the fake, with the visible GPUs snapshotted now; the call log is cleared after."""
    from flexium.engine import Engine, snapshot_gpus
    from flexium.engine.capabilities import detect

    engines: list[Any] = []

    def make(logical: int = 0, *, start: bool = True, capabilities: Any = None, **kwargs: Any) -> Any:
        engine = Engine(
            logical_ordinal=logical,
            gpus=snapshot_gpus(),
            capabilities=capabilities if capabilities is not None else detect(check_torch=False),
            **kwargs,
        )
        if start:
            engine.start()
        engines.append(engine)
        fake.clear_log()
        return engine

    yield make
    for engine in engines:
        try:
            engine.stop()  # unhooks the optimizer hook; resumes a paused job
        except Exception:
            pass


def on_gpu(fake: FakeDriver, engine: Any, physical: int) -> None:
    """The engine and the driver agree that the job (its logical device) is on `physical`."""
    logical_device, where = engine.placement()
    assert where.uuid == fake.uuid(physical)
    assert where.device == f"cuda:{physical}"
    assert fake.physical_of(int(logical_device.split(":")[1])) == physical
    assert fake.state() == ProcessState.RUNNING


def assert_untouched(fake: FakeDriver, engine: Any, physical: int = 0) -> None:
    """Refused before anything was touched: no CUDA call at all, state and placement as before."""
    from flexium.engine import EngineState

    assert fake.calls("cu") == []
    assert engine.state == EngineState.RUNNING
    on_gpu(fake, engine, physical)


def checkpoint_ops(fake: FakeDriver) -> list[str]:
    """The state-changing checkpoint calls since the last clear_log(), in order."""
    return [c for c in fake.checkpoint_calls() if c in STATE_CHANGING]


def step_summary(result: Any) -> list[tuple[str, bool, bool]]:
    """(step, ok, rollback) of each timed step of an OperationResult."""
    return [(s.step, s.ok, s.rollback) for s in result.steps]


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.002)


class Background(threading.Thread):
    """Runs fn() in a thread; join_result() re-raises its exception or returns its value."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._fn = fn
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as exc:  # handed to the test thread
            self.error = exc

    def join_result(self, timeout: float = 10.0) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "background operation did not finish"
        if self.error is not None:
            raise self.error
        return self.result


# --------------------------------------------------------------------------------- subprocesses

PRELUDE = """
import json, os, sys, threading, time
{block_torch}
def out(**values):
    print("RESULT " + json.dumps(values, default=str), flush=True)
"""

BLOCK_TORCH = "sys.modules['torch'] = None  # not needed here; keeps the subprocess fast"


def script_env(*, libcuda: str | None = None, libnvml: str | None = None, **fake_vars: Any) -> dict[str, str]:
    """Environment for a fresh Python on the fake (or on `libcuda` / `libnvml` paths instead),
    without any flexium settings of this environment, HOME in an empty directory."""
    env = fake_driver.subprocess_env(**fake_vars)
    if libcuda is not None:
        env["FLEXIUM_LIBCUDA"] = libcuda
    if libnvml is not None:
        env["FLEXIUM_LIBNVML"] = libnvml
    for name in FLEXIUM_ENV:
        env.pop(name, None)
    env["HOME"] = _empty_home()
    env["PYTHONUNBUFFERED"] = "1"
    return env


_HOME: list[str] = []


def _empty_home() -> str:
    if not _HOME:
        _HOME.append(tempfile.mkdtemp(prefix="flexium-home-"))
    return _HOME[0]


@dataclass
class ScriptRun:
    code: str
    returncode: int
    stdout: str
    stderr: str

    @property
    def result(self) -> dict[str, Any]:
        lines = [line for line in self.stdout.splitlines() if line.startswith("RESULT ")]
        assert self.returncode == 0 and lines, (
            f"subprocess failed (rc {self.returncode}):\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"
        )
        return json.loads(lines[-1][len("RESULT ") :])


class Script:
    """A Python script started at once in a fresh interpreter; .wait() collects it. Several can
    run side by side (each imports torch, which takes seconds)."""

    def __init__(self, code: str, env: dict[str, str], *, torch: bool = False, timeout: float = 90) -> None:
        self.code = PRELUDE.format(block_torch="" if torch else BLOCK_TORCH) + textwrap.dedent(code)
        self.timeout = timeout
        self._proc = subprocess.Popen(
            [sys.executable, "-c", self.code],
            env=env,
            cwd=env["HOME"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._run: ScriptRun | None = None

    def wait(self) -> ScriptRun:
        if self._run is None:
            try:
                stdout, stderr = self._proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                stdout, stderr = self._proc.communicate()
                raise AssertionError(f"subprocess timed out:\n{stdout}\n{stderr}") from None
            self._run = ScriptRun(self.code, self._proc.returncode, stdout, stderr)
        return self._run

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.communicate()


class DictStore:
    """The c10d store calls flexium's rendezvous makes, over a dict (real stores: the 2-rank jobs
    of test_job_operations.py)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """As c10d's: `desired` stored where the key holds `expected` (absent counts as ""); the value now."""
        with self._lock:
            current = self.data.get(key)
            if (current is None and expected == "") or current == expected.encode():
                self.data[key] = desired.encode()
            return self.data.get(key, expected.encode())

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.data for key in keys)

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None
