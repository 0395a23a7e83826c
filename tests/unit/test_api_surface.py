"""The public API (docs/guide/api.md: flexium.init / shutdown / is_initialized, flexium.auto.*,
flexium.utils.*) over the real engine and the fake driver: in this process where the fake
driver serves, in subprocesses for process exit (atexit) and for a machine without a driver."""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import flexium  # noqa: E402
import flexium.auto  # noqa: E402
import flexium.utils  # noqa: E402
from flexium.api import device_routing  # noqa: E402
from flexium.api import runtime as runtime_module  # noqa: E402
from flexium.engine import Engine, EngineState  # noqa: E402
from flexium.errors import ConfigError  # noqa: E402
from support.engine import (  # noqa: E402,F401  (fixtures)
    FLEXIUM_ENV,
    Background,
    GiB,
    Script,
    driver,
    fake,
    nvml_in_parent,
    script_env,
    wait_until,
)
from support.fake_driver import FakeDriver, ProcessState  # noqa: E402

PROCESS_ID = re.compile(r"^gpu-[0-9a-f]{8}$")

# --------------------------------------------------------------------------------- subprocesses

ATEXIT_SCRIPT = """
import atexit
from support import fake_driver
fake = fake_driver.FakeDriver(os.environ["FLEXIUM_LIBCUDA"])

def after_flexium():  # registered before init(): runs after flexium's own exit handler
    out(at_exit=[fake.state().name, fake.checkpoint_calls(), fake.placement(), fake.process_bytes_on(0)])

atexit.register(after_flexium)
import flexium
from flexium.api import runtime
flexium.init()
fake.set_process_memory(0, 1 << 30)
engine = runtime.current().engine
fake.clear_log()
paused = engine.pause()
print("paused:", paused.ok, engine.state.value, fake.state().name, fake.process_bytes_on(0), flush=True)
# exits paused, without resume() or shutdown()
"""

NO_DRIVER_SCRIPT = """
import flexium, torch
flexium.init()
from flexium.api import runtime
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(32, 4)
y = x.sum(dim=1, keepdim=True)
losses = []
for _ in range(30):
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
try:
    routed = str(torch.nn.Linear(2, 1).cuda().weight.device)
except Exception as exc:
    routed = type(exc).__name__ + ": " + str(exc)
out(initialized=flexium.is_initialized(), engine=runtime.current().engine is not None,
    migration_enabled=flexium.auto.is_migration_enabled(), in_progress=flexium.auto.is_migration_in_progress(),
    active=flexium.auto.is_active(), device=flexium.auto.get_device(), physical=flexium.auto.get_physical_device(),
    process_id=flexium.auto.get_process_id(), caps=flexium.utils.get_capabilities(),
    supports_migration=flexium.utils.supports_migration(), first_loss=losses[0], last_loss=losses[-1],
    routed=routed)
flexium.shutdown()
"""


@pytest.fixture(scope="module", autouse=True)
def scripts() -> Iterator[dict[str, Script]]:
    """Started when the module starts, so they run while the in-process tests do."""
    started = {
        "atexit": Script(ATEXIT_SCRIPT, script_env(), torch=True),
        "no_driver": Script(
            NO_DRIVER_SCRIPT,
            script_env(libcuda="/nonexistent/libcuda.so.1", libnvml="/nonexistent/libnvidia-ml.so.1"),
            torch=True,
        ),
    }
    yield started
    for script in started.values():
        script.kill()


# --------------------------------------------------------------------------------- in this process


@pytest.fixture
def clean(
    fake: FakeDriver, nvml_in_parent: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> Iterator[FakeDriver]:
    """No flexium settings from this environment or any rc file; no session before or after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in FLEXIUM_ENV:
        monkeypatch.delenv(name, raising=False)
    flexium.shutdown()
    assert not flexium.is_initialized()
    yield fake
    flexium.shutdown()
    assert not device_routing.is_installed()


def engine() -> Engine:
    current = runtime_module.current()
    assert current is not None and current.engine is not None
    return current.engine


def test_init_with_the_fake_driver_starts_the_engine(clean: FakeDriver, capsys: pytest.CaptureFixture[str]) -> None:
    flexium.init()
    assert flexium.is_initialized()
    assert isinstance(engine(), Engine) and engine().state == EngineState.RUNNING
    assert flexium.auto.get_device() == "cuda:0"
    assert flexium.auto.get_physical_device() == "cuda:0"
    assert flexium.auto.is_migration_enabled() is True
    assert flexium.auto.is_migration_in_progress() is False
    assert flexium.auto.is_active() is False  # init() alone: not inside a flexium.auto.run() block
    assert device_routing.is_installed()
    assert device_routing.managed_device() == "cuda:0"
    [line] = capsys.readouterr().err.splitlines()  # one start-up line, local mode in it
    assert line.startswith("[flexium] WARNING: flexium ready on cuda:0 (process gpu-")
    assert "migration on" in line and line.endswith(", local mode: no FLEXIUM_SERVER)")


def test_get_physical_device_follows_migrations(clean: FakeDriver) -> None:
    clean.set_process_memory(0, 2 * GiB)
    flexium.init()
    assert engine().migrate(engine().gpus[1]).ok
    assert flexium.auto.get_physical_device() == "cuda:1"
    assert flexium.auto.get_device() == "cuda:0"  # what the training code uses does not change
    assert device_routing.managed_device() == "cuda:0"
    assert clean.placement() == [1, 0]
    assert engine().migrate(engine().gpus[0]).ok
    assert flexium.auto.get_physical_device() == "cuda:0"


def test_the_device_comes_from_gpu_device_or_the_parameter(clean: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_DEVICE", "cuda:1")
    flexium.init()
    assert flexium.auto.get_device() == "cuda:1" and engine().logical_device == "cuda:1"
    assert flexium.auto.get_physical_device() == "cuda:1"
    assert engine().migrate(engine().gpus[0]).ok
    assert flexium.auto.get_physical_device() == "cuda:0" and clean.physical_of(1) == 0
    flexium.shutdown()
    flexium.init(device="cuda:0")  # the parameter wins over GPU_DEVICE
    assert flexium.auto.get_device() == "cuda:0"


def test_a_device_choice_never_ends_the_job(
    clean: FakeDriver, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """GPU_DEVICE=1 is cuda:1; a GPU this process does not see trains on cuda:0 with a warning."""
    monkeypatch.setenv("GPU_DEVICE", "1")
    flexium.init()
    assert flexium.auto.get_device() == "cuda:1" and engine().logical_device == "cuda:1"
    flexium.shutdown()
    monkeypatch.setenv("GPU_DEVICE", "cuda:5")
    flexium.init()
    assert flexium.auto.get_device() == "cuda:0" and engine().logical_device == "cuda:0"
    warned = "device cuda:5 (from environment variable GPU_DEVICE) does not exist: this process sees 2 GPUs"
    assert warned in capsys.readouterr().err


def test_get_device_without_init_uses_the_configuration(clean: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    assert flexium.auto.get_device() == "cuda:0"
    monkeypatch.setenv("GPU_DEVICE", "cuda:1")
    assert flexium.auto.get_device() == "cuda:1"
    assert flexium.auto.get_physical_device() == "cuda:1"
    assert flexium.auto.is_migration_enabled() is False and flexium.auto.is_active() is False


def test_is_migration_in_progress_during_an_operation(clean: FakeDriver) -> None:
    flexium.init()
    clean.set_delay_ms("cuCheckpointProcessCheckpoint", 300)
    migration = Background(lambda: engine().migrate(engine().gpus[1]))
    migration.start()
    wait_until(lambda: clean.state() == ProcessState.LOCKED, what="the migration to lock the process")
    assert flexium.auto.is_migration_in_progress() is True
    assert migration.join_result().ok
    assert flexium.auto.is_migration_in_progress() is False
    assert flexium.auto.get_physical_device() == "cuda:1"


def test_disabled_still_resolves_and_checks_the_device(clean: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_DEVICE", "cuda:1")
    flexium.init(disabled=True)
    assert flexium.auto.get_device() == "cuda:1" == flexium.auto.get_physical_device()
    flexium.shutdown()
    with pytest.raises(ConfigError, match="device 'bogus' \\(passed in code as device=\\) is not valid"):
        flexium.init(disabled=True, device="bogus")
    assert not flexium.is_initialized()
    monkeypatch.setenv("GPU_DEVICE", "gpu1")
    with pytest.raises(ConfigError, match="from environment variable GPU_DEVICE"):
        flexium.init(disabled=True)


def test_a_bad_server_is_named_as_the_caller_passed_it(clean: FakeDriver) -> None:
    with pytest.raises(ConfigError, match="passed in code as server="):
        flexium.init(server=123)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="passed in code as orchestrator="):
        with flexium.auto.run(orchestrator=123):  # type: ignore[arg-type]
            pass
    assert not flexium.is_initialized()


def test_init_applies_the_configured_log_level(clean: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    logger = logging.getLogger("flexium")
    before = logger.level
    try:
        monkeypatch.setenv("FLEXIUM_LOG_LEVEL", "debug")
        flexium.init()
        assert logger.level == logging.DEBUG
        flexium.shutdown()
        monkeypatch.delenv("FLEXIUM_LOG_LEVEL")
        Path.cwd().joinpath(".flexiumrc").write_text("log_level: WARNING\n")  # `clean` runs in a tmp dir
        flexium.init()
        assert logger.level == logging.WARNING
    finally:
        flexium.shutdown()
        logger.setLevel(before)


def test_process_id(clean: FakeDriver) -> None:
    first = flexium.auto.get_process_id()
    assert PROCESS_ID.match(first)
    flexium.init()
    assert flexium.auto.get_process_id() == first == runtime_module.current().process_id
    flexium.shutdown()
    flexium.init()
    assert flexium.auto.get_process_id() == first  # one id per process


def test_is_active_inside_run_only(clean: FakeDriver) -> None:
    assert flexium.auto.is_active() is False
    with flexium.auto.run(device="cuda:1"):
        assert flexium.auto.is_active() is True
        assert flexium.is_initialized()
        assert flexium.auto.get_device() == "cuda:1"
        assert flexium.auto.is_migration_enabled() is True
        assert runtime_module.current().scopes == 1
    assert flexium.auto.is_active() is False
    assert not flexium.is_initialized()
    assert not device_routing.is_installed()


def test_run_ends_its_session_when_the_block_raises(clean: FakeDriver) -> None:
    with pytest.raises(KeyError):
        with flexium.auto.run():
            assert flexium.auto.is_active()
            raise KeyError("training failed")
    assert not flexium.is_initialized() and flexium.auto.is_active() is False


def test_run_inside_init_keeps_the_session(clean: FakeDriver, capsys: pytest.CaptureFixture[str]) -> None:
    flexium.init()
    before = runtime_module.current()
    capsys.readouterr()
    with flexium.auto.run():
        assert runtime_module.current() is before and before.scopes == 1
        assert flexium.auto.is_active() is True
    assert runtime_module.current() is before and before.scopes == 0
    assert flexium.auto.is_active() is False
    assert "ignored" not in capsys.readouterr().err  # no argument asked for other settings
    with flexium.auto.run(device="cuda:0", orchestrator=None):  # what the session has: nothing to say
        pass
    assert "ignored" not in capsys.readouterr().err
    with flexium.auto.run(orchestrator="localhost:9/w", device="cuda:1", disabled=True):
        assert flexium.auto.get_device() == "cuda:0" and flexium.auto.is_active() is True
    err = capsys.readouterr().err
    assert "flexium.auto.run() inside the session flexium.init() started keeps that session's settings" in err
    assert "orchestrator='localhost:9/w' (the session's server: none, local mode)" in err
    assert "device='cuda:1' (the session's device: cuda:0)" in err and "disabled=True" in err
    assert runtime_module.current() is before


def test_disabled_bypasses_everything(clean: FakeDriver) -> None:
    original = torch.Tensor.cuda
    clean.clear_log()
    flexium.init(disabled=True)
    assert flexium.is_initialized()
    current = runtime_module.current()
    assert current.disabled and current.engine is None and current.capabilities is None
    assert not device_routing.is_installed() and torch.Tensor.cuda is original
    assert clean.calls("cu") == []  # not even the driver was asked
    assert flexium.auto.is_active() is False
    assert flexium.auto.is_migration_enabled() is False
    assert flexium.auto.is_migration_in_progress() is False
    assert flexium.auto.get_device() == "cuda:0" == flexium.auto.get_physical_device()
    flexium.shutdown()
    assert not flexium.is_initialized()
    with flexium.auto.run(disabled=True):
        assert flexium.auto.is_active() is False and not device_routing.is_installed()
        assert runtime_module.current().engine is None
    assert not flexium.is_initialized()


def test_init_twice_warns_and_changes_nothing(clean: FakeDriver, capsys: pytest.CaptureFixture[str]) -> None:
    flexium.init()
    first = runtime_module.current()
    capsys.readouterr()
    flexium.init(device="cuda:1")
    assert (
        "flexium.init() was already called; this call changes nothing (call shutdown() first)"
        in capsys.readouterr().err
    )
    assert runtime_module.current() is first and flexium.auto.get_device() == "cuda:0"


def test_shutdown_then_init_again(clean: FakeDriver) -> None:
    flexium.init()
    first = engine()
    assert first.migrate(first.gpus[1]).ok
    flexium.shutdown()
    assert not flexium.is_initialized() and not device_routing.is_installed()
    assert flexium.auto.is_migration_enabled() is False
    clean.reset()  # a new process would start from its own GPU again
    flexium.init()
    second = engine()
    assert second is not first and second.state == EngineState.RUNNING
    assert flexium.auto.get_physical_device() == "cuda:0"
    assert second.migrate(second.gpus[1]).ok and flexium.auto.get_physical_device() == "cuda:1"
    assert device_routing.is_installed()


def test_shutdown_resumes_a_paused_job(clean: FakeDriver) -> None:
    clean.set_process_memory(0, GiB)
    flexium.init()
    job = engine()
    assert job.pause().ok and clean.state() == ProcessState.CHECKPOINTED
    flexium.shutdown()
    assert job.state == EngineState.RUNNING
    assert clean.state() == ProcessState.RUNNING and clean.process_bytes_on(0) == GiB


def test_capabilities_through_flexium_utils(clean: FakeDriver) -> None:
    caps = flexium.utils.get_capabilities()
    assert caps["driver_version"] == "580.159.04"
    assert caps["pause_resume"] is True and caps["migration"] is True
    assert caps["checkpoint_api"] is True and caps["gpu_count"] == 2 and caps["cuda_version"] == 13000
    assert isinstance(caps["problems"], list)
    assert flexium.utils.supports_migration() is True


def test_the_spec_signatures() -> None:
    def params(fn: Any) -> list[tuple[str, Any]]:
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    # The promised parameters, in their order; what flexium adds comes after them, keyword-only.
    assert params(flexium.init) == [("server", None), ("device", None), ("disabled", False), ("priority", None)]
    assert inspect.signature(flexium.init).parameters["priority"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params(flexium.auto.run) == [("orchestrator", None), ("device", None), ("disabled", False)]
    for name in (
        "get_device",
        "get_physical_device",
        "is_active",
        "is_migration_in_progress",
        "get_process_id",
        "is_migration_enabled",
    ):
        assert params(getattr(flexium.auto, name)) == [], name
    assert params(flexium.auto.recoverable) == [("retries", 3)]
    assert callable(flexium.shutdown) and callable(flexium.is_initialized)
    assert set(flexium.utils.__all__) == {"get_capabilities", "supports_migration"}
    assert {"init", "shutdown", "is_initialized", "auto", "utils", "config"} <= set(flexium.__all__)


# --------------------------------------------------------------------------------- subprocesses


def test_a_job_paused_at_exit_is_resumed(scripts: dict[str, Script]) -> None:
    run = scripts["atexit"].wait()
    assert "paused: True PAUSED CHECKPOINTED 0" in run.stdout
    state, calls, placement, bytes_on_0 = run.result["at_exit"]
    assert state == "RUNNING"
    assert [c for c in calls if c != "GetState"] == ["Lock", "Checkpoint", "Restore", "Unlock"]
    assert placement == [0, 1] and bytes_on_0 == 1 << 30
    assert "resume cuda:0 -> cuda:0 done" in run.stderr


def test_without_a_driver_training_runs_and_migration_is_off(scripts: dict[str, Script]) -> None:
    run = scripts["no_driver"].wait()
    out = run.result
    assert out["initialized"] is True and out["engine"] is False
    assert out["migration_enabled"] is False and out["in_progress"] is False and out["active"] is False
    assert PROCESS_ID.match(out["process_id"])
    assert out["last_loss"] < out["first_loss"] / 10  # training ran on CPU tensors
    caps = out["caps"]
    assert caps["driver_version"] is None and caps["pause_resume"] is False and caps["migration"] is False
    assert caps["gpu_count"] == 0 and caps["cuda_version"] == 0
    assert any("no NVIDIA driver: could not load /nonexistent/libcuda.so.1" in p for p in caps["problems"])
    assert out["supports_migration"] is False
    [line] = [line for line in run.stderr.splitlines() if line.startswith("[flexium]")]
    assert line.startswith("[flexium] WARNING: flexium in degraded mode on cpu (process gpu-")
    assert "local mode: no FLEXIUM_SERVER): no NVIDIA driver: could not load /nonexistent/libcuda.so.1" in line
    assert line.endswith("install the NVIDIA driver (570+ to pause and resume, 580+ to move between GPUs)")


def test_without_a_driver_the_device_is_cpu(scripts: dict[str, Script]) -> None:
    out = scripts["no_driver"].wait().result
    assert out["device"] == "cpu" and out["physical"] == "cpu"
    assert out["routed"] == "cpu"  # a bare .cuda() keeps the script running, as without FLEXIUM_LIBCUDA
