"""What the commands that talk to a server print: the server's objects as JSON for scripts,
aligned tables, durations and ages, and a command's rank and reason in words."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pydantic import BaseModel

from flexium import wire


def print_json(value: BaseModel | Sequence[BaseModel]) -> None:
    data = value.model_dump(mode="json") if isinstance(value, BaseModel) else [v.model_dump(mode="json") for v in value]
    print(json.dumps(data, indent=2, sort_keys=True))


def print_table(rows: Sequence[Sequence[str]], indent: str = "") -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


@dataclass(frozen=True)
class Column:
    """A column of a table that fits a terminal (``fit_columns``). Where whole lines do not fit,
    ``optional`` columns that say nothing (every cell "-") go first, then those of the lowest
    ``keep``; a column with a ``shrink_to`` is clipped to it rather than go, and widened again as
    far as the room left allows, the highest ``keep`` first."""

    header: str
    cells: Sequence[str]
    keep: int
    shrink_to: int | None = None
    optional: bool = False

    @property
    def width(self) -> int:
        return max([len(self.header), *(len(cell) for cell in self.cells)])

    @property
    def narrowest(self) -> int:
        return self.width if self.shrink_to is None else min(self.width, max(self.shrink_to, len(self.header)))

    def clipped(self, width: int) -> Column:
        return self if width >= self.width else replace(self, cells=[clip(cell, width) for cell in self.cells])


GAP = 2  # blanks between columns (print_table's)


def fit_columns(columns: Sequence[Column], width: int | None) -> list[Column]:
    """The columns that fit in ``width`` characters (None: all, unclipped), in their order."""
    fitted = list(columns)
    if width is None:
        return fitted
    if _line_width([c.width for c in fitted]) > width:
        fitted = [c for c in fitted if not (c.optional and all(cell == "-" for cell in c.cells))]
    while _line_width([c.narrowest for c in fitted]) > width and len(fitted) > 1:
        fitted.remove(min(fitted, key=lambda c: c.keep))
    widths = [c.narrowest for c in fitted]
    room = width - _line_width(widths)
    for i in sorted(range(len(fitted)), key=lambda i: -fitted[i].keep):
        grown = min(fitted[i].width, widths[i] + room)
        room -= grown - widths[i]
        widths[i] = grown
    return [column.clipped(w) for column, w in zip(fitted, widths, strict=True)]


def _line_width(widths: Sequence[int]) -> int:
    return sum(widths) + GAP * (len(widths) - 1)


def print_columns(columns: Sequence[Column]) -> None:
    rows = [[c.header for c in columns]]
    rows += [list(row) for row in zip(*(c.cells for c in columns), strict=True)]
    print_table(rows)


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def count(n: int, noun: str) -> str:
    """ "1 rank", "2 ranks": a number and its noun, singular for one."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


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
