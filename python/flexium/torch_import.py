"""torch, imported by flexium without torch's NumPy warning.

A torch wheel without NumPy beside it warns on import ("Failed to initialize NumPy: No module
named 'numpy'"), which says nothing about training. Where flexium is what imports torch first
(``flexium.init()`` in a script that had not, ``flexium doctor``, the demo's job), that warning
would be flexium's noise, so it is not shown; a script that imported torch itself has already
seen its own warning, and flexium hides nothing of the script's."""

from __future__ import annotations

import sys
import warnings
from types import ModuleType

_NUMPY_WARNING = "Failed to initialize NumPy"


def import_torch() -> ModuleType | None:
    """torch, or None when it is not installed."""
    if "torch" in sys.modules:
        return sys.modules["torch"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NUMPY_WARNING, category=UserWarning)
        try:
            import torch
        except ImportError:
            return None
    return torch
