"""flexium._C against the fake NVIDIA driver (tests/support/fake_driver.py): how it loads (or fails to),
the device list, every checkpoint primitive and its failure paths, and run_steps plans with
their rollbacks. _C loads the driver once per process, so each other driver configuration runs
in a subprocess; the rest shares this process's instance of the fake."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest

from flexium import _C
from flexium.errors import ConfigError
from support import fake_driver
from support.fake_driver import CUDA_ERRORS, FakeDriver, ProcessState

PID = os.getpid()
GiB = 1 << 30
MiB = 1 << 20
H200_BYTES = 143771 * MiB
UUID_FORM = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
CHECKPOINT_SYMBOLS = [
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessGetRestoreThreadId",
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
]

LOCK = _C.StepKind.LOCK
CHECKPOINT = _C.StepKind.CHECKPOINT
RESTORE = _C.StepKind.RESTORE
UNLOCK = _C.StepKind.UNLOCK
RECOVER = _C.StepKind.RECOVER


# ----------------------------------------------------------------------------- fixtures, helpers


@pytest.fixture(scope="module")
def driver() -> Any:
    with fake_driver.activated() as fake:
        yield fake


@pytest.fixture
def fake(driver: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in fake_driver.FAKE_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    driver.reset()
    yield driver
    # A test that failed half way must not leave the process locked for the next one.
    driver.reset()


def swap_pairs(fake: FakeDriver) -> list[Any]:
    """GPU 0 <-> GPU 1, relative to where the process is now."""
    u = fake.uuids()
    return [_C.GpuPair(u[0], u[1]), _C.GpuPair(u[1], u[0])]


def driver_error(fn: Any, *args: Any) -> Any:
    with pytest.raises(_C.DriverError) as caught:
        fn(*args)
    return caught.value


def summary(outcomes: list[Any]) -> list[tuple[str, bool, str]]:
    return [(o.step, o.rollback, o.error_name or "ok") for o in outcomes]


SUBPROCESS_PRELUDE = """
import json, os
from flexium import _C
from flexium.errors import FlexiumError

def error(fn, *args):
    try:
        fn(*args)
    except _C.DriverError as e:
        return {"message": str(e), "call": e.call, "code": e.code, "error_name": e.error_name,
                "is_runtime_error": isinstance(e, RuntimeError), "is_flexium_error": isinstance(e, FlexiumError)}
    return None

def fields(record):  # a bound record (DriverStatus) as a dict, for JSON
    return {name: getattr(record, name) for name in dir(record) if not name.startswith("_")}

pid = os.getpid()
"""


def run_python(code: str, env: dict[str, str]) -> dict[str, Any]:
    """Runs the prelude + code in a fresh interpreter; the code prints one JSON object last."""
    done = subprocess.run(
        [sys.executable, "-c", SUBPROCESS_PRELUDE + textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"subprocess failed:\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def env_with_library(library: str) -> dict[str, str]:
    env = fake_driver.subprocess_env()
    env["FLEXIUM_LIBCUDA"] = library
    return env


# ----------------------------------------------------------------------------- loading the driver


def test_without_a_driver_status_says_why_and_calls_raise_driver_error() -> None:
    missing = "/nonexistent/libcuda.so.1"
    out = run_python(
        """
        status = fields(_C.driver_status())
        print(json.dumps({"status": status, "list_devices": error(_C.list_devices), "lock": error(_C.lock, pid, 0),
                          "run_steps": error(_C.run_steps, pid, [_C.Step(_C.StepKind.LOCK)], [])}))
        """,
        env_with_library(missing),
    )
    status = out["status"]
    assert status["loaded"] is False
    assert status["library"] == missing
    assert "no NVIDIA driver" in status["error"] and missing in status["error"]
    assert status["checkpoint_api"] is False
    assert status["cuda_version"] == 0
    for name in ("list_devices", "lock", "run_steps"):
        err = out[name]
        assert err is not None, f"{name} did not raise"
        assert err["is_runtime_error"] and err["is_flexium_error"]
        assert err["call"] == "dlopen"
        assert err["code"] == CUDA_ERRORS["CUDA_ERROR_NO_DEVICE"]
        assert err["error_name"] == "CUDA_ERROR_NO_DEVICE"
        assert missing in err["message"] and "no NVIDIA driver" in err["message"]


def test_a_library_without_cuGetProcAddress_is_not_taken_for_a_driver() -> None:
    out = run_python(
        'print(json.dumps({"status": fields(_C.driver_status()), "err": error(_C.list_devices)}))',
        env_with_library("libm.so.6"),
    )
    assert out["status"]["loaded"] is False
    assert "has no cuGetProcAddress/cuDriverGetVersion" in out["status"]["error"]
    assert "libm.so.6" in out["err"]["message"]


def test_driver_without_checkpoint_symbols_loads_without_the_checkpoint_api(driver: FakeDriver) -> None:
    out = run_python(
        """
        print(json.dumps({"status": fields(_C.driver_status()), "devices": len(_C.list_devices()),
                          "lock": error(_C.lock, pid, 0), "restore": error(_C.restore, pid),
                          "restore_thread_id": error(_C.restore_thread_id, pid),
                          "run_steps": error(_C.run_steps, pid, [_C.Step(_C.StepKind.LOCK)], [])}))
        """,
        driver.environment(FAKE_CUDA_NO_CHECKPOINT=1),
    )
    status = out["status"]
    assert status["loaded"] is True
    assert status["checkpoint_api"] is False
    assert sorted(status["missing_optional"]) == sorted(CHECKPOINT_SYMBOLS)
    assert out["devices"] == 2  # the rest of the driver works
    lock = out["lock"]
    assert lock["call"] == "cuCheckpointProcessLock"
    assert lock["code"] == CUDA_ERRORS["CUDA_ERROR_NOT_FOUND"]
    assert lock["error_name"] == "CUDA_ERROR_NOT_FOUND"
    assert "cuCheckpointProcessLock" in lock["message"] and "12080" in lock["message"]
    assert out["restore"]["code"] == CUDA_ERRORS["CUDA_ERROR_NOT_FOUND"]
    assert out["restore_thread_id"]["call"] == "cuCheckpointProcessGetRestoreThreadId"
    assert out["run_steps"]["code"] == CUDA_ERRORS["CUDA_ERROR_NOT_FOUND"]


def test_driver_older_than_the_checkpoint_api(driver: FakeDriver) -> None:
    out = run_python(
        'print(json.dumps({"status": fields(_C.driver_status()), "lock": error(_C.lock, pid, 0)}))',
        driver.environment(FAKE_CUDA_VERSION=12040),
    )
    assert out["status"]["cuda_version"] == 12040
    assert out["status"]["checkpoint_api"] is False
    assert sorted(out["status"]["missing_optional"]) == sorted(CHECKPOINT_SYMBOLS)
    assert "CUDA 12040" in out["lock"]["message"]


def test_machine_without_gpus_reports_the_cuInit_error(driver: FakeDriver) -> None:
    out = run_python(
        'print(json.dumps({"status": fields(_C.driver_status()), "err": error(_C.list_devices)}))',
        driver.environment(FAKE_CUDA_GPUS=0),
    )
    assert out["status"]["loaded"] is True
    assert out["status"]["init_error"] == "CUDA_ERROR_NO_DEVICE"
    assert out["err"]["call"] == "cuInit(0)"
    assert out["err"]["code"] == CUDA_ERRORS["CUDA_ERROR_NO_DEVICE"]
    assert "no CUDA-capable device is detected" in out["err"]["message"]


def test_a_missing_required_symbol_fails_the_load_naming_it(driver: FakeDriver) -> None:
    # The third lookup is cuGetErrorString (csrc/driver_table.h order).
    out = run_python(
        'print(json.dumps({"status": fields(_C.driver_status()), "err": error(_C.list_devices)}))',
        driver.environment(FAKE_CUDA_FAIL="cuGetProcAddress_v2:500:3"),
    )
    assert out["status"]["loaded"] is False
    assert "lacks required functions: cuGetErrorString" in out["status"]["error"]
    assert "cuGetErrorString" in out["err"]["message"]


def test_driver_status_with_the_fake(fake: FakeDriver) -> None:
    status = _C.driver_status()
    assert status.loaded is True
    assert status.library == str(fake.path)
    assert status.error is None and status.init_error is None
    assert status.cuda_version == 13000
    assert status.checkpoint_api is True and status.vmm_api is True
    assert status.missing_optional == []
    assert _C.CHECKPOINT_API_VERSION == 12080  # the version each cuCheckpointProcess* lookup asks for


# ----------------------------------------------------------------------------- devices


def test_list_devices_reports_the_configured_gpus(fake: FakeDriver) -> None:
    devices = _C.list_devices()
    assert [d.ordinal for d in devices] == [0, 1]
    assert [d.uuid for d in devices] == fake.uuids()
    assert all(UUID_FORM.match(d.uuid) for d in devices)
    assert devices[0].uuid != devices[1].uuid
    assert [d.name for d in devices] == ["NVIDIA H200", "NVIDIA H200"]
    assert [d.total_memory for d in devices] == [H200_BYTES, H200_BYTES]
    assert [d.pci_bus_id for d in devices] == ["0000:18:00.0", "0000:2a:00.0"]


def test_list_devices_follows_the_fake_configuration(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_GPUS", "4")
    monkeypatch.setenv("FAKE_CUDA_MODELS", "NVIDIA H200,NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("FAKE_CUDA_TOTAL_MIB", "143771,81559")
    fake.reset()
    devices = _C.list_devices()
    assert [d.name for d in devices] == ["NVIDIA H200"] + ["NVIDIA H100 80GB HBM3"] * 3
    assert [d.total_memory // MiB for d in devices] == [143771, 81559, 81559, 81559]
    assert len({d.uuid for d in devices}) == 4
    assert [d.uuid for d in devices[:2]] == fake.uuids()[:2]  # the same machine, grown


def test_a_failing_device_query_raises_driver_error_naming_the_call(fake: FakeDriver) -> None:
    fake.fail("cuDeviceGetUuid", "CUDA_ERROR_UNKNOWN", nth=2)
    err = driver_error(_C.list_devices)
    assert "cuDeviceGetUuid" in err.call
    assert err.code == CUDA_ERRORS["CUDA_ERROR_UNKNOWN"]
    assert err.error_name == "CUDA_ERROR_UNKNOWN"
    assert "CUDA_ERROR_UNKNOWN (unknown error)" in str(err)
    assert fake.call_count("cuDeviceGetUuid") == 2  # device 0 answered, device 1 failed
    assert len(_C.list_devices()) == 2  # a one-off failure


# ----------------------------------------------------------------------------- primitives


def test_primitives_walk_the_state_machine(fake: FakeDriver) -> None:
    fake.set_process_memory(0, 3 * GiB)
    assert _C.process_state(PID) == _C.ProcessState.RUNNING
    _C.lock(PID, 1000)
    assert _C.process_state(PID) == _C.ProcessState.LOCKED
    _C.checkpoint(PID)
    assert _C.process_state(PID) == _C.ProcessState.CHECKPOINTED
    assert fake.process_bytes_on(0) == 0  # checkpointed: nothing on any GPU
    _C.restore(PID)
    assert _C.process_state(PID) == _C.ProcessState.LOCKED
    assert fake.last_pairs_count() == 0
    _C.unlock(PID)
    assert _C.process_state(PID) == _C.ProcessState.RUNNING
    assert fake.placement() == [0, 1] and fake.process_bytes_on(0) == 3 * GiB
    assert fake.checkpoint_calls() == [
        "GetState",
        "Lock",
        "GetState",
        "Checkpoint",
        "GetState",
        "Restore",
        "GetState",
        "Unlock",
        "GetState",
    ]


def test_restore_with_every_gpu_paired_moves_the_process_and_its_uuid_but_not_its_bus_id(fake: FakeDriver) -> None:
    fake.set_process_memory(0, 5 * GiB)
    before = [(d.uuid, d.pci_bus_id) for d in _C.list_devices()]
    _C.lock(PID, 0)
    _C.checkpoint(PID)
    _C.restore(PID, swap_pairs(fake))
    _C.unlock(PID)
    assert fake.placement() == [1, 0]
    assert fake.process_bytes_on(1) == 5 * GiB and fake.process_bytes_on(0) == 0
    assert fake.last_pairs_count() == 2 and fake.last_pairs() == [(0, 1), (1, 0)]
    # Each device's UUID names the GPU it is on now; its PCI bus id the one it was on (fact `remap-keeps-old-identity`).
    assert [(d.uuid, d.pci_bus_id) for d in _C.list_devices()] == [
        (before[1][0], before[0][1]),
        (before[0][0], before[1][1]),
    ]
    # Pairs are relative to where the process is now: the same swap brings it back.
    _C.lock(PID, 0)
    _C.checkpoint(PID)
    _C.restore(PID, swap_pairs(fake))
    _C.unlock(PID)
    assert fake.placement() == [0, 1] and fake.process_bytes_on(0) == 5 * GiB


def test_restore_thread_id(fake: FakeDriver) -> None:
    tid = _C.restore_thread_id(PID)
    assert tid > 0 and tid == fake.restore_thread_id()


def _locked(fake: FakeDriver) -> None:
    _C.lock(PID, 0)


def _checkpointed(fake: FakeDriver) -> None:
    _C.lock(PID, 0)
    _C.checkpoint(PID)


PRIMITIVE_FAILURES = [
    # (primitive, state before, failing driver function, injected code, name of the call in the error)
    ("lock", None, "cuCheckpointProcessLock", "CUDA_ERROR_TIMEOUT", "cuCheckpointProcessLock"),
    (
        "checkpoint",
        _locked,
        "cuCheckpointProcessCheckpoint",
        "CUDA_ERROR_OUT_OF_MEMORY",
        "cuCheckpointProcessCheckpoint",
    ),
    ("restore", _checkpointed, "cuCheckpointProcessRestore", "CUDA_ERROR_INVALID_VALUE", "cuCheckpointProcessRestore"),
    ("unlock", _locked, "cuCheckpointProcessUnlock", "CUDA_ERROR_UNKNOWN", "cuCheckpointProcessUnlock"),
    ("process_state", None, "cuCheckpointProcessGetState", "CUDA_ERROR_NOT_INITIALIZED", "cuCheckpointProcessGetState"),
    (
        "restore_thread_id",
        None,
        "cuCheckpointProcessGetRestoreThreadId",
        "CUDA_ERROR_OPERATING_SYSTEM",
        "cuCheckpointProcessGetRestoreThreadId",
    ),
]


@pytest.mark.parametrize(
    "primitive,arrange,function,code,call", PRIMITIVE_FAILURES, ids=[p[0] for p in PRIMITIVE_FAILURES]
)
def test_a_failing_primitive_raises_driver_error_and_changes_nothing(
    fake: FakeDriver, primitive: str, arrange: Any, function: str, code: str, call: str
) -> None:
    if arrange is not None:
        arrange(fake)
    state_before = fake.state()
    fake.fail(function, code)
    args = (PID, 0) if primitive == "lock" else (PID,)
    err = driver_error(getattr(_C, primitive), *args)
    # lock..unlock name the function; process_state/restore_thread_id give the checked expression
    assert call in err.call
    assert err.code == CUDA_ERRORS[code]
    assert err.error_name == code
    text = {
        "CUDA_ERROR_TIMEOUT": "timeout occurred",
        "CUDA_ERROR_OUT_OF_MEMORY": "out of memory",
        "CUDA_ERROR_INVALID_VALUE": "invalid argument",
        "CUDA_ERROR_UNKNOWN": "unknown error",
        "CUDA_ERROR_NOT_INITIALIZED": "initialization error",
        "CUDA_ERROR_OPERATING_SYSTEM": "OS call failed or operation not supported on this OS",
    }[code]
    assert f"{call}" in str(err) and f"{code} ({text})" in str(err)
    assert fake.state() == state_before
    assert fake.pending_failures() == 0


@pytest.mark.parametrize(
    "arrange,primitive,state",
    [
        (None, "checkpoint", ProcessState.RUNNING),
        (None, "unlock", ProcessState.RUNNING),
        (None, "restore", ProcessState.RUNNING),
        (_locked, "lock", ProcessState.LOCKED),
        (_locked, "restore", ProcessState.LOCKED),
        (_checkpointed, "checkpoint", ProcessState.CHECKPOINTED),
        (_checkpointed, "unlock", ProcessState.CHECKPOINTED),
        (_checkpointed, "lock", ProcessState.CHECKPOINTED),
    ],
)
def test_out_of_order_calls_are_illegal_state(
    fake: FakeDriver, arrange: Any, primitive: str, state: ProcessState
) -> None:
    if arrange is not None:
        arrange(fake)
    args = (PID, 0) if primitive == "lock" else (PID,)
    err = driver_error(getattr(_C, primitive), *args)
    assert err.error_name == "CUDA_ERROR_ILLEGAL_STATE"
    assert "the operation cannot be performed in the present state" in str(err)
    assert fake.state() == state


def test_lock_timeout(fake: FakeDriver) -> None:
    fake.set_lock_delay_ms(2000)
    start = time.monotonic()
    err = driver_error(_C.lock, PID, 50)
    waited = time.monotonic() - start
    assert err.call == "cuCheckpointProcessLock" and err.error_name == "CUDA_ERROR_TIMEOUT"
    assert f"pid {PID}" in str(err)
    assert 0.045 <= waited < 1.5
    assert fake.state() == ProcessState.RUNNING
    fake.set_lock_delay_ms(100)
    _C.lock(PID, 0)  # no timeout: waits for the process to drain
    assert fake.state() == ProcessState.LOCKED


def test_another_pid_is_invalid_value(fake: FakeDriver) -> None:
    other = os.getppid()
    for primitive, args in (("process_state", (other,)), ("lock", (other, 0)), ("restore_thread_id", (other,))):
        err = driver_error(getattr(_C, primitive), *args)
        assert err.error_name == "CUDA_ERROR_INVALID_VALUE"
    assert fake.state() == ProcessState.RUNNING


def test_invalid_uuid_text_raises_value_error_naming_it(fake: FakeDriver) -> None:
    good = fake.uuid(0)
    _checkpointed(fake)
    with pytest.raises(ValueError, match="not-a-gpu"):
        _C.restore(PID, [_C.GpuPair("not-a-gpu", good)])
    with pytest.raises(ValueError, match=r"GPU-1234.*32 hex digits"):
        _C.Step(RESTORE, pairs=[_C.GpuPair(good, "GPU-1234")])
    with pytest.raises(ValueError, match="restore only"):
        _C.Step(LOCK, pairs=[_C.GpuPair(good, good)])
    assert fake.call_count("cuCheckpointProcessRestore") == 0  # refused before the driver
    assert _C.Step(RESTORE, pairs=[_C.GpuPair(good.upper(), good)]).pair_count == 1  # hex in capitals is fine


def test_a_single_pair_is_refused_and_the_process_stays_checkpointed(fake: FakeDriver) -> None:
    u = fake.uuids()
    _checkpointed(fake)
    err = driver_error(_C.restore, PID, [_C.GpuPair(u[0], u[1])])
    assert err.error_name == "CUDA_ERROR_INVALID_VALUE"
    # facts `restore-pairs-every-gpu` and `failed-restore-stays-checkpointed`
    assert fake.state() == ProcessState.CHECKPOINTED
    assert fake.last_pairs_count() == 1
    _C.restore(PID)  # a plain restore brings it back on the source
    _C.unlock(PID)
    assert fake.state() == ProcessState.RUNNING and fake.placement() == [0, 1]


@pytest.mark.parametrize(
    "pairs",
    [
        pytest.param(lambda u: [(u[0], u[1]), (u[0], u[0])], id="old-twice"),
        pytest.param(lambda u: [(u[0], u[1]), (u[1], u[1])], id="new-twice"),
        pytest.param(lambda u: [(u[0], u[1]), (u[1], "GPU-00000000-0000-0000-0000-000000000001")], id="unknown-gpu"),
    ],
)
def test_restore_pairs_must_be_a_permutation(fake: FakeDriver, pairs: Any) -> None:
    _checkpointed(fake)
    err = driver_error(_C.restore, PID, [_C.GpuPair(a, b) for a, b in pairs(fake.uuids())])
    assert err.error_name == "CUDA_ERROR_INVALID_VALUE"
    assert fake.state() == ProcessState.CHECKPOINTED and fake.placement() == [0, 1]


def test_restore_onto_a_full_gpu_is_out_of_memory(fake: FakeDriver) -> None:
    fake.set_process_memory(0, 10 * GiB)
    fake.set_other_memory(1, H200_BYTES - 4 * GiB)
    _checkpointed(fake)
    err = driver_error(_C.restore, PID, swap_pairs(fake))
    assert err.error_name == "CUDA_ERROR_OUT_OF_MEMORY" and "out of memory" in str(err)
    assert fake.state() == ProcessState.CHECKPOINTED and fake.placement() == [0, 1]
    assert fake.process_bytes_on(0) == 0 and fake.process_bytes_on(1) == 0


def test_cuda_calls_on_the_locking_thread_would_hang(fake: FakeDriver) -> None:
    _C.lock(PID, 0)
    err = driver_error(_C.list_devices)  # the real driver never returns here (fact `locked-process-blocks-cuda`)
    assert err.error_name == "CUDA_ERROR_ILLEGAL_STATE"
    assert fake.deadlocks() == 1 and fake.blocked_calls() == 1
    _C.unlock(PID)
    assert len(_C.list_devices()) == 2


def test_cuda_calls_from_another_thread_wait_for_unlock(fake: FakeDriver) -> None:
    locked = threading.Event()
    failures: list[BaseException] = []

    def control_thread() -> None:
        try:
            _C.lock(PID, 1000)
            locked.set()
            time.sleep(0.5)
            _C.unlock(PID)
        except BaseException as exc:  # reported by the assertions below
            failures.append(exc)
            locked.set()

    thread = threading.Thread(target=control_thread)
    thread.start()
    assert locked.wait(10)
    start = time.monotonic()
    devices = _C.list_devices()  # blocks inside the driver, without the GIL, until unlock
    waited = time.monotonic() - start
    thread.join(10)
    assert not failures
    assert len(devices) == 2
    assert waited >= 0.2
    assert fake.blocked_calls() >= 1 and fake.deadlocks() == 0


def test_concurrent_queries_and_migrations(fake: FakeDriver) -> None:
    fake.set_process_memory(0, 1 * GiB)
    failures: list[BaseException] = []
    migrations = 40

    def query() -> None:
        try:
            for _ in range(100):
                assert len(_C.list_devices()) == 2
                _C.process_state(PID)
        except BaseException as exc:  # reported below
            failures.append(exc)

    def migrate() -> None:
        try:
            for _ in range(migrations):
                outcomes = _C.run_steps(PID, *migrate_plan(swap_pairs(fake)))
                assert all(o.code == 0 for o in outcomes), summary(outcomes)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=query) for _ in range(4)] + [threading.Thread(target=migrate)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    assert fake.state() == ProcessState.RUNNING
    assert fake.placement() == [0, 1]  # an even number of swaps
    assert fake.call_count("cuCheckpointProcessRestore") == migrations
    assert fake.deadlocks() == 0


# ----------------------------------------------------------------------------- run_steps


def migrate_plan(pairs: list[Any], lock_timeout_ms: int = 5000) -> tuple[list[Any], list[list[Any]]]:
    steps = [_C.Step(LOCK, lock_timeout_ms), _C.Step(CHECKPOINT), _C.Step(RESTORE, pairs=pairs), _C.Step(UNLOCK)]
    rollbacks = [[_C.Step(RECOVER)] for _ in steps]
    return steps, rollbacks


def test_run_steps_migrates_the_process(fake: FakeDriver) -> None:
    fake.set_process_memory(0, 8 * GiB)
    steps, rollbacks = migrate_plan(swap_pairs(fake))
    assert [s.pair_count for s in steps] == [0, 0, 2, 0]
    outcomes = _C.run_steps(PID, steps, rollbacks)
    assert summary(outcomes) == [
        ("lock", False, "ok"),
        ("checkpoint", False, "ok"),
        ("restore", False, "ok"),
        ("unlock", False, "ok"),
    ]
    assert all(o.code == 0 and o.error_text == "" and o.seconds >= 0 for o in outcomes)
    assert fake.state() == ProcessState.RUNNING
    assert fake.physical_of(0) == 1 and fake.physical_of(1) == 0
    assert fake.process_bytes_on(1) == 8 * GiB and fake.process_bytes_on(0) == 0
    calls = fake.calls("cuCheckpointProcess")
    assert [c.function for c in calls] == [
        "cuCheckpointProcessLock",
        "cuCheckpointProcessCheckpoint",
        "cuCheckpointProcessRestore",
        "cuCheckpointProcessUnlock",
    ]
    assert [c.pairs for c in calls] == [-1, -1, 2, -1]
    assert len({c.tid for c in calls}) == 1  # the whole locked section in one native call


def test_a_driver_call_that_does_not_return_is_reported_while_it_runs(
    fake: FakeDriver, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint call that never returns would stop the job without a word: every
    FLEXIUM_DRIVER_CALL_REPORT_S seconds (60 by default) the call still running is named on stderr,
    with what to do. Here a restore takes 2.5 s and the reports come every second."""
    monkeypatch.setenv("FLEXIUM_DRIVER_CALL_REPORT_S", "1")
    fake.set_delay_ms("cuCheckpointProcessRestore", 2500)
    steps, rollbacks = migrate_plan(swap_pairs(fake))
    outcomes = _C.run_steps(PID, steps, rollbacks)
    assert [o.code for o in outcomes] == [0, 0, 0, 0] and fake.state() == ProcessState.RUNNING
    reports = [line for line in capfd.readouterr().err.splitlines() if "has not returned" in line]
    assert reports == [
        f"[flexium] cuCheckpointProcessRestore (process {PID}) has not returned after {seconds} s: a driver call "
        "that never returns leaves the process stuck; if it goes on, end the job "
        f"(kill {PID}) and start it again from its last checkpoint"
        for seconds in (1, 2)
    ]
    # Not a number: flexium.init() refuses it (below); a call made anyway is reported every 60 s.
    monkeypatch.setenv("FLEXIUM_DRIVER_CALL_REPORT_S", "a minute")
    fake.set_delay_ms("cuCheckpointProcessRestore", 1200)
    assert [o.code for o in _C.run_steps(PID, *migrate_plan(swap_pairs(fake)))] == [0, 0, 0, 0]
    assert "has not returned" not in capfd.readouterr().err


@pytest.mark.parametrize(("setting", "read"), [(None, 60), ("", 60), ("1", 1), ("86400", 86400)])
def test_the_report_setting_is_read_in_whole_seconds(
    monkeypatch: pytest.MonkeyPatch, setting: str | None, read: int
) -> None:
    if setting is None:
        monkeypatch.delenv("FLEXIUM_DRIVER_CALL_REPORT_S", raising=False)
    else:
        monkeypatch.setenv("FLEXIUM_DRIVER_CALL_REPORT_S", setting)
    assert _C.driver_call_report_setting() == read


@pytest.mark.parametrize("setting", ["a minute", "0", "-5", "1.5", "60s", "86401"])
def test_a_report_setting_that_is_not_whole_seconds_is_refused_when_the_job_starts(
    monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    from flexium.api import runtime

    monkeypatch.setenv("FLEXIUM_DRIVER_CALL_REPORT_S", setting)
    assert _C.driver_call_report_setting() == 0
    expected = (
        f"FLEXIUM_DRIVER_CALL_REPORT_S={setting!r} (from the environment) is not a whole number of seconds from 1 "
        "to 86400: give how often a checkpoint call that has not returned is reported, e.g. 60, or unset it"
    )
    with pytest.raises(ConfigError) as refused:
        runtime._start(None)  # type: ignore[arg-type]  (refused before the config is read)
    assert str(refused.value) == expected
    assert runtime.current() is None


@pytest.mark.parametrize(
    "variable",
    [
        "FLEXIUM_HOST_COPIER",
        "FLEXIUM_RESUME_OVERLAP",
        "FLEXIUM_WRITTEN_STAGING",
        "FLEXIUM_MOVE_CHECKSUM",
        "FLEXIUM_DRIVER_HOST_MEMORY",
    ],
)
def test_a_fast_path_switch_that_is_not_on_or_off_is_refused_when_the_job_starts(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    """Not at the first pause or move that reads it: before the job trains."""
    from flexium.api import runtime

    monkeypatch.setenv(variable, "banana")
    with pytest.raises(ConfigError, match=rf"'banana' \(from environment variable {variable}\) is not valid; use true"):
        runtime._start(None)  # type: ignore[arg-type]  (refused before the config is read)
    assert runtime.current() is None


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("16", "not 16 bytes"),
        ("60KiB", "not 61440 bytes"),
        ("1001KiB", "not 1025024 bytes"),
        ("1GiB", "not 1073741824 bytes"),
        ("99999999999999999999TiB", "more memory than any host has"),
        ("big", "is not an amount of memory"),
    ],
)
def test_a_write_buffer_flexium_cannot_use_is_refused_when_the_job_starts(
    monkeypatch: pytest.MonkeyPatch, value: str, why: str
) -> None:
    """Too small, not in whole pages, more than two per thread should pin, or no amount at all."""
    from flexium.api import runtime

    monkeypatch.setenv("FLEXIUM_WRITE_BUFFER", value)
    with pytest.raises(
        ConfigError, match=rf"FLEXIUM_WRITE_BUFFER='{value}' is not valid: give the size of each.*{why}"
    ):
        runtime._start(None)  # type: ignore[arg-type]  (refused before the config is read)
    assert runtime.current() is None


def test_run_steps_failed_remap_rolls_back_to_the_source(fake: FakeDriver) -> None:
    """A restore refused for its arguments leaves the process restorable in place (fact
    `failed-restore-stays-checkpointed`); one that found too little room does not (fact
    `restore-without-room-loses-process`, the test below)."""
    fake.set_process_memory(0, 8 * GiB)
    fake.fail("cuCheckpointProcessRestore", "CUDA_ERROR_INVALID_VALUE")
    expected = "CUDA_ERROR_INVALID_VALUE"
    outcomes = _C.run_steps(PID, *migrate_plan(swap_pairs(fake)))
    assert summary(outcomes) == [
        ("lock", False, "ok"),
        ("checkpoint", False, "ok"),
        ("restore", False, expected),
        ("restore", True, "ok"),
        ("unlock", True, "ok"),
    ]
    failed = outcomes[2]
    assert failed.code == CUDA_ERRORS[expected] and failed.error_text
    assert fake.state() == ProcessState.RUNNING
    assert fake.placement() == [0, 1] and fake.process_bytes_on(0) == 8 * GiB
    assert fake.checkpoint_calls() == ["Lock", "Checkpoint", "Restore", "GetState", "Restore", "Unlock"]
    assert [c.pairs for c in fake.calls("cuCheckpointProcessRestore")] == [2, 0]


def test_run_steps_lock_timeout_stops_before_anything_else(fake: FakeDriver) -> None:
    fake.set_lock_delay_ms(2000)
    outcomes = _C.run_steps(PID, *migrate_plan(swap_pairs(fake), lock_timeout_ms=50))
    assert summary(outcomes) == [("lock", False, "CUDA_ERROR_TIMEOUT")]
    assert outcomes[0].error_text == "timeout occurred"
    assert 0.045 <= outcomes[0].seconds < 1.5
    assert fake.state() == ProcessState.RUNNING
    # Recover of a RUNNING process only looks at its state.
    assert fake.checkpoint_calls() == ["Lock", "GetState"]


def test_run_steps_single_pair_is_refused_then_recovered(fake: FakeDriver) -> None:
    u = fake.uuids()
    outcomes = _C.run_steps(PID, *migrate_plan([_C.GpuPair(u[0], u[1])]))
    assert summary(outcomes) == [
        ("lock", False, "ok"),
        ("checkpoint", False, "ok"),
        ("restore", False, "CUDA_ERROR_INVALID_VALUE"),
        ("restore", True, "ok"),
        ("unlock", True, "ok"),
    ]
    assert fake.state() == ProcessState.RUNNING and fake.placement() == [0, 1]
    assert [c.pairs for c in fake.calls("cuCheckpointProcessRestore")] == [1, 0]


def test_run_steps_recover_of_a_locked_process_only_unlocks(fake: FakeDriver) -> None:
    fake.fail("cuCheckpointProcessCheckpoint", "CUDA_ERROR_UNKNOWN")
    outcomes = _C.run_steps(PID, *migrate_plan(swap_pairs(fake)))
    assert summary(outcomes) == [
        ("lock", False, "ok"),
        ("checkpoint", False, "CUDA_ERROR_UNKNOWN"),
        ("unlock", True, "ok"),
    ]
    assert fake.state() == ProcessState.RUNNING
    assert fake.checkpoint_calls() == ["Lock", "Checkpoint", "GetState", "Unlock"]


def test_run_steps_runs_every_rollback_step_even_when_they_fail(fake: FakeDriver) -> None:
    # After a restore that found too little room, later restores fail for good (fact
    # `restore-without-room-loses-process`).
    fake.set_process_memory(0, 8 * GiB)
    fake.set_other_memory(1, H200_BYTES - 1 * GiB)
    outcomes = _C.run_steps(PID, *migrate_plan(swap_pairs(fake)))
    assert summary(outcomes) == [
        ("lock", False, "ok"),
        ("checkpoint", False, "ok"),
        ("restore", False, "CUDA_ERROR_OUT_OF_MEMORY"),
        ("restore", True, "CUDA_ERROR_OPERATING_SYSTEM"),
        ("unlock", True, "CUDA_ERROR_ILLEGAL_STATE"),
    ]
    assert fake.state() == ProcessState.CHECKPOINTED


def test_run_steps_without_rollbacks_stops_at_the_failure(fake: FakeDriver) -> None:
    fake.fail("cuCheckpointProcessCheckpoint", "CUDA_ERROR_UNKNOWN")
    steps, _ = migrate_plan(swap_pairs(fake))
    outcomes = _C.run_steps(PID, steps, [])
    assert summary(outcomes) == [("lock", False, "ok"), ("checkpoint", False, "CUDA_ERROR_UNKNOWN")]
    assert fake.state() == ProcessState.LOCKED  # the caller asked for no rollback


# ----------------------------------------------------------------------------- the fake itself


def test_cuGetProcAddress_reports_missing_and_too_old_symbols(fake: FakeDriver) -> None:
    lookup = fake.library.cuGetProcAddress_v2
    lookup.restype = ctypes.c_int
    lookup.argtypes = [
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.POINTER(ctypes.c_int),
    ]

    def ask(symbol: str, version: int) -> tuple[int, int, int]:
        fn, status = ctypes.c_void_p(), ctypes.c_int(-1)
        rc = lookup(symbol.encode(), ctypes.byref(fn), version, 0, ctypes.byref(status))
        return rc, status.value, fn.value or 0

    lock_address = ctypes.cast(fake.library.cuCheckpointProcessLock, ctypes.c_void_p).value
    assert ask("cuCheckpointProcessLock", 12080) == (0, fake_driver.SYMBOL_FOUND, lock_address)
    assert ask("cuCheckpointProcessLock", 12000) == (500, fake_driver.VERSION_NOT_SUFFICIENT, 0)
    assert ask("cuMemAllocPitch", 13000) == (500, fake_driver.SYMBOL_NOT_FOUND, 0)
    assert ask("cuDeviceTotalMem", 2000)[1] == fake_driver.VERSION_NOT_SUFFICIENT


def test_pynvml_sees_the_physical_gpus_through_a_migration_and_a_pause(driver: FakeDriver) -> None:
    """NVML's view is the physical one; while the process is checkpointed its own NVML calls do not
    return (the fake gives up at once on the thread that holds the lock), so what a pause leaves is
    read as another process reads it (the fake's control functions)."""
    out = run_python(
        """
        import ctypes, pynvml
        from support import fake_driver
        fake = fake_driver.FakeDriver(os.environ["FLEXIUM_LIBCUDA"])
        pynvml.nvmlLib = ctypes.CDLL(os.environ["FLEXIUM_LIBNVML"])  # what flexium does
        pynvml.nvmlInit()
        GiB = 1 << 30
        fake.set_process_memory(0, 6 * GiB)
        fake.set_other_memory(1, 2 * GiB)

        def view():
            gpus = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                memory = pynvml.nvmlDeviceGetMemoryInfo(h)
                memory_v2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
                procs = {p.pid: p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
                gpus.append({"uuid": pynvml.nvmlDeviceGetUUID(h), "used": memory.used, "free": memory.free,
                             "total": memory.total, "used_v2": memory_v2.used, "ours": procs.pop(pid, None),
                             "others": procs})
            return gpus

        u = [d.uuid for d in _C.list_devices()]
        before = view()
        pairs = [_C.GpuPair(u[0], u[1]), _C.GpuPair(u[1], u[0])]
        steps = [_C.Step(_C.StepKind.LOCK, 1000), _C.Step(_C.StepKind.CHECKPOINT),
                 _C.Step(_C.StepKind.RESTORE, pairs=pairs), _C.Step(_C.StepKind.UNLOCK)]
        ok = all(o.code == 0 for o in _C.run_steps(pid, steps, []))
        migrated = view()
        _C.lock(pid, 0); _C.checkpoint(pid)
        try:
            pynvml.nvmlDeviceGetCount()
            nvml_while_paused = "returned"
        except pynvml.NVMLError as exc:
            nvml_while_paused = str(exc)
        paused = [{"used": fake.used_bytes(i), "ours": fake.process_bytes_on(i)} for i in range(2)]
        deadlocks = fake.deadlocks()
        _C.restore(pid); _C.unlock(pid)
        h1 = pynvml.nvmlDeviceGetHandleByIndex(1)
        print(json.dumps({
            "driver": pynvml.nvmlSystemGetDriverVersion(), "cuda_uuids": u, "migrated_ok": ok,
            "cuda_uuids_after": [d.uuid for d in _C.list_devices()],
            "nvml_while_paused": nvml_while_paused, "deadlocks": deadlocks,
            "before": before, "migrated": migrated, "paused": paused, "resumed": view(),
            "index_by_uuid": pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(u[1])),
            "name": pynvml.nvmlDeviceGetName(h1), "temperature": pynvml.nvmlDeviceGetTemperature(h1, 0),
            "utilization": pynvml.nvmlDeviceGetUtilizationRates(h1).gpu,
            "pci": pynvml.nvmlDeviceGetPciInfo(h1).busId, "ecc": pynvml.nvmlDeviceGetTotalEccErrors(h1, 1, 0),
        }))
        pynvml.nvmlShutdown()
        assert fake.nvml_refcount() == 0
        fake.attach_pynvml(pynvml)  # the helper does the same redirection
        pynvml.nvmlInit()
        assert pynvml.nvmlDeviceGetCount() == 2 and fake.nvml_refcount() == 1
        """,
        driver.environment(FAKE_NVML_DRIVER="580.159.04"),
    )
    assert out["driver"] == "580.159.04"
    assert out["migrated_ok"]
    assert [g["uuid"] for g in out["before"]] == out["cuda_uuids"]
    assert out["cuda_uuids_after"] == out["cuda_uuids"][::-1]  # each device names the GPU it is on now
    other_pid = {str(fake_driver.OTHER_PID_BASE + 1): 2 * GiB}
    before, migrated, paused, resumed = out["before"], out["migrated"], out["paused"], out["resumed"]
    assert [g["ours"] for g in before] == [6 * GiB, None]
    assert [g["used"] for g in before] == [6 * GiB, 2 * GiB]
    assert before[1]["others"] == other_pid and before[0]["others"] == {}
    assert [g["ours"] for g in migrated] == [None, 6 * GiB]  # NVML shows where it really is
    assert [g["used"] for g in migrated] == [0, 8 * GiB]
    assert [g["used_v2"] for g in migrated] == [0, 8 * GiB]
    assert all(g["used"] + g["free"] == g["total"] == H200_BYTES for g in migrated)
    assert out["nvml_while_paused"] == "Timeout" and out["deadlocks"] == 1  # fact `locked-process-blocks-cuda`
    assert [g["ours"] for g in paused] == [0, 0]  # a pause leaves nothing of ours
    assert [g["used"] for g in paused] == [0, 2 * GiB]
    assert resumed == migrated
    assert out["index_by_uuid"] == 1
    assert out["name"] == "NVIDIA H200" and out["temperature"] == 35 and out["utilization"] == 0
    assert out["pci"] == "00000000:2A:00.0" and out["ecc"] == 0


# ----------------------------------------------------------------------------- bound structs


def test_bound_structs_are_built_by_name_and_read_back() -> None:
    piece = _C.CopierPiece(segment=1, segment_offset=2, chunk=3, chunk_offset=4, length=5)
    assert (piece.segment, piece.segment_offset, piece.chunk, piece.chunk_offset, piece.length) == (1, 2, 3, 4, 5)
    assert repr(_C.StagedSegment(address=0x7F00C0000000, size=2 * MiB, fd=7)) == (
        f"StagedSegment(address={0x7F00C0000000}, size={2 * MiB}, fd=7, checksum=0)"
    )
    assert repr(_C.CopierChunk(0, 4096, 8192)) == "CopierChunk(extent=0, offset=4096, size=8192)"
    with pytest.raises(AttributeError):
        piece.length = 6  # type: ignore[misc]  # what C++ handed over is read-only
    with pytest.raises(TypeError):
        _C.CopierChunk(0, 4096)  # type: ignore[call-arg]
