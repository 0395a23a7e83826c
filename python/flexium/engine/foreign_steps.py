"""Optimizer steps outside torch.optim that are safe points too.

PyTorch's global optimizer step hook (safe_point.py) sees every torch.optim optimizer, which is
what plain loops, Lightning, the Hugging Face Trainer and Accelerate step. fastai's own optimizers
(`fastai.optimizer.Optimizer`: its Adam, SGD, Lamb...) are not torch.optim ones, so a fastai job
would have no safe point and pause on the driver path. Their `step` gets a wrapper that reports
the end of each step, put in place when the module is imported (or at once if it already is),
so a script changes nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

# (module, class) whose instances' step() ends an optimizer step.
STEPPERS: tuple[tuple[str, str], ...] = (("fastai.optimizer", "Optimizer"),)
_MARK = "_flexium_reports_step"

_lock = threading.Lock()
_on_step: Callable[[Any], None] | None = None
_finder: _PatchOnImport | None = None


def watch(on_step: Callable[[Any], None]) -> None:
    """From now on `on_step(optimizer)` runs after each step of the optimizers in STEPPERS."""
    global _on_step, _finder
    with _lock:
        _on_step = on_step
        if _finder is None:
            _finder = _PatchOnImport({module for module, _cls in STEPPERS})
            sys.meta_path.insert(0, _finder)
    for module, _cls in STEPPERS:
        if module in sys.modules:
            _patch(sys.modules[module])


def unwatch(on_step: Callable[[Any], None]) -> None:
    """`on_step` runs no more (the wrappers stay, doing nothing), unless another replaced it."""
    global _on_step
    with _lock:
        if _on_step == on_step:
            _on_step = None


def _report(optimizer: Any) -> None:
    hook = _on_step
    if hook is not None:
        hook(optimizer)


def _patch(module: ModuleType) -> None:
    for name, cls_name in STEPPERS:
        cls = getattr(module, cls_name, None) if module.__name__ == name else None
        step = getattr(cls, "step", None)
        if cls is not None and step is not None and not getattr(step, _MARK, False):
            cls.step = _reporting(step)


def _reporting(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def reporting_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = step(self, *args, **kwargs)
        _report(self)
        return result

    setattr(reporting_step, _MARK, True)
    return reporting_step


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the watched modules as the other finders would and patches them once loaded."""

    def __init__(self, names: set[str]) -> None:
        self._names = names

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._names:
            return None
        spec = None
        for finder in list(sys.meta_path):  # as the import would, editable installs' finders too
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        load = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            load(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec
