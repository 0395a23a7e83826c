"""How flexium writes amounts of memory and time in what it says, and reads them as people
write them: a GiB is 2^30 bytes, a MiB 2^20; a day 86,400 s; times in UTC."""

from __future__ import annotations

import re
import time

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


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def read_duration(text: str) -> float:
    """Seconds of a duration as people write it: ``90d``, ``12h``, ``30m`` (minutes), ``2w``, ``45s``
    or a number of seconds; ValueError otherwise."""
    amount = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text.strip().lower())
    if amount is None or amount.group(2) not in _DURATION_UNITS:
        raise ValueError(f"{text!r} is not a duration such as 90d, 12h, 30m or 45s")
    return float(amount.group(1)) * _DURATION_UNITS[amount.group(2)]


def utc_time(ts: float) -> str:
    """A moment to the minute, the same for every reader whatever their time zone."""
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(ts))
