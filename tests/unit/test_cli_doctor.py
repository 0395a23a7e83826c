"""`flexium doctor` as a newcomer reads it on a machine without a GPU: aligned rows, no CUDA
version where there is no driver, and no claim that torchrun jobs move where nothing pauses."""

from __future__ import annotations

import json
import re

import pytest

from flexium.cli import doctor
from flexium.engine.capabilities import Capabilities

NO_DRIVER = Capabilities(
    driver_version=None,
    driver_major=None,
    cuda_version=0,
    checkpoint_api=False,
    torch_cuda=False,
    gpu_count=0,
    pause_resume=False,
    migration=False,
    problems=("no NVIDIA driver: could not load libcuda.so.1; install the NVIDIA driver",),
)


def test_without_a_driver_doctor_claims_nothing_it_cannot_do(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(doctor, "detect", lambda: NO_DRIVER)
    monkeypatch.setattr(doctor.nvml, "host_gpus", lambda: [])
    monkeypatch.setattr(doctor, "_distributed_jobs", lambda: ("none (torch 2.13.0+cpu has no NCCL)", None))
    assert doctor.run(as_json=False) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "NVIDIA driver       not found"  # no "(CUDA 0.0)"
    assert "torchrun jobs       not movable: pause / resume is not available" in lines
    assert not any("movable as a whole" in line for line in lines)
    rows = [line for line in lines if not line.startswith("!")]
    # every value starts in one column, the pinned host memory row's too
    assert {len(re.match(r"^(\S.*?  +|\s+)", row).group(1)) for row in rows} == {doctor.LABEL_WIDTH}  # type: ignore[union-attr]
    assert doctor.run(as_json=True) == 0
    jobs = json.loads(capsys.readouterr().out)["distributed_jobs"]
    assert jobs["movable"] is False and jobs["problem"] == "pause / resume is not available"


def test_a_driver_shows_its_cuda_version(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    driver = Capabilities(
        driver_version="580.159.04",
        driver_major=580,
        cuda_version=13000,
        checkpoint_api=True,
        torch_cuda=True,
        gpu_count=0,
        pause_resume=True,
        migration=True,
        problems=(),
    )
    monkeypatch.setattr(doctor, "detect", lambda: driver)
    monkeypatch.setattr(doctor.nvml, "host_gpus", lambda: [])
    monkeypatch.setattr(doctor, "_fast_path_problem", lambda: None)
    monkeypatch.setattr(doctor, "_distributed_jobs", lambda: ("none (torch 2.13.0 has no NCCL)", None))
    assert doctor.run(as_json=False) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "NVIDIA driver       580.159.04  (CUDA 13.0)"
    assert "torchrun jobs       gloo jobs movable as a whole (no NCCL)" in lines
