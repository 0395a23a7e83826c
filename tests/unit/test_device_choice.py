"""flexium.init()'s device choice (api/device_choice.py): the setting, unless the script chose a
GPU before init; a choice that cannot be followed is a warning, never the end of the job."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from flexium.api import runtime
from flexium.api.device_choice import DeviceChoice, choose_device
from flexium.config import load_config
from flexium.engine.capabilities import Capabilities


def test_the_setting_decides_when_the_script_chose_nothing() -> None:
    assert choose_device(setting="cuda:1", where="GPU_DEVICE", visible=2, script_device=None) == DeviceChoice("cuda:1")
    assert choose_device(setting="cpu", where="GPU_DEVICE", visible=2, script_device=None) == DeviceChoice("cpu")


def test_a_gpu_the_process_does_not_see_trains_on_cuda_0_with_a_warning() -> None:
    choice = choose_device(
        setting="cuda:3", where="from environment variable GPU_DEVICE", visible=1, script_device=None
    )
    assert choice.device == "cuda:0"
    assert choice.warning == (
        "device cuda:3 (from environment variable GPU_DEVICE) does not exist: this process sees 1 GPU (cuda:0); "
        "training on cuda:0"
    )
    ranked = choose_device(setting="cuda:1", where="the default", visible=1, script_device=None, local_rank=1)
    assert ranked.device == "cuda:0" and "CUDA_VISIBLE_DEVICES per rank" in (ranked.warning or "")


def test_no_gpu_seen_trains_on_the_cpu() -> None:
    assert choose_device(setting="cuda:0", where="the default", visible=0, script_device=None) == DeviceChoice("cpu")


def test_the_scripts_own_choice_stands() -> None:
    """Issue 38: a torchrun script that calls torch.cuda.set_device(0) in both ranks before
    flexium.init() trains on, on cuda:0, and is told what that costs."""
    rank_1 = choose_device(setting="cuda:1", where="the default", visible=1, script_device=0, local_rank=1)
    assert rank_1.device == "cuda:0"
    assert rank_1.warning is not None and "not cuda:1 of its LOCAL_RANK" in rank_1.warning
    assert "cannot be moved as a whole" in rank_1.warning
    same = choose_device(setting="cuda:0", where="the default", visible=2, script_device=0, local_rank=0)
    assert same == DeviceChoice("cuda:0")
    overridden = choose_device(
        setting="cuda:1", where="from environment variable GPU_DEVICE", visible=2, script_device=0
    )
    assert overridden.device == "cuda:0"
    assert overridden.warning == (
        "training on cuda:0, the GPU the script chose before flexium.init() (torch.cuda.set_device); "
        "device cuda:1 (from environment variable GPU_DEVICE) is not used"
    )


class _FakeCuda:
    """torch.cuda as a one-GPU machine shows it after the script's torch.cuda.set_device(0)."""

    def __init__(self, *, count: int, current: int | None) -> None:
        self.count, self.current = count, current
        self.set_to: int | None = None

    def device_count(self) -> int:
        return self.count

    def is_initialized(self) -> bool:
        return self.current is not None

    def current_device(self) -> int:
        assert self.current is not None, "reading the current device would initialize CUDA"
        return self.current

    def set_device(self, ordinal: int) -> None:
        self.set_to = ordinal


CUDA_MACHINE = Capabilities(
    driver_version="580.159.04",
    driver_major=580,
    cuda_version=13000,
    checkpoint_api=True,
    torch_cuda=True,
    gpu_count=1,
    pause_resume=True,
    migration=True,
    problems=(),
)


@pytest.mark.parametrize(
    ("env", "current", "expected", "warned"),
    [
        ({"LOCAL_RANK": "1"}, 0, "cuda:0", "not cuda:1 of its LOCAL_RANK"),  # set_device(0) before init
        ({"LOCAL_RANK": "1"}, None, "cuda:0", "does not exist"),  # one GPU seen per rank
        ({"GPU_DEVICE": "0"}, None, "cuda:0", None),  # a bare index
        ({}, None, "cuda:0", None),
    ],
)
def test_init_claims_the_device_torch_trains_on(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    env: dict[str, str],
    current: int | None,
    expected: str,
    warned: str | None,
) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("LOCAL_RANK", "GPU_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cuda = _FakeCuda(count=1, current=current)
    for name in ("device_count", "is_initialized", "current_device", "set_device"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    device = runtime._claim_device(load_config(), CUDA_MACHINE)
    assert device == expected and cuda.set_to == int(expected.split(":")[1])
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[flexium] WARNING: ")]
    if warned is None:
        assert warnings == []
    else:
        [warning] = warnings
        assert warned in warning


def test_a_cpu_setting_or_a_machine_without_cuda_trains_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEXIUM_LIBCUDA", raising=False)
    assert runtime._claim_device(load_config(device="cpu"), CUDA_MACHINE) == "cpu"
    assert runtime._claim_device(load_config(device="cuda:0"), replace(CUDA_MACHINE, torch_cuda=False)) == "cpu"
