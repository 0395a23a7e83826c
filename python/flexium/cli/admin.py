"""`flexium server`, `flexium workspace ...` and `flexium token ...`: handed to the server
package, imported only here so that the client install (no server extra) runs every other
command."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Optional, Sequence

SERVER_EXTRA_HINT = 'pip install "flexium[server]"'


def server_module(name: str) -> Optional[ModuleType]:
    """The server package's module, or None (and a message) when the server extra is missing."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing = exc.name or ""
        if missing.split(".")[0] == "flexium":
            raise
        print(f"flexium: the server is not installed (no module {missing!r}): {SERVER_EXTRA_HINT}", file=sys.stderr)
        return None


def run(argv: Sequence[str]) -> int:
    """``argv`` starts with "server", "workspace" or "token"."""
    if argv[0] == "server":
        app = server_module("flexium.server.app")
        return 2 if app is None else int(app.main(list(argv[1:])))
    workspaces = server_module("flexium.server.workspaces")
    return 2 if workspaces is None else int(workspaces.main(list(argv)))
