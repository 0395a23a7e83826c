"""Every script in examples/ trains a few steps on a GPU as a user would start it (local mode):
timm's and torchvision's run only here (tests/examples/test_examples.py says why)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.fresh_process import keep_log

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEXIUM_")}
    env.update(HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    done = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    keep_log(tuple(args[1:]), None, done.returncode, done.stdout, done.stderr)
    return done


@pytest.mark.parametrize(
    "script",
    [
        "plain_pytorch.py",
        "lightning_trainer.py",
        "hf_trainer.py",
        "accelerate_loop.py",
        "timm_model.py",
        "torchvision_resnet.py",
    ],
)
def test_an_example_trains_on_a_gpu(script: str, tmp_path: Path) -> None:
    done = _run([sys.executable, str(EXAMPLES / script), "--steps", "20"], tmp_path)
    assert done.returncode == 0, f"{script}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "flexium ready on cuda:0" in done.stderr and "fast path on" in done.stderr, done.stderr[-3000:]
