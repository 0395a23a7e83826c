"""How the dashboard writes values: pure functions, the templates' filters and globals
(``templating.py``). static/common.js formats ticking times the same way."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

from flexium import wire


def fmt_bytes(n: int | None) -> str:
    if not n:
        return "0 B"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit in ("B", "KiB") or value >= 100 else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def fmt_duration(seconds: float | None, precise: bool = True) -> str:
    """``precise``: hundredths under 10 s (how long an operation took); else whole seconds
    (how long a job has run)."""
    if seconds is None or not math.isfinite(seconds):
        return "—"
    s = max(0.0, seconds)
    if s < 10 and precise:
        return f"{s:.2f} s"
    if s < 60:
        return f"{int(s)} s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m} min {sec} s" if sec else f"{m} min"
    h, m = divmod(m, 60)
    if h < 24:
        return f"{h} h {m} min" if m else f"{h} h"
    d, h = divmod(h, 24)
    return f"{d} d {h} h" if h else f"{d} d"


def fmt_ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "—"
    age = max(0.0, now - ts)
    if age < 2:
        return "just now"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if age >= size:
            return f"{int(age // size)} {unit} ago"
    return f"{int(age)} s ago"


def fmt_utc(ts: float) -> str:
    """An audit entry's time, exact and the same for every reader whatever their time zone."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def fmt_rate(per_s: float | None) -> str:
    if per_s is None:
        return "—"
    return f"{per_s:.2f} steps/s" if per_s < 10 else f"{per_s:.0f} steps/s"


DOOR_NAMES = {"cli": "the CLI", "dashboard": "the dashboard", "policy": "a policy of the server", "api": "the API"}


def fmt_door(door: str) -> str:
    """How a command came in (``protocol.DOORS``), as the timeline says it after "via"."""
    return DOOR_NAMES.get(door, door)


def fmt_loss(loss: float | None) -> str:
    return "—" if loss is None else f"{loss:.4g}"


def job_name(process: wire.ProcessInfo) -> str:
    """What the dashboard calls a process: its name (``wire.job_name``), else its id."""
    return process.name or process.process_id


# Where a long name may wrap: after _ - / and where a capital follows a small letter (camelCase).
# Browsers break only at spaces and after a hyphen, so overflow-wrap would split inside a word.
_WORD_BOUNDARY = re.compile(r"(?<=[_/-])(?=.)|(?<=[a-z])(?=[A-Z])")
_WRAP_HERE = Markup("<wbr>")


def word_breaks(text: str) -> Markup:
    """``text`` escaped, with a line-break opportunity (``<wbr>``, which adds no character to
    what is read or copied) between its words."""
    return _WRAP_HERE.join(escape(part) for part in _WORD_BOUNDARY.split(text))


def gpu_label(index: int | None, uuid: str | None) -> str:
    if index is not None:
        return f"GPU {index}"
    return f"GPU {uuid[:12]}" if uuid else "no GPU"


@dataclass(frozen=True)
class MemoryBar:
    """Widths (of 1000) of the flexium / other / free parts of a GPU's memory bar."""

    flexium: int
    other: int
    free: int


def membar(device: wire.DeviceInfo) -> MemoryBar:
    total = max(device.memory_total, 1)
    ours = min(device.memory_flexium, total)
    other = min(device.memory_other, total - ours)
    f = round(1000 * ours / total)
    o = round(1000 * other / total)
    if ours and not f:
        f = 1  # a job's sliver stays visible
    return MemoryBar(flexium=f, other=o, free=max(0, 1000 - f - o))


def sparkline(values: Sequence[float | None], times: Sequence[float], *, since: float, until: float) -> str:
    """SVG polyline points of ``values`` (0..1, None: a gap skipped) over [since, until], in a
    240 x 40 box (the charts' viewBox)."""
    span = max(until - since, 1.0)
    points = []
    for value, at in zip(values, times, strict=True):
        if value is None:
            continue
        x = 240 * (at - since) / span
        y = 40 - 40 * min(max(value, 0.0), 1.0)
        points.append(f"{x:.1f},{y:.1f}")
    return " ".join(points)
