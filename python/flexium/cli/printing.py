"""What the commands that talk to a server print: the server's objects as JSON for scripts,
aligned tables, durations and ages, and a command's rank and reason in words."""

from __future__ import annotations

import json
from collections.abc import Sequence

from pydantic import BaseModel

from flexium import wire


def print_json(value: BaseModel | Sequence[BaseModel]) -> None:
    data = value.model_dump(mode="json") if isinstance(value, BaseModel) else [v.model_dump(mode="json") for v in value]
    print(json.dumps(data, indent=2, sort_keys=True))


def print_table(rows: Sequence[Sequence[str]], indent: str = "") -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def ms(seconds: float) -> str:
    milliseconds = max(0.0, seconds) * 1e3
    if milliseconds < 10:
        return f"{milliseconds:.1f} ms"
    return f"{milliseconds:.0f} ms" if milliseconds < 10_000 else f"{seconds:.1f} s"


def age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def reason(command: wire.CommandInfo) -> str:
    if command.state == "expired":
        return "the process did not take the command in time (it stopped listening?)"
    return command.error or "no reason given"


def rank(command: wire.CommandInfo) -> str:
    return "?" if command.job is None else str(command.job.rank)
