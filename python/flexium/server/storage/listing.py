"""The lists of the rows beside the queue (placements, drains) as the API and the dashboard read
them: a workspace's, of one host or every host; the live ones in their own order, or every one,
newest first."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from flexium.server.models import Drain, Placement

Row = TypeVar("Row", Drain, Placement)


def listed(
    model: type[Row],
    *,
    session: Session,
    workspace_id: int,
    host: str | None,
    live: bool,
    limit: int,
    live_where: ColumnElement[bool],
    live_order: Sequence[ColumnElement[Any]],
    where: Sequence[ColumnElement[bool]] = (),
) -> list[Row]:
    """``live_where`` and ``live_order``: what makes a row live and the order live rows are listed
    in; ``where``: what else the caller may see."""
    query = select(model).where(model.workspace_id == workspace_id, *where)
    if host is not None:
        query = query.where(model.host == host)
    query = query.where(live_where).order_by(*live_order) if live else query.order_by(model.id.desc())
    return list(session.scalars(query.limit(limit)))
