"""Who is looking: the one check of the dashboard's session cookie (a page takes
``auth: PageAuth``, a fragment ``auth: FragmentAuth``), what every page shows of the person
logged in (``Viewer``), and how they connect a shell to this server (``ConnectLine``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import RedirectResponse, Response

from flexium import protocol
from flexium.server.auth import resolve_session, role_refusal
from flexium.server.context import Ctx
from flexium.server.dashboard.templating import HEADERS
from flexium.server.storage import AuthInfo


class SignedOut(Exception):
    """No valid login cookie: the app answers with ``response`` (``dashboard.install_dashboard``)."""

    def __init__(self, response: Response) -> None:
        super().__init__("signed out")
        self.response = response


def _signed_in(*, redirect: bool) -> Callable[[Request, Ctx], Awaitable[AuthInfo]]:
    """The page sends a person without a live session to the login form; fragments answer 401
    instead, and the script sends the person there."""

    async def page_auth(request: Request, ctx: Ctx) -> AuthInfo:
        secret = request.cookies.get(protocol.SESSION_COOKIE)
        auth = await resolve_session(ctx, secret) if secret else None
        if auth is None:
            raise SignedOut(
                RedirectResponse("/login", status_code=303)
                if redirect
                else Response("log in again", status_code=401, media_type="text/plain", headers=HEADERS)
            )
        return auth

    return page_auth


PageAuth = Annotated[AuthInfo, Depends(_signed_in(redirect=True))]
FragmentAuth = Annotated[AuthInfo, Depends(_signed_in(redirect=False))]


@dataclass(frozen=True)
class Viewer:
    """What every page shows of who is logged in. ``actions_refused``: why the buttons that
    change something are disabled ("" when they are not); ``api_base``: where the page's script
    sends commands."""

    workspace: str
    role: str
    actions_refused: str
    api_base: str

    @classmethod
    def of(cls, auth: AuthInfo) -> Viewer:
        refused = (
            ""
            if auth.role == protocol.ROLE_ADMIN
            else role_refusal(auth, (protocol.ROLE_ADMIN,), "moving, pausing, resuming or forgetting a job")
        )
        return cls(
            workspace=auth.workspace,
            role=auth.role,
            actions_refused=refused,
            api_base=protocol.workspace_path(auth.workspace),
        )


@dataclass(frozen=True)
class ConnectLine:
    """What a page shows to connect a training job or the command line to this workspace:
    ``{server_env}={server_address} {token_env}=...``, the server as this browser reaches it."""

    server_address: str
    token_env: str
    server_env: str

    @classmethod
    def of(cls, request: Request, auth: AuthInfo) -> ConnectLine:
        host = request.url.hostname or "localhost"
        port = request.url.port or (443 if request.url.scheme == "https" else 80)
        return cls(
            server_address=f"{host}:{port}/{auth.workspace}",
            token_env=protocol.TOKEN_ENV,
            server_env=protocol.SERVER_ENV,
        )
