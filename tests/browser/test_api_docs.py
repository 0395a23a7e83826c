"""/docs (Swagger UI) and /redoc render with nothing but this server: their scripts and styles
are served locally, so the reference works on a cluster without internet."""

from __future__ import annotations

from typing import Any

import pytest
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
    try:
        browser.get(server.url + path)
        WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, rendered), f"{path} renders")
        assert "flexium server" in browser.find_element(By.TAG_NAME, "body").text
        loaded = _code_and_styles(browser)
        assert loaded and all(url.startswith(server.url) for url in loaded), loaded
        assert any("/docs-assets/" in url for url in loaded), loaded
    finally:
        browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})


def test_swagger_offers_authorize_and_shows_the_token_placeholder(server: LiveServer, browser: Any) -> None:
    browser.get(server.url + "/docs")
    WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".swagger-ui .opblock"), "renders")
    assert browser.find_elements(By.CSS_SELECTOR, ".swagger-ui .auth-wrapper .authorize"), "no Authorize button"
    description = browser.find_element(By.CSS_SELECTOR, ".swagger-ui .info .description").text
    assert "Authorization: Bearer <workspace token>" in description, description
    # each /api operation shows the lock that says it sends the token
    assert browser.find_elements(By.CSS_SELECTOR, ".swagger-ui .opblock .authorization__btn")
