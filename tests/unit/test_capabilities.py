"""What each driver allows (flexium.engine.capabilities, flexium.utils) and how the engine and
flexium.init() honour it: driver 580 migrates, 570 (CUDA 12.8) pauses only, a driver without the
checkpoint API does nothing. _C reads the driver once per process, so each other driver runs in a
subprocess; they all start together when this module starts and are collected by their tests."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

from flexium.engine import capabilities as capabilities_module
from flexium.engine.capabilities import Capabilities, detect
from support.engine import Script, driver, fake, script_env  # noqa: F401  (fixtures)
from support.fake_driver import FakeDriver

# Engine-level checks shared by the subprocess scripts: what pause / resume / migrate do.
ENGINE_PROBE = """
from support import fake_driver
from flexium import _C
from flexium.engine import Engine, snapshot_gpus
from flexium.engine.capabilities import detect

fake = fake_driver.FakeDriver(os.environ["FLEXIUM_LIBCUDA"])

def attempt(fn):
    try:
        result = fn()
        return {"ok": result.ok, "target": None if result.target is None else result.target.device}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}

def probe_engine(caps):
    engine = Engine(logical_ordinal=0, gpus=snapshot_gpus(), capabilities=caps)
    fake.clear_log()
    report = {"migrate": attempt(lambda: engine.migrate(engine.gpus[1])),
              "calls_after_migrate": fake.checkpoint_calls()}
    report["pause"] = attempt(engine.pause)
    report["state_after_pause"] = engine.state.value
    report["resume_elsewhere"] = attempt(lambda: engine.resume(engine.gpus[1]))
    report["resume"] = attempt(engine.resume)
    report["final"] = [engine.state.value, fake.state().name, fake.placement()]
    return report
"""

SESSION_PROBE = """
import flexium
from flexium.api import runtime
flexium.init()
current = runtime.current()
session_report = {
    "has_engine": current.engine is not None,
    "migration_enabled": flexium.auto.is_migration_enabled(),
    "device": flexium.auto.get_device(),
    "utils": flexium.utils.get_capabilities(),
    "supports_migration": flexium.utils.supports_migration(),
}
"""

SCRIPTS: dict[str, dict[str, Any]] = {
    # Driver 570 (CUDA 12.8): the checkpoint API without GPU remapping.
    "driver_570": dict(
        env=dict(FAKE_CUDA_VERSION=12080, FAKE_NVML_DRIVER="570.86.10"),
        torch=True,
        code=ENGINE_PROBE
        + SESSION_PROBE
        + """
engine = current.engine
fake.clear_log()
engine_report = {"migrate": attempt(lambda: engine.migrate(engine.gpus[1])), "calls": fake.checkpoint_calls(),
                 "pause": attempt(engine.pause), "resume_elsewhere": attempt(lambda: engine.resume(engine.gpus[1])),
                 "resume": attempt(engine.resume), "final": [engine.state.value, fake.state().name]}
out(caps=detect(check_torch=False).to_dict(), session=session_report, engine=engine_report)
""",
    ),
    # The same driver where NVML cannot be loaded: the CUDA version bounds the driver branch.
    "cuda_12080_without_nvml": dict(
        env=dict(FAKE_CUDA_VERSION=12080, libnvml="/nonexistent/libnvidia-ml.so.1"),
        code=ENGINE_PROBE
        + """
caps = detect(check_torch=False)
out(caps=caps.to_dict(), engine=probe_engine(caps))
""",
    ),
    # A driver whose libcuda lacks cuCheckpointProcess*: no pause, no migration, no engine.
    "no_checkpoint_api": dict(
        env=dict(FAKE_CUDA_NO_CHECKPOINT=1),
        torch=True,
        code=ENGINE_PROBE
        + SESSION_PROBE
        + """
caps = detect(check_torch=False)
status = _C.driver_status()
out(caps=caps.to_dict(), status=dict(loaded=status.loaded, checkpoint_api=status.checkpoint_api),
    session=session_report, engine=probe_engine(caps))
""",
    ),
    # NVML says 580 but libcuda is CUDA 12.8 (not seen in practice): GPU pairs need CUDA 13.0, so
    # migration is refused up front, before the driver is asked anything.
    "remap_refused": dict(
        env=dict(FAKE_CUDA_VERSION=12080),
        code=ENGINE_PROBE
        + """
caps = detect(check_torch=False)
engine = Engine(logical_ordinal=0, gpus=snapshot_gpus(), capabilities=caps)
fake.clear_log()
try:
    engine.migrate(engine.gpus[1])
    error = None
except Exception as exc:
    error = [type(exc).__name__, getattr(exc, "step", None), str(exc)]
out(caps=caps.to_dict(), error=error, calls=fake.checkpoint_calls(),
    final=[engine.state.value, fake.state().name, fake.placement()])
""",
    ),
    "no_vmm": dict(
        env=dict(FAKE_CUDA_NO_VMM=1),
        code="from flexium.cli import doctor\nout(problem=doctor._fast_path_problem())",
    ),
    "driver_550": dict(
        env=dict(FAKE_CUDA_VERSION=12040, FAKE_NVML_DRIVER="550.54.15"),
        code="from flexium.engine.capabilities import detect\nout(caps=detect(check_torch=False).to_dict())",
    ),
    "driver_535": dict(
        env=dict(FAKE_CUDA_VERSION=12020, FAKE_NVML_DRIVER="535.183.01"),
        code="from flexium.engine.capabilities import detect\nout(caps=detect(check_torch=False).to_dict())",
    ),
    "no_gpus": dict(
        env=dict(FAKE_CUDA_GPUS=0),
        code="from flexium.engine.capabilities import detect\nout(caps=detect(check_torch=False).to_dict())",
    ),
}


@pytest.fixture(scope="module", autouse=True)
def scripts() -> Iterator[dict[str, Script]]:
    started: dict[str, Script] = {}
    for name, spec in SCRIPTS.items():
        env_vars = dict(spec["env"])
        libnvml = env_vars.pop("libnvml", None)
        started[name] = Script(spec["code"], script_env(libnvml=libnvml, **env_vars), torch=spec.get("torch", False))
    yield started
    for script in started.values():
        script.kill()


def result(scripts: dict[str, Script], name: str) -> dict[str, Any]:
    return scripts[name].wait().result


# ----------------------------------------------------------------------------- this process: driver 580


def test_driver_580_allows_everything(fake: FakeDriver) -> None:
    caps = detect(check_torch=False)
    assert caps == Capabilities(
        driver_version="580.159.04",
        driver_major=580,
        cuda_version=13000,
        checkpoint_api=True,
        torch_cuda=False,
        gpu_count=2,
        pause_resume=True,
        migration=True,
        problems=(),
    )
    data = caps.to_dict()
    assert json.loads(json.dumps(data)) == data and data["problems"] == []


def test_a_cpu_only_torch_is_reported_without_blocking_the_driver_features(fake: FakeDriver) -> None:
    pytest.importorskip("torch")
    caps = detect()
    assert caps.torch_cuda is False
    assert len(caps.problems) == 1 and "CPU-only build" in caps.problems[0]
    assert "training runs" in caps.problems[0]
    assert caps.pause_resume and caps.migration


def test_the_gpu_count_follows_the_driver(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_CUDA_GPUS", "4")
    fake.reset()
    assert detect(check_torch=False).gpu_count == 4


@pytest.mark.parametrize(
    "version,cuda,major",
    [
        ("580.159.04", 13000, 580),
        ("570.86.10", 12080, 570),
        ("550.54.15", 12040, 550),
        (None, 13000, 580),  # without NVML, the CUDA version bounds the branch from below
        (None, 12090, 575),
        (None, 12080, 570),
        (None, 12060, 560),
        (None, 12040, 550),
        (None, 12000, 525),
        (None, 11080, None),
        ("not-a-version", 12080, 570),
    ],
)
def test_driver_branch(version: Any, cuda: int, major: Any) -> None:
    assert capabilities_module._driver_major(version, cuda) == major


def test_thresholds_are_the_checkpoint_api_and_remapping_drivers() -> None:
    # The spec's 550 is NVIDIA's cuda-checkpoint tool; the calls flexium makes arrive with 570.
    assert capabilities_module.PAUSE_RESUME_MIN_DRIVER == 570
    assert capabilities_module.MIGRATION_MIN_DRIVER == 580


# ----------------------------------------------------------------------------- subprocesses: other drivers


def test_driver_570_pauses_but_does_not_migrate(scripts: dict[str, Script]) -> None:
    run = scripts["driver_570"].wait()
    out = run.result
    assert "flexium ready on cuda:0" in run.stderr and "migration off" in run.stderr
    assert "WARNING: migration and pause are limited: NVIDIA driver 570.86.10: pause/resume only" in run.stderr
    caps = out["caps"]
    assert caps["driver_version"] == "570.86.10" and caps["cuda_version"] == 12080
    assert caps["checkpoint_api"] and caps["pause_resume"] and not caps["migration"]
    assert caps["problems"] == ["NVIDIA driver 570.86.10: pause/resume only; migration to another GPU needs 580+"]
    session = out["session"]
    assert session["has_engine"] is True
    assert session["migration_enabled"] is False
    assert session["supports_migration"] is False
    assert session["utils"]["pause_resume"] is True and session["utils"]["migration"] is False
    engine = out["engine"]
    assert engine["migrate"]["error"] == "CapabilityError"
    # The message lists every problem of the session (here also the CPU-only torch of this machine).
    assert engine["migrate"]["message"].startswith("migration to another GPU is not available on this machine: ")
    assert (
        "NVIDIA driver 570.86.10: pause/resume only; migration to another GPU needs 580+"
        in engine["migrate"]["message"]
    )
    assert engine["calls"] == []  # refused before any driver call
    assert engine["pause"] == {"ok": True, "target": None}
    assert engine["resume_elsewhere"]["error"] == "CapabilityError"
    assert "resuming on another GPU is not available" in engine["resume_elsewhere"]["message"]
    assert engine["resume"] == {"ok": True, "target": "cuda:0"}
    assert engine["final"] == ["RUNNING", "RUNNING"]


def test_cuda_12080_without_nvml_is_taken_for_driver_570(scripts: dict[str, Script]) -> None:
    out = result(scripts, "cuda_12080_without_nvml")
    caps = out["caps"]
    assert caps["driver_version"] is None and caps["driver_major"] == 570
    assert caps["pause_resume"] and not caps["migration"]
    assert caps["problems"] == [
        "NVIDIA driver 570+ (CUDA 12.8): pause/resume only; migration to another GPU needs 580+"
    ]
    engine = out["engine"]
    assert engine["migrate"]["error"] == "CapabilityError"
    assert engine["calls_after_migrate"] == []
    assert engine["pause"]["ok"] and engine["state_after_pause"] == "PAUSED"
    assert engine["resume_elsewhere"]["error"] == "CapabilityError"
    assert engine["resume"] == {"ok": True, "target": "cuda:0"}
    assert engine["final"] == ["RUNNING", "RUNNING", [0, 1]]


def test_without_the_checkpoint_api_nothing_is_offered(scripts: dict[str, Script]) -> None:
    run = scripts["no_checkpoint_api"].wait()
    out = run.result
    caps = out["caps"]
    assert out["status"]["loaded"] is True and out["status"]["checkpoint_api"] is False
    assert caps["checkpoint_api"] is False and caps["pause_resume"] is False and caps["migration"] is False
    assert caps["problems"] == [
        "NVIDIA driver 580.159.04 lacks the checkpoint API (cuCheckpointProcess*, CUDA 12.8); upgrade to 580+"
    ]
    session = out["session"]
    assert session["has_engine"] is False
    assert session["migration_enabled"] is False and session["supports_migration"] is False
    assert "WARNING: flexium in degraded mode on cuda:0 (process gpu-" in run.stderr
    assert "): NVIDIA driver 580.159.04 lacks the checkpoint API" in run.stderr
    engine = out["engine"]
    for operation in ("migrate", "pause"):
        assert engine[operation]["error"] == "CapabilityError"
        assert "lacks the checkpoint API" in engine[operation]["message"]
    assert engine["calls_after_migrate"] == []
    assert engine["resume"]["error"] == "InvalidStateError"
    assert engine["final"] == ["RUNNING", "RUNNING", [0, 1]]


def test_driver_550_is_too_old_for_the_in_process_checkpoint_api(scripts: dict[str, Script]) -> None:
    caps = result(scripts, "driver_550")["caps"]
    assert caps["driver_major"] == 550 and caps["checkpoint_api"] is False
    assert not caps["pause_resume"] and not caps["migration"]
    assert caps["problems"] == [
        "NVIDIA driver 550.54.15 is too old: it needs 570+ to pause and resume, 580+ to move between GPUs; "
        "upgrade the driver"
    ]


def test_driver_535_is_too_old(scripts: dict[str, Script]) -> None:
    caps = result(scripts, "driver_535")["caps"]
    assert caps["driver_major"] == 535 and not caps["pause_resume"] and not caps["migration"]
    assert caps["problems"] == [
        "NVIDIA driver 535.183.01 is too old: it needs 570+ to pause and resume, 580+ to move between GPUs; "
        "upgrade the driver"
    ]


def test_a_driver_without_gpus(scripts: dict[str, Script]) -> None:
    caps = result(scripts, "no_gpus")["caps"]
    assert caps["gpu_count"] == 0 and not caps["pause_resume"] and not caps["migration"]
    assert len(caps["problems"]) == 1
    assert "the NVIDIA driver failed to initialise" in caps["problems"][0]
    assert "CUDA_ERROR_NO_DEVICE" in caps["problems"][0] and "check nvidia-smi" in caps["problems"][0]


def test_a_libcuda_without_gpu_pairs_refuses_migration_up_front(scripts: dict[str, Script]) -> None:
    out = result(scripts, "remap_refused")
    assert out["caps"]["pause_resume"] is True and out["caps"]["migration"] is False
    assert any("CUDA 13.0" in problem for problem in out["caps"]["problems"])
    name, step, message = out["error"]
    assert name == "CapabilityError" and step is None
    assert "migration to another GPU is not available" in message and "CUDA 13.0" in message
    assert [c for c in out["calls"] if c != "GetState"] == []
    assert out["final"] == ["RUNNING", "RUNNING", [0, 1]]


# ----------------------------------------------------------------------------- flexium doctor: the fast path


def test_doctor_says_why_the_fast_path_cannot_run_here(fake: FakeDriver, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    from flexium.cli import doctor

    assert doctor.run(as_json=True) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fast_path"]["available"] is False
    assert re.fullmatch(r"torch \S+ has no usable CUDA", report["fast_path"]["problem"])
    assert doctor.run(as_json=False) == 0
    assert re.search(r"^fast path +no: torch \S+ has no usable CUDA$", capsys.readouterr().out, re.M)


def test_doctor_says_whether_torchrun_jobs_can_move(
    fake: FakeDriver, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from flexium.cli import doctor
    from flexium.engine.distributed import nccl

    assert doctor.run(as_json=True) == 0
    jobs = json.loads(capsys.readouterr().out)["distributed_jobs"]
    assert jobs == {"nccl": f"none (torch {torch.__version__} has no NCCL)", "movable": True, "problem": None}
    # A torch with NCCL 2.28.9: what a user of torch 2.11 reads.
    monkeypatch.setattr(torch.distributed, "ProcessGroupNCCL", object, raising=False)
    old = nccl.NcclLibrary(path="/site/nvidia/nccl/lib/libnccl.so.2", version=22809, can_suspend=False, handle=None)
    monkeypatch.setattr(nccl, "loaded_library", lambda: old)
    monkeypatch.delenv(nccl.NVLS_ENV, raising=False)
    monkeypatch.delenv(nccl.CUMEM_HOST_ENV, raising=False)
    assert doctor.run(as_json=False) == 0
    shown = capsys.readouterr().out
    assert re.search(r"^NCCL +2\.28\.9 \(/site/nvidia/nccl/lib/libnccl\.so\.2\)$", shown, re.M)
    assert re.search(r"^torchrun jobs +not movable: this job's NCCL is 2\.28\.9 ", shown, re.M)
    # doctor judged a job's environment without changing its own
    assert nccl.NVLS_ENV not in os.environ and nccl.CUMEM_HOST_ENV not in os.environ
    monkeypatch.setattr(nccl, "loaded_library", lambda: dataclasses.replace(old, version=23007, can_suspend=True))
    assert doctor.run(as_json=False) == 0
    assert re.search(r"^torchrun jobs +movable as a whole$", capsys.readouterr().out, re.M)


def test_doctor_names_a_driver_without_the_virtual_memory_api(scripts: dict[str, Script]) -> None:
    assert result(scripts, "no_vmm")["problem"] == "the driver lacks the CUDA virtual memory API"
