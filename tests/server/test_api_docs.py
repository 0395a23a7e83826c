"""/docs (Swagger UI) and /redoc: FastAPI's own pages, with their scripts, styles and icon
served by this server when fastapi-offline is installed, and FastAPI's CDN pages without it
(the browser test tests/browser/test_api_docs_drawn.py draws them with the network cut)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.testclient import TestClient

from flexium.server.app import create_app
from flexium.server.routes import docs
from flexium.server.settings import Settings
from support.server import Api

TITLE = "flexium server API"
LOCAL_PAGES = {
    "/docs": get_swagger_ui_html(
        openapi_url="/openapi.json",
        title=TITLE,
        swagger_js_url="/docs-assets/swagger-ui-bundle.js",
        swagger_css_url="/docs-assets/swagger-ui.css",
        swagger_favicon_url="/docs-assets/favicon.png",
    ),
    "/redoc": get_redoc_html(
        openapi_url="/openapi.json",
        title=TITLE,
        redoc_js_url="/docs-assets/redoc.standalone.js",
        redoc_favicon_url="/docs-assets/favicon.png",
        with_google_fonts=False,
    ),
}
CDN_PAGES = {
    "/docs": get_swagger_ui_html(openapi_url="/openapi.json", title=TITLE),
    "/redoc": get_redoc_html(openapi_url="/openapi.json", title=TITLE),
}


def test_the_api_reference_is_served_with_local_assets(api: Api) -> None:
    for path, asset in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
        page = api.client.get(path)
        assert page.status_code == 200 and f"/docs-assets/{asset}" in page.text
        assert "cdn.jsdelivr.net" not in page.text and "fonts.googleapis.com" not in page.text
        assert api.client.get(f"/docs-assets/{asset}").status_code == 200


@pytest.mark.parametrize("path", sorted(LOCAL_PAGES))
def test_each_page_is_fastapis_own_with_every_asset_local(api: Api, path: str) -> None:
    page = api.client.get(path)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.text == LOCAL_PAGES[path].body.decode()
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png"):
        assert api.client.get(f"/docs-assets/{asset}").status_code == 200, asset


def test_without_fastapi_offline_the_pages_load_from_the_cdn(
    app_settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    monkeypatch.setattr(docs, "asset_dir", lambda: None)
    with caplog.at_level(logging.WARNING, logger="flexium.server"):
        app = create_app(app_settings)
    assert any("fastapi-offline is not installed" in r.getMessage() for r in caplog.records)
    with TestClient(app) as client:
        for path, expected in CDN_PAGES.items():
            page = client.get(path)
            assert page.status_code == 200 and page.text == expected.body.decode(), path
        assert client.get("/docs-assets/swagger-ui-bundle.js").status_code == 404


def test_the_schema_declares_the_workspace_token_on_every_api_operation(api: Api) -> None:
    """Swagger UI draws its Authorize button from the bearer scheme, and shows the description's
    `<workspace token>` as text only in code (bare, it is read as an HTML tag and vanishes)."""
    schema = api.client.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"][docs.BEARER_SCHEME] == {
        "type": "http",
        "scheme": "bearer",
        "description": "a workspace token (flx_...), as `flexium server` or `flexium token issue` printed it",
    }
    secured = {
        (path, method): operation.get("security")
        for path, operations in schema["paths"].items()
        for method, operation in operations.items()
    }
    assert secured[("/api/w/{workspace}/processes", "get")] == [{docs.BEARER_SCHEME: []}]
    assert all(s == [{docs.BEARER_SCHEME: []}] for (path, _), s in secured.items() if path.startswith("/api/"))
    assert secured[("/healthz", "get")] is None
    assert "`Authorization: Bearer <workspace token>`" in schema["info"]["description"]
