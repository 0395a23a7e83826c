"""The tokens page: every token of the workspace, newest first, in the state it is in now (never
a secret: only hashes are stored), who minted each; for an admin, what the issue form offers; and
what revoking one does (the revoke dialog): the tokens it minted go with it, and the processes
they registered are no longer heard."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from flexium import protocol, wire
from flexium.server import storage
from flexium.server.auth import role_refusal
from flexium.server.storage import AuthInfo

# The units of a life the issue form offers, and their seconds: its script sends the product.
LIFE_UNITS = (("minutes", 60), ("hours", 3600), ("days", 86400), ("weeks", 7 * 86400))


@dataclass(frozen=True)
class TokenRow:
    token: wire.TokenInfo
    minter: wire.TokenInfo | None  # the token that minted it; None: the command line on the database

    @property
    def state(self) -> protocol.TokenState:
        return self.token.state


@dataclass(frozen=True)
class TokenTable:
    """fragments/tokens.html. ``own_token_id``: the token this session logged in with;
    ``manage_refused``: why this session may not issue or revoke ("" for an admin)."""

    now: float
    rows: tuple[TokenRow, ...]
    own_token_id: int
    manage_refused: str


@dataclass(frozen=True)
class IssueForm:
    """The issue form's choices (tokens.html, for an admin). ``own_expires_at``: when this
    session's token expires, the latest end of a token it issues."""

    own_expires_at: float | None
    name_max: int
    roles: tuple[tuple[str, str], ...]  # (role, what it may do), in the form's order
    default_role: str
    life_units: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class RevokeForm:
    """fragments/revoke_token.html: what revoking ``token`` does. ``minted``: the active tokens
    it minted, directly or not, revoked with it; ``processes``: those that it and they registered,
    which train on unheard; ``ends_this_session``: this session's token (``own_token_id``) is
    among them."""

    token: wire.TokenInfo
    minted: tuple[wire.TokenInfo, ...]
    processes: tuple[wire.ProcessInfo, ...]
    ends_this_session: bool
    own_token_id: int


def token_table(*, session: Session, actor: AuthInfo, now: float) -> TokenTable:
    tokens = storage.list_tokens(session=session, workspace_id=actor.workspace_id, now=now)
    return TokenTable(now=now, rows=_rows(tokens), own_token_id=actor.token_id, manage_refused=_manage_refused(actor))


def issue_form(actor: AuthInfo) -> IssueForm:
    return IssueForm(
        own_expires_at=actor.expires_at,
        name_max=protocol.MAX_SHORT_TEXT,
        roles=tuple(protocol.ROLE_PURPOSES.items()),
        default_role=protocol.DEFAULT_ISSUED_ROLE,
        life_units=LIFE_UNITS,
    )


def revoke_form(
    *, session: Session, actor: AuthInfo, token_id: int, now: float, stale_after: float
) -> RevokeForm | None:
    """None where the token is not an active token of the workspace (revoked or expired meanwhile)."""
    tokens = storage.list_tokens(session=session, workspace_id=actor.workspace_id, now=now)
    token = next((t for t in tokens if t.id == token_id), None)
    if token is None or token.state != "active":
        return None
    cascade = {t.id for t in storage.minted_from(session=session, workspace_id=actor.workspace_id, token_id=token.id)}
    minted = [t for t in tokens if t.id in cascade]
    ids = {token.id, *cascade}
    processes = storage.list_processes(
        session=session, workspace_id=actor.workspace_id, now=now, stale_after=stale_after, token_ids=ids
    )
    return RevokeForm(
        token=token,
        minted=tuple(t for t in minted if t.state == "active"),
        processes=tuple(processes),
        ends_this_session=actor.token_id in ids,
        own_token_id=actor.token_id,
    )


def _rows(tokens: Sequence[wire.TokenInfo]) -> tuple[TokenRow, ...]:
    by_id = {t.id: t for t in tokens}
    newest_first = sorted(tokens, key=lambda t: t.id, reverse=True)
    return tuple(
        TokenRow(token=t, minter=by_id.get(t.minted_by) if t.minted_by is not None else None) for t in newest_first
    )


def _manage_refused(actor: AuthInfo) -> str:
    if actor.role == protocol.ROLE_ADMIN:
        return ""
    return role_refusal(actor, (protocol.ROLE_ADMIN,), "issuing or revoking a token")
