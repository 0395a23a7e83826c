"""/docs (Swagger UI) and /redoc render with nothing but this server: their scripts and styles
are served locally, so the reference works on a cluster without internet."""

from __future__ import annotations

from typing import Any

import pytest
import requests
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from support.dashboard import LiveServer

pytestmark = pytest.mark.timeout(120)


def _code_and_styles(browser: Any) -> list[str]:
    """What the page loaded that it needs to work: scripts, styles and data (ReDoc's footer
    still asks its own site for a logo image, refused here and harmless)."""
    return list(
        browser.execute_script(
            "return performance.getEntriesByType('resource').filter(e => e.initiatorType !== 'img').map(e => e.name)"
        )
    )


@pytest.mark.parametrize(
    "path,rendered",
    [
        ("/docs", ".swagger-ui .opblock"),  # an operation of the API, drawn by Swagger UI
        ("/redoc", "[data-section-id]"),  # a section of the reference, drawn by ReDoc
    ],
)
def test_the_api_reference_renders_offline(server: LiveServer, browser: Any, path: str, rendered: str) -> None:
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd(
        "Network.setBlockedURLs", {"urls": ["https://*", "*jsdelivr*", "*googleapis*", "*tiangolo*"]}
    )
    watch = browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": _RECORD_VIOLATIONS})
    try:
        browser.get(server.url + path)
        WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, rendered), f"{path} renders")
        assert "flexium server" in browser.find_element(By.TAG_NAME, "body").text
        loaded = _code_and_styles(browser)
        assert loaded and all(url.startswith(server.url) for url in loaded), loaded
        assert any("/docs-assets/" in url for url in loaded), loaded
        # drawn under its Content-Security-Policy, which refused nothing it needs
        policy = requests.get(server.url + path, timeout=10).headers["Content-Security-Policy"]
        assert "script-src 'self' 'sha256-" in policy or path == "/redoc", policy
        refused = [v for v in browser.execute_script("return window.flexiumViolations") if not v.startswith("img-src")]
        assert refused == [], refused
    finally:
        browser.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": watch["identifier"]})
        browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})


# What the page's Content-Security-Policy refused, recorded from before its first script runs.
_RECORD_VIOLATIONS = """
window.flexiumViolations = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.flexiumViolations.push(e.violatedDirective + " " + e.blockedURI);
});
"""


def test_swagger_offers_authorize_and_shows_the_token_placeholder(server: LiveServer, browser: Any) -> None:
    browser.get(server.url + "/docs")
    WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".swagger-ui .opblock"), "renders")
    assert browser.find_elements(By.CSS_SELECTOR, ".swagger-ui .auth-wrapper .authorize"), "no Authorize button"
    description = browser.find_element(By.CSS_SELECTOR, ".swagger-ui .info .description").text
    assert "Authorization: Bearer <workspace token>" in description, description
    # each /api operation shows the lock that says it sends the token
    assert browser.find_elements(By.CSS_SELECTOR, ".swagger-ui .opblock .authorization__btn")
