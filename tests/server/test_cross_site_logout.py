"""POST /logout ends a dashboard session on the server, so another site may not post it (issue 41
item 7): refused as a cross-site login is, the session kept; this server's own page still logs out."""

from __future__ import annotations

import pytest

from flexium import protocol
from support.server import Api

FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def _logged_in(api: Api) -> None:
    r = api.client.post("/login", content=f"token={api.token}", headers=FORM, follow_redirects=False)
    assert r.status_code == 303


@pytest.mark.parametrize(
    "headers",
    [{"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"}, {"Origin": "http://evil.example"}],
)
def test_a_cross_site_logout_is_refused_and_the_session_stays(api: Api, headers: dict[str, str]) -> None:
    _logged_in(api)
    try:
        r = api.client.post("/logout", headers=headers, follow_redirects=False)
        assert r.status_code == 403 and "logging out must be asked from this server" in r.text
        assert protocol.SESSION_COOKIE not in r.headers.get("set-cookie", "")
        assert api.client.get(api.base + "/processes").status_code == 200  # still logged in
    finally:
        api.client.cookies.clear()


@pytest.mark.parametrize("headers", [{}, {"Sec-Fetch-Site": "same-origin"}, {"Origin": "http://testserver"}])
def test_this_servers_page_logs_out(api: Api, headers: dict[str, str]) -> None:
    _logged_in(api)
    secret = api.client.cookies[protocol.SESSION_COOKIE]
    r = api.client.post("/logout", headers=headers, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login"
    api.client.cookies.set(protocol.SESSION_COOKIE, secret)
    try:
        assert api.client.get(api.base + "/processes").status_code == 401
    finally:
        api.client.cookies.clear()
