"""The columns of `flexium ps` that no end-to-end job on the CPU fills: MOVES for every kind of
process, and the GPU of a process on several."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from flexium import wire
from flexium.cli import processes


@pytest.mark.parametrize(
    "capabilities, moves",
    [
        ({"pause_resume": True, "migration": True, "fast_path": True}, "fast"),
        ({"pause_resume": True, "migration": True, "fast_path": False, "fast_path_problem": "no pool"}, "driver"),
        ({"pause_resume": True, "migration": False, "fast_path": True}, "pause"),
        ({"pause_resume": False, "migration": False, "problems": ["no driver"]}, "-"),
        ({}, "-"),
    ],
)
def test_ps_says_how_a_process_can_move(capabilities: dict[str, Any], moves: str) -> None:
    assert processes._moves(wire.ProcessCapabilities.model_validate(capabilities)) == moves


def test_ps_counts_the_other_gpus_of_a_process_on_several() -> None:
    def cell(index: Any, others: list[str]) -> str:
        return processes._gpu_cell(SimpleNamespace(gpu_index=index, gpu_model="NVIDIA H200", other_gpus=others))  # type: ignore[arg-type]

    assert cell(0, []) == "0 NVIDIA H200"
    assert cell(0, ["GPU-b"]) == "0 NVIDIA H200 (+1 GPU)"
    assert cell(2, ["GPU-a", "GPU-b", "GPU-d"]) == "2 NVIDIA H200 (+3 GPUs)"
    assert processes._gpu_cell(SimpleNamespace(gpu_index=None, gpu_model="", other_gpus=[])) == "-"  # type: ignore[arg-type]
