"""How flexium writes amounts of memory in what it says: a GiB is 2^30 bytes, a MiB 2^20."""

from __future__ import annotations

GIB = 1 << 30
MIB = 1 << 20


def gib(n: int, digits: int = 1) -> str:
    return f"{n / GIB:.{digits}f} GiB"


def gib_or_mib(n: int) -> str:
    """Whole MiB below a GiB (a budget of 512 MiB reads so), else GiB."""
    return gib(n) if n >= GIB or n == 0 else f"{n / MIB:.0f} MiB"
