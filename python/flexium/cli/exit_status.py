"""How a `flexium` command ends: its exit status, and a failure said on stderr (and as JSON
under ``--json``).

Exit status: 0 done; 1 refused or failed (the reason on stderr); 2 bad usage or settings;
3 the server could not be reached.
"""

from __future__ import annotations

import json
import sys

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


class UsageError(ValueError):
    """A command line that parsed but asks for something that cannot be (exit status 2)."""


def fail(message: str, status: int, *, as_json: bool = False, code: str = "failed", short: str | None = None) -> int:
    """The reason on stderr (``short`` where given: the one reason that matters, ``message``
    being all of them); under --json also a JSON object on stdout with the whole message, so
    that a script reading stdout sees why nothing else came."""
    if as_json:
        answer = {"error": code, "message": message, "exit_status": status}
        if short is not None:
            answer["short"] = short
        print(json.dumps(answer, indent=2, sort_keys=True))
    print(f"flexium: {short or message}", file=sys.stderr)
    return status
