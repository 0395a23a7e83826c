"""The one way the benchmarks print a table (right-aligned columns under a ruled header) and the
quantiles they print."""

from __future__ import annotations

from collections.abc import Sequence


def print_table(columns: Sequence[str], rows: Sequence[Sequence[str]], separator: str = "  ") -> None:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    line = separator.join(c.rjust(w) for c, w in zip(columns, widths, strict=True))
    print(line)
    print("-" * len(line))
    for r in rows:
        print(separator.join(v.rjust(w) for v, w in zip(r, widths, strict=False)))


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` as the nearest rank below; nan when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
