"""What a job prints when flexium.init() starts it: one line (issue 38: a CPU job printed a
7-line box and three lines, even at FLEXIUM_LOG_LEVEL=ERROR), and no torch NumPy warning that
flexium's own import of torch caused, while the script's own warnings stay."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support.engine import script_env

NO_DRIVER = {"libcuda": "/nonexistent/libcuda.so.1", "libnvml": "/nonexistent/libnvidia-ml.so.1"}


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=env["HOME"], capture_output=True, text=True, timeout=120
    )


def test_a_job_that_cannot_move_prints_one_line_and_nothing_at_error_level() -> None:
    pytest.importorskip("torch")
    env = script_env(**NO_DRIVER)
    started = _run("import flexium; flexium.init(); print('trained')", env)
    assert started.returncode == 0 and started.stdout == "trained\n", started.stderr
    [line] = started.stderr.splitlines()
    assert line.startswith("[flexium] WARNING: flexium in degraded mode on cpu (process gpu-")
    assert "local mode: no FLEXIUM_SERVER): no NVIDIA driver" in line
    quiet = _run("import flexium; flexium.init(); print('trained')", {**env, "FLEXIUM_LOG_LEVEL": "ERROR"})
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


FAKE_TORCH = """
import warnings
warnings.warn("Failed to initialize NumPy: No module named 'numpy'", UserWarning)
__version__ = "0.0+fake"
"""


def test_torchs_numpy_warning_is_hidden_only_where_flexium_imports_torch(tmp_path: Path) -> None:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(FAKE_TORCH)
    env = {**script_env(), "PYTHONPATH": f"{tmp_path}:{script_env().get('PYTHONPATH', '')}"}
    by_flexium = _run("from flexium.torch_import import import_torch; print(import_torch().__version__)", env)
    assert by_flexium.stdout == "0.0+fake\n" and by_flexium.stderr == "", by_flexium.stderr
    by_the_script = _run(
        "import torch\nfrom flexium.torch_import import import_torch\nassert import_torch() is torch", env
    )
    assert by_the_script.returncode == 0 and "Failed to initialize NumPy" in by_the_script.stderr
    other = _run(
        "import warnings\nfrom flexium.torch_import import import_torch\nimport_torch()\n"
        "warnings.warn('the script says so', UserWarning)",
        env,
    )
    assert "the script says so" in other.stderr and "NumPy" not in other.stderr
