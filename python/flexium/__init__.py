"""flexium: move running PyTorch training between GPUs, or pause it with its GPU memory freed.

import flexium
flexium.init()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The "flexium" logger's handler and level (FLEXIUM_LOG_LEVEL) are set on import, before any
# flexium module logs: the other modules log through it without importing it.
from flexium import _logging  # noqa: F401

__version__ = "0.1.0"
__all__ = ["init", "shutdown", "is_initialized", "auto", "config", "utils", "__version__"]

if TYPE_CHECKING:
    from flexium import auto, config, utils
    from flexium.api.runtime import init, is_initialized, shutdown

# The API is imported when first used (PEP 562), not with the package: the `flexium` command
# imports flexium.cli, and each of its calls would otherwise import the engine first (0.2 s).
_RUNTIME_FUNCTIONS = {"init", "shutdown", "is_initialized"}
_API_MODULES = {"auto", "config", "utils"}


def __getattr__(name: str) -> Any:
    if name in _RUNTIME_FUNCTIONS:
        value = getattr(importlib.import_module("flexium.api.runtime"), name)
    elif name in _API_MODULES:
        value = importlib.import_module(f"flexium.{name}")
    else:
        raise AttributeError(f"module 'flexium' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
