"""Optimizer steps outside torch.optim (flexium.engine.foreign_steps): a stand-in `fastai.optimizer`
package, imported for real, gets its `Optimizer.step` reported whether it is imported after the
watch begins (the import hook) or before (patched at once); torch.optim's own steps are left to
PyTorch's hook, and an unwatched report does nothing. Each case runs in a fresh interpreter: the
hook changes sys.meta_path and the stand-in class for the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

STAND_IN = '''
class _BaseOptimizer:
    pass

class Optimizer(_BaseOptimizer):
    def __init__(self):
        self.steps = 0

    def step(self, closure=None):
        """fastai's step."""
        self.steps += 1
        return "stepped"

class OptimWrapper(_BaseOptimizer):
    def step(self):
        return "wrapped"
'''


def run(tmp_path: Path, script: str, *, module_in_package: bool = True) -> str:
    package = tmp_path / "fastai"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package if module_in_package else tmp_path).joinpath("optimizer.py").write_text(STAND_IN)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": f"{tmp_path}:{':'.join(sys.path)}"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("imported", ["after the watch", "before the watch"])
def test_fastai_steps_are_reported(tmp_path: Path, imported: str) -> None:
    early = "import fastai.optimizer" if imported == "before the watch" else ""
    out = run(
        tmp_path,
        f"""
        {early}
        from flexium.engine import foreign_steps
        seen = []
        foreign_steps.watch(seen.append)
        from fastai.optimizer import Optimizer, OptimWrapper
        opt = Optimizer()
        assert opt.step() == "stepped" and opt.steps == 1
        assert OptimWrapper().step() == "wrapped"  # wraps a torch.optim one: PyTorch's hook reports it
        assert Optimizer.step.__doc__ == "fastai's step."
        foreign_steps.watch(seen.append)  # again: no second wrapper
        opt.step()
        print(len(seen), seen[0] is opt)
        """,
    )
    assert out == "2 True"


def test_an_unwatched_step_reports_nothing(tmp_path: Path) -> None:
    out = run(
        tmp_path,
        """
        from flexium.engine import foreign_steps
        seen, other = [], []
        foreign_steps.watch(seen.append)
        from fastai.optimizer import Optimizer
        opt = Optimizer()
        opt.step()
        foreign_steps.unwatch(other.append)  # not the one watching: changes nothing
        opt.step()
        foreign_steps.unwatch(seen.append)
        opt.step()
        print(len(seen), opt.steps)
        """,
    )
    assert out == "2 3"


def test_a_module_found_by_another_finder_is_patched_too(tmp_path: Path) -> None:
    """An editable install serves its modules through a finder of its own on sys.meta_path."""
    out = run(
        tmp_path,
        f"""
        import importlib.abc, importlib.util, sys
        class Editable(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "fastai.optimizer":
                    return importlib.util.spec_from_file_location(name, {str(tmp_path / "optimizer.py")!r})
                return None
        sys.meta_path.append(Editable())
        from flexium.engine import foreign_steps
        seen = []
        foreign_steps.watch(seen.append)
        from fastai.optimizer import Optimizer
        Optimizer().step()
        print(len(seen))
        """,
        module_in_package=False,
    )
    assert out == "1"
