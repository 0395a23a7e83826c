"""The server extra's modules, for the commands that need them (`flexium server`, `workspace`,
`token`, `demo`). They are imported only when such a command runs, so that the client install
(no server extra) runs every other command, and these say how to install what is missing."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

SERVER_EXTRA_HINT = (
    'install its extra: pip install ".[server]" in a flexium checkout, or pip install "FLEXIUM_WHEEL[server]"'
)


def server_module(name: str) -> ModuleType | None:
    """The server package's module, or None (and a message) when the server extra is missing."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing = exc.name or ""
        if missing.split(".")[0] == "flexium":
            raise
        print(f"flexium: the server is not installed (no module {missing!r}): {SERVER_EXTRA_HINT}", file=sys.stderr)
        return None
