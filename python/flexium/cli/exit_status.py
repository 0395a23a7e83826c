"""How a `flexium` command ends: its exit status, and a failure said on stderr (and as JSON
under ``--json``).

Exit status: 0 done; 1 refused or failed (the reason on stderr); 2 bad usage or settings;
3 the server could not be reached; 130 interrupted (Ctrl-C), as a shell says of SIGINT.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

Body = TypeVar("Body", bound=BaseModel)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130


class UsageError(ValueError):
    """A command line that parsed but asks for something that cannot be (exit status 2)."""


def request_body(model: type[Body], **fields: Any) -> Body:
    """A request's body from the command line; a --reason the server would refuse is a usage
    error, said in its terms."""
    try:
        return model(**fields)
    except ValidationError as exc:
        for error in exc.errors():
            if error["loc"][:1] == ("reason",):
                raise UsageError(f"--reason: {error['msg'].removeprefix('Value error, ')}") from None
        raise


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
