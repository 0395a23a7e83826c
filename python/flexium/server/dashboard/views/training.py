"""A job's training curves on its page: loss and steps/s over the kept history
(``storage.progress_history``), ending at the progress stored now, drawn as inline SVG with their
axes and values (the lowest, the highest, the last) so that no script draws them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from flexium import wire
from flexium.server import storage
from flexium.server.dashboard.formatters import fmt_duration, fmt_loss

MAX_POINTS = 240  # drawn at most: about one per pixel of a chart's width
# The SVG's box (viewBox 0 0 WIDTH HEIGHT) and the plot inside it, room left for the labels.
WIDTH, HEIGHT = 320, 120
LEFT, RIGHT, TOP, BOTTOM = 52, 312, 20, 96


@dataclass(frozen=True)
class Curve:
    """One series as an SVG polyline (``points``) with the labels of its axes."""

    name: str  # "loss", "steps/s"
    points: str
    last_x: float
    last_y: float
    lowest: str
    highest: str
    last: str
    span: str  # how far back the time axis goes, "20 min"
    samples: int


@dataclass(frozen=True)
class TrainingCharts:
    loss: Curve | None  # None: fewer than two reports of it
    speed: Curve | None


def training_charts(*, session: Session, workspace_id: int, process: wire.ProcessInfo, now: float) -> TrainingCharts:
    """The curves of ``process`` (a job of several ranks: its rank 0, as its page's figures)."""
    points = storage.progress_history(
        session=session,
        workspace_id=workspace_id,
        process_id=process.process_id,
        since=now - storage.retention_of(session).progress_keep_s,
    )
    if process.steps_at is not None and (not points or process.steps_at > points[-1].at):
        points.append(
            storage.ProgressPoint(
                at=process.steps_at, steps=process.steps, steps_per_s=process.steps_per_s, loss=process.loss
            )
        )
    return TrainingCharts(
        loss=curve("loss", [(p.at, p.loss) for p in points], now=now, label=fmt_loss),
        speed=curve("steps/s", [(p.at, p.steps_per_s) for p in points], now=now, label=_speed),
    )


def curve(
    name: str, series: Sequence[tuple[float, float | None]], *, now: float, label: Callable[[float], str]
) -> Curve | None:
    """``series`` (time, value; None: not reported then) drawn from its first time to now."""
    kept = [(at, value) for at, value in series if value is not None and math.isfinite(value)]
    if len(kept) < 2:
        return None
    lowest, highest = min(v for _, v in kept), max(v for _, v in kept)
    since = kept[0][0]
    span = max(now - since, kept[-1][0] - since, 1.0)
    height = highest - lowest

    def xy(at: float, value: float) -> tuple[float, float]:
        x = LEFT + (RIGHT - LEFT) * (at - since) / span
        y = (TOP + BOTTOM) / 2 if height == 0 else BOTTOM - (BOTTOM - TOP) * (value - lowest) / height
        return x, y

    drawn = [xy(at, value) for at, value in _thinned(kept)]
    return Curve(
        name=name,
        points=" ".join(f"{x:.1f},{y:.1f}" for x, y in drawn),
        last_x=round(drawn[-1][0], 1),
        last_y=round(drawn[-1][1], 1),
        lowest=label(lowest),
        highest=label(highest),
        last=label(kept[-1][1]),
        span=fmt_duration(span, precise=False),
        samples=len(kept),
    )


def _thinned(kept: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Every n-th point, the last one always, so that a day of samples draws as fast as a minute."""
    if len(kept) <= MAX_POINTS:
        return kept
    stride = math.ceil(len(kept) / MAX_POINTS)
    thinned = kept[::stride]
    return thinned if thinned[-1] == kept[-1] else [*thinned, kept[-1]]


def _speed(per_s: float) -> str:
    return f"{per_s:.2f}" if per_s < 10 else f"{per_s:.0f}"
