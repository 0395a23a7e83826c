"""An answer no flexium server gives (a web server at that address, a proxy whose server is down):
the error names the address, the status and the first line, and asks whether it is a flexium server."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from flexium.client.http import ApiClient, NotFound, Unavailable
from flexium.protocol import parse_server_address


class NotFlexium(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        status = 502 if "bad-gateway" in self.path else 404
        body = b"<!DOCTYPE HTML>\n<html><body>nothing here</body></html>"
        self.send_response(status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def address() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFlexium)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/default"
    server.shutdown()
    server.server_close()


def test_an_answer_no_flexium_server_gives_asks_whether_it_is_one(address: str) -> None:
    api = ApiClient(parse_server_address(address), "flx_unit")
    with pytest.raises(NotFound) as missing:
        api.request("GET", "/processes")
    assert "HTTP 404 from http://127.0.0.1:" in missing.value.message and "<!DOCTYPE HTML>" in missing.value.message
    assert "is that address a flexium server" in missing.value.message
    with pytest.raises(Unavailable) as down:
        api.request("GET", "/bad-gateway")
    assert "HTTP 502" in down.value.message and "is the one behind any proxy up?" in down.value.message
