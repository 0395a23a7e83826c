"""How flexium writes amounts of memory in what it says: a GiB is 2^30 bytes, a MiB 2^20."""

from __future__ import annotations

import re

GIB = 1 << 30
MIB = 1 << 20


def gib(n: int, digits: int = 1) -> str:
    return f"{n / GIB:.{digits}f} GiB"


def gib_or_mib(n: int) -> str:
    """Whole MiB below a GiB (a budget of 512 MiB reads so), else GiB."""
    return gib(n) if n >= GIB or n == 0 else f"{n / MIB:.0f} MiB"


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": MIB, "mib": MIB, "g": GIB, "gib": GIB}
_SIZE_UNITS.update({"t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12})


def read_size(text: str) -> int:
    """Bytes of an amount as people write it: ``40GiB``, ``40G`` (both 2^30), ``512MiB``, ``40GB``
    (10^9), a byte count; ValueError otherwise."""
    amount = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text.strip().lower())
    if amount is None or amount.group(2) not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not an amount of memory such as 40GiB or 512MiB")
    return int(float(amount.group(1)) * _SIZE_UNITS[amount.group(2)])
