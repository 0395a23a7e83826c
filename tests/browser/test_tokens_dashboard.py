"""The tokens page (/tokens) in headless Chromium against a real server process, on SQLite and on
PostgreSQL, over real HTTP: an admin sees every token of the workspace in its state (active,
revoked, expired), who minted it and when it ends, and never a secret; issues one through the form,
whose secret is shown once and then works against the API; revokes one through its button, after a
confirmation that names what goes with it, and the API then refuses it and what it minted; a life
longer than the admin's own token's is refused in the server's words. A viewer sees the list but no
form and no button. Token names are hostile text (tests/support/hostile_text.py), shown as sent."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.common.by import By
from selenium.webdriver.support.select import Select

from flexium.server.dashboard.formatters import fmt_utc
from support.dashboard import LiveServer
from support.dashboard_page import Dashboard
from support.hostile_text import ACCEPTED
from support.live_server import wait_until
from support.replicas import postgres_database
from support.server import process_body

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def tokens_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server of this module's own, on a fresh database of each kind: its tokens are the tests'."""
    with contextlib.ExitStack() as stack:
        database = stack.enter_context(postgres_database()) if request.param == "postgresql" else None
        started = LiveServer(tmp_path_factory.mktemp(f"tokens-{request.param}"), database=database).start()
        stack.callback(started.stop)
        yield started


# --- the API, as a script or a job holding a token reaches it ---------------------------------------


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def mint(server: LiveServer, by: str | None = None, **body: Any) -> dict[str, Any]:
    """A token issued through the API by ``by``, else by the server's first admin token."""
    assert server.token
    r = requests.post(f"{server.url}/api/w/default/tokens", json=body, headers=bearer(by or server.token), timeout=10)
    assert r.status_code == 201, r.text
    return dict(r.json())


def listed(server: LiveServer) -> dict[int, dict[str, Any]]:
    assert server.token
    r = requests.get(f"{server.url}/api/w/default/tokens", headers=bearer(server.token), timeout=10)
    assert r.status_code == 200, r.text
    return {t["id"]: t for t in r.json()}


def status_with(server: LiveServer, token: str) -> int:
    """What the API answers a read of the workspace made with ``token``."""
    return requests.get(f"{server.url}/api/w/default", headers=bearer(token), timeout=10).status_code


# --- the page ---------------------------------------------------------------------------------------


def open_tokens(browser: Any, server: LiveServer, token: str) -> Dashboard:
    """Logged in with ``token`` (the session of any earlier test ended), then to the tokens page
    through the header's link."""
    browser.delete_all_cookies()
    page = Dashboard(browser, server)
    page.log_in(token)
    browser.find_element(By.ID, "tokens-link").click()
    page.wait(lambda: browser.current_url == server.url + "/tokens", "the tokens page opens")
    page.wait(lambda: browser.find_element(By.ID, "tokens-table"), "the table")
    return page


def cells(page: Dashboard, token_id: int) -> dict[str, str]:
    """The text of each cell of a token's row, by its column; {} where it has no row."""
    return dict(
        page.js(
            "var row = document.getElementById('token-' + arguments[0]); var out = {};"
            "if (row) { row.querySelectorAll('td[data-label]').forEach(function (c) {"
            "  out[c.dataset.label] = c.textContent.replace(/\\s+/g, ' ').trim(); }); }"
            "return out;",
            token_id,
        )
    )


def shown_ids(page: Dashboard) -> list[int]:
    """The ids of the table's rows, top to bottom."""
    rows = page.d.find_elements(By.CSS_SELECTOR, "#tokens tbody tr")
    return [int(row.get_attribute("data-token-id")) for row in rows]


def state_of(page: Dashboard, token_id: int) -> str | None:
    return page.js(
        "var row = document.getElementById('token-' + arguments[0]); return row ? row.dataset.state : null;", token_id
    )


def exact_text(page: Dashboard, selector: str) -> str | None:
    """An element's text as the browser holds it, not normalised: a name as it was sent."""
    return page.js("var el = document.querySelector(arguments[0]); return el ? el.textContent : null;", selector)


def revoke_buttons(page: Dashboard) -> set[int]:
    return {
        int(b.get_attribute("data-token-id"))
        for b in page.d.find_elements(By.CSS_SELECTOR, '#tokens button[data-action="revoke-token"]')
    }


def assert_no_markup_injected(page: Dashboard) -> None:
    assert page.js("return document.querySelectorAll('main img, main iframe, main object, main embed').length") == 0
    assert page.js("return document.querySelectorAll('[onerror], [onmouseover]').length") == 0
    with pytest.raises(NoAlertPresentException):
        _ = page.d.switch_to.alert.text


def issue_through_the_form(page: Dashboard, name: str, role: str, life: tuple[str, str] | None) -> None:
    """Fills the issue form as a person does (``life``: a count and a unit, None: never) and sends it."""
    form = page.d.find_element(By.ID, "issue-form")
    field = form.find_element(By.ID, "issue-name")
    field.clear()
    field.send_keys(name)
    Select(form.find_element(By.ID, "issue-role")).select_by_value(role)
    if life is None:
        form.find_element(By.CSS_SELECTOR, 'input[name=life][value="never"]').click()
    else:
        count = form.find_element(By.ID, "issue-life-count")
        count.clear()
        count.send_keys(life[0])  # a count typed chooses "expires after"
        Select(form.find_element(By.ID, "issue-life-unit")).select_by_visible_text(life[1])
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()


# --- the tests --------------------------------------------------------------------------------------


def test_an_admin_sees_every_token_in_its_state_and_never_a_secret(browser: Any, tokens_server: LiveServer) -> None:
    assert tokens_server.token
    named = {value: mint(tokens_server, name=value, role="viewer") for value in ACCEPTED.values()}
    gone = mint(tokens_server, name="old laptop", role="viewer")
    revoked = requests.delete(
        f"{tokens_server.url}/api/w/default/tokens/{gone['id']}", headers=bearer(tokens_server.token), timeout=10
    )
    assert revoked.status_code == 200, revoked.text
    deputy = mint(tokens_server, name="deputy", role="admin", expires_in_s=3600)
    job = mint(tokens_server, deputy["token"], name="deputy's job", role="job")
    visitor = mint(tokens_server, name="visitor", role="viewer", expires_in_s=1)
    wait_until(lambda: listed(tokens_server)[visitor["id"]]["expired"], 10, "the visitor's token to expire")
    wait_until(lambda: listed(tokens_server)[deputy["id"]]["last_used_at"], 10, "the deputy's use (a mint) written")

    page = open_tokens(browser, tokens_server, tokens_server.token)
    everyone = listed(tokens_server)
    assert shown_ids(page) == sorted(everyone, reverse=True)  # every token, newest first

    first = cells(page, 1)
    assert first["Token"].startswith("1 flx_") and "this session" in first["Token"]
    assert first["Role"] == "admin" and first["Minted by"] == "the command line" and first["Expires"] == "never"
    assert first["State"] == "active"

    assert state_of(page, gone["id"]) == "revoked"
    assert re.fullmatch(r"revoked (just now|\d+ s ago)", cells(page, gone["id"])["State"])
    assert state_of(page, visitor["id"]) == "expired"
    assert cells(page, visitor["id"])["State"] == "expired"
    assert re.fullmatch(r"just now|\d+ s ago", cells(page, visitor["id"])["Expires"])
    assert state_of(page, deputy["id"]) == "active"
    assert re.fullmatch(r"in (59 min \d+ s|1 h)", cells(page, deputy["id"])["Expires"])
    expires_title = page.js(
        "return document.querySelector('#token-' + arguments[0] + ' .token-expires span').title", deputy["id"]
    )
    assert expires_title == fmt_utc(deputy["expires_at"])  # the exact time, as the audit log shows times
    created_title = page.js(
        "return document.querySelector('#token-' + arguments[0] + ' td[data-label=Created] span').title", job["id"]
    )
    assert created_title == fmt_utc(job["created_at"])
    assert cells(page, job["id"])["Minted by"] == f"token {deputy['id']} · deputy"
    assert cells(page, job["id"])["Role"] == "job"
    assert cells(page, job["id"])["Last used"] == "never"
    assert re.fullmatch(r"just now|\d+ s ago", cells(page, deputy["id"])["Last used"])
    used_title = page.js(
        "return document.querySelector('#token-' + arguments[0] + ' .token-used span').title", deputy["id"]
    )
    assert used_title.startswith(fmt_utc(everyone[deputy["id"]]["last_used_at"]))
    assert cells(page, deputy["id"])["Minted by"].startswith("token 1 · ")

    active = sum(1 for t in everyone.values() if not t["revoked"] and not t["expired"])
    assert page.d.find_element(By.ID, "token-counts").text == f"{active} active · 1 revoked · 1 expired"
    assert revoke_buttons(page) == {t["id"] for t in everyone.values() if not t["revoked"] and not t["expired"]}

    for value, token in named.items():
        assert exact_text(page, f"#token-{token['id']} td[data-label=Name] .token-name") == value, value
    assert_no_markup_injected(page)
    html = page.d.page_source
    for secret in (tokens_server.token, gone["token"], deputy["token"], job["token"], visitor["token"]):
        assert secret not in html
    assert not any(token["token"] in html for token in named.values())
    page.assert_console_clean()


def test_an_admin_issues_a_token_whose_secret_is_shown_once_and_works(browser: Any, tokens_server: LiveServer) -> None:
    assert tokens_server.token
    page = open_tokens(browser, tokens_server, tokens_server.token)
    page.js("window.samePage = true")
    before = set(listed(tokens_server))
    name = ACCEPTED["html"]

    issue_through_the_form(page, name, "viewer", ("2", "hours"))
    page.wait(lambda: page.d.find_element(By.ID, "issued").is_displayed(), "the new token is shown")
    [new_id] = set(listed(tokens_server)) - before
    new = listed(tokens_server)[new_id]
    assert new["name"] == name and new["role"] == "viewer" and new["minted_by"] == 1
    assert new["expires_at"] - new["created_at"] == pytest.approx(7200, abs=1)

    secret = page.d.find_element(By.ID, "issued-secret").text
    assert secret.startswith("flx_")
    assert status_with(tokens_server, secret) == 200  # the secret shown is the token: the API takes it
    port = tokens_server.url.rsplit(":", 1)[1]
    assert page.d.find_element(By.ID, "issued-env").text == (
        f"export FLEXIUM_SERVER=127.0.0.1:{port}/default\nexport FLEXIUM_TOKEN={secret}"
    )
    summary = exact_text(page, '#issued [data-issued="summary"]')
    assert summary == f"{name}: viewer token, expires {fmt_utc(new['expires_at'])}"
    assert exact_text(page, '#issued [data-issued="id"]') == str(new_id)

    # The table has the new token without a reload; the form is ready for the next.
    page.wait(lambda: state_of(page, new_id) == "active", "the new token's row")
    assert re.fullmatch(r"in (1 h 59 min|2 h)", cells(page, new_id)["Expires"])
    assert exact_text(page, f"#token-{new_id} td[data-label=Name] .token-name") == name
    assert page.js("return window.samePage") is True
    assert page.d.find_element(By.ID, "issue-name").get_attribute("value") == ""
    assert_no_markup_injected(page)

    html = page.d.page_source
    assert secret in html and tokens_server.token not in html  # the one just issued, and no other

    page.d.execute_cdp_cmd(
        "Browser.grantPermissions",
        {"origin": tokens_server.url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]},
    )
    copy = page.d.find_element(By.CSS_SELECTOR, 'button[data-copy="issued-secret"]')
    copy.click()
    page.wait(lambda: copy.text == "Copied", "the copy button says it copied")
    copied = page.d.execute_async_script(
        "var done = arguments[0]; navigator.clipboard.readText().then(done, function (e) { done('refused: ' + e); });"
    )
    assert copied == secret

    page.d.find_element(By.ID, "issued-done").click()
    page.wait(lambda: not page.d.find_element(By.ID, "issued").is_displayed(), "the secret is put away")
    assert secret not in page.d.page_source
    page.d.refresh()
    page.wait(lambda: state_of(page, new_id) == "active", "the page again")
    assert secret not in page.d.page_source  # shown once: never again
    page.assert_console_clean()


def test_an_admin_revokes_a_token_and_what_it_minted(browser: Any, tokens_server: LiveServer) -> None:
    assert tokens_server.token
    doomed = mint(tokens_server, name=ACCEPTED["attribute"], role="admin")
    child = mint(tokens_server, doomed["token"], name="cluster-b", role="job")
    bystander = mint(tokens_server, name="bystander", role="viewer")
    registered = requests.post(
        f"{tokens_server.url}/api/w/default/processes",
        json=process_body("gpu-tokens-revoke", host="node-revoke"),
        headers=bearer(child["token"]),
        timeout=10,
    )
    assert registered.status_code == 201, registered.text

    page = open_tokens(browser, tokens_server, tokens_server.token)
    page.js("window.samePage = true")
    page.d.find_element(By.CSS_SELECTOR, f'#token-{doomed["id"]} button[data-action="revoke-token"]').click()
    page.wait(lambda: page.js("return document.getElementById('revoke-dialog').open"), "the confirmation opens")
    said = page.d.find_element(By.ID, "revoke-consequences").text
    assert "also revokes every token it minted" in said
    assert "ends the dashboard sessions, event streams and waiting polls" in said
    assert exact_text(page, "#revoke-dialog-title .token-name") == ACCEPTED["attribute"]
    minted = page.d.find_elements(By.CSS_SELECTOR, "#revoke-minted li")
    assert [int(li.get_attribute("data-token-id")) for li in minted] == [child["id"]]
    unheard = page.d.find_elements(By.CSS_SELECTOR, "#revoke-processes li")
    assert [li.get_attribute("data-process-id") for li in unheard] == ["gpu-tokens-revoke"]
    assert not page.d.find_elements(By.ID, "revoke-ends-session")
    assert page.js("return document.activeElement.hasAttribute('data-close')")  # Enter cancels, not revokes
    assert_no_markup_injected(page)

    page.d.find_element(By.CSS_SELECTOR, "#revoke-dialog button[type=submit]").click()
    page.wait(lambda: not page.js("return document.getElementById('revoke-dialog').open"), "the dialog closes")
    page.wait(lambda: state_of(page, doomed["id"]) == "revoked", "the token's row says revoked")
    assert state_of(page, child["id"]) == "revoked" and state_of(page, bystander["id"]) == "active"
    assert doomed["id"] not in revoke_buttons(page) and bystander["id"] in revoke_buttons(page)
    assert page.js("return window.samePage") is True
    notice = [text for _role, text in page.notices() if f"revoked token {doomed['id']}" in text]
    assert notice and f"the tokens it minted: {child['id']}" in notice[0] and "gpu-tokens-revoke" in notice[0]

    assert status_with(tokens_server, doomed["token"]) == 401
    assert status_with(tokens_server, child["token"]) == 401
    assert status_with(tokens_server, bystander["token"]) == 200
    page.assert_console_clean()


def test_revoking_the_sessions_own_token_ends_the_session(browser: Any, tokens_server: LiveServer) -> None:
    assert tokens_server.token
    mine = mint(tokens_server, name="leaving admin", role="admin")
    page = open_tokens(browser, tokens_server, mine["token"])
    page.d.find_element(By.CSS_SELECTOR, f'#token-{mine["id"]} button[data-action="revoke-token"]').click()
    page.wait(lambda: page.d.find_element(By.ID, "revoke-ends-session").is_displayed(), "the warning")
    assert "it ends too" in page.d.find_element(By.ID, "revoke-ends-session").text
    page.d.find_element(By.CSS_SELECTOR, "#revoke-dialog button[type=submit]").click()
    page.wait(lambda: page.d.current_url == tokens_server.url + "/login", "sent to the login page")
    assert status_with(tokens_server, mine["token"]) == 401


def test_a_life_longer_than_the_admins_own_is_refused(browser: Any, tokens_server: LiveServer) -> None:
    assert tokens_server.token
    on_call = mint(tokens_server, name="on call", role="admin", expires_in_s=600)
    page = open_tokens(browser, tokens_server, on_call["token"])
    assert fmt_utc(on_call["expires_at"]) in page.d.find_element(By.ID, "issue-bound").text
    before = set(listed(tokens_server))

    issue_through_the_form(page, "for a week", "job", ("1", "days"))
    error = page.d.find_element(By.CSS_SELECTOR, "#issue-form .form-error")
    page.wait(error.is_displayed, "the refusal shows")
    assert "cannot outlive the token that minted it" in error.text
    assert "ask for expires_in_s of at most" in error.text
    assert set(listed(tokens_server)) == before
    assert not page.d.find_element(By.ID, "issued").is_displayed()

    issue_through_the_form(page, "until the shift ends", "job", None)
    page.wait(lambda: page.d.find_element(By.ID, "issued").is_displayed(), "the new token is shown")
    assert not error.is_displayed()
    [new_id] = set(listed(tokens_server)) - before
    # "never" from a token that expires: the new one ends with it
    assert listed(tokens_server)[new_id]["expires_at"] == pytest.approx(on_call["expires_at"])
    page.assert_console_clean()


def test_a_viewer_sees_the_tokens_but_no_form_and_no_revoke_button(browser: Any, tokens_server: LiveServer) -> None:
    assert tokens_server.token
    viewer = mint(tokens_server, name="wall screen", role="viewer")
    page = open_tokens(browser, tokens_server, viewer["token"])
    assert "this session" in cells(page, viewer["id"])["Token"]
    assert cells(page, 1)["Role"] == "admin"
    assert shown_ids(page) == sorted(listed(tokens_server), reverse=True)
    assert not page.d.find_elements(By.ID, "issue-form")
    assert not page.d.find_elements(By.CSS_SELECTOR, '[data-action="revoke-token"]')
    assert not page.d.find_elements(By.ID, "revoke-dialog")
    refused = page.d.find_element(By.ID, "manage-refused").text
    assert "issuing or revoking a token needs a token with role admin" in refused and "viewer token" in refused
    html = page.d.page_source
    assert viewer["token"] not in html and tokens_server.token not in html

    # Without the buttons, the API refuses the viewer's session anyway.
    answer = page.d.execute_async_script(
        "var done = arguments[0];"
        "fetch('/api/w/default/tokens/1', {method: 'DELETE', credentials: 'same-origin',"
        "  headers: {'X-Flexium-Request': '1'}}).then(function (r) { done(r.status); });"
    )
    assert answer == 403
    assert status_with(tokens_server, tokens_server.token) == 200
    page.assert_console_clean()
