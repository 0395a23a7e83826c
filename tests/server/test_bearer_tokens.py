"""One reading of ``Authorization: Bearer``: the layers in front of FastAPI (the heartbeat
shortcut, the fair share's job check) take from a raw request's headers the token FastAPI's
routes take, and none where the routes would refuse the header or no token is that long."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from flexium.server.auth import bearer_token, scope_bearer_token
from flexium.server.errors import Unauthorized

LONGEST = "flx_" + "t" * 252


def _scope(*values: bytes) -> dict[str, object]:
    return {"type": "http", "headers": [(b"authorization", value) for value in values]}


def _routes_token(scope: dict[str, object]) -> str | None:
    try:
        return bearer_token(Request(scope))
    except Unauthorized:
        return None


@pytest.mark.parametrize(
    "value",
    [
        b"Bearer flx_abc",
        b"bearer flx_abc",
        b"BEARER   flx_abc  ",
        b"  Bearer flx_abc",
        b"Basic dXNlcjpwYXNz",
        b"Bearer ",
        b"Bearer",
        b"flx_abc",
        b"Bearer " + LONGEST.encode(),
    ],
)
def test_a_raw_request_gives_the_token_the_routes_take(value: bytes) -> None:
    assert scope_bearer_token(_scope(value)) == _routes_token(_scope(value))


def test_a_token_longer_than_any_is_left_to_the_routes() -> None:
    too_long = _scope(b"Bearer " + LONGEST.encode() + b"t")
    assert _routes_token(too_long) == LONGEST + "t"  # which then find no such token
    assert scope_bearer_token(too_long) is None


def test_the_first_authorization_header_counts_as_for_the_routes() -> None:
    scope = _scope(b"Bearer first", b"Bearer second")
    assert scope_bearer_token(scope) == _routes_token(scope) == "first"
    assert scope_bearer_token({"type": "http", "headers": []}) is None
