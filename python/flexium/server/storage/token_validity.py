"""Whether a token opens doors: the one rule, as a query's condition and read on a row. A token
that is revoked or has expired is refused alike; only its listing says which."""

from __future__ import annotations

from sqlalchemy import ColumnElement, and_, or_

from flexium import protocol
from flexium.server.models import Token


def token_alive(now: float) -> ColumnElement[bool]:
    """The tokens that open doors at ``now``: neither revoked nor expired."""
    return and_(Token.revoked_at.is_(None), or_(Token.expires_at.is_(None), Token.expires_at > now))


def token_end(row: Token, now: float) -> protocol.TokenEnd | None:
    """Why a token no longer opens doors at ``now``, or None: it does (``token_alive`` read on a row)."""
    if row.revoked_at is not None:
        return "revoked"
    return "expired" if expired(row.expires_at, now) else None


def expired(expires_at: float | None, now: float) -> bool:
    """A token's life is over at ``now`` (``expires_at`` None: it has no end but its revocation)."""
    return expires_at is not None and expires_at <= now
