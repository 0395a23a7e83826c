"""HTTPS end to end: ``flexium server --certfile --keyfile`` with a certificate of a CA made in
the test (the ``openssl`` command), its printed links, the ``flexium`` command and the Python
client trusting that CA through FLEXIUM_CA_BUNDLE; and the refusals at start."""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from flexium import protocol
from flexium.client.http import ApiClient, Unreachable
from support.e2e import ServerProcess, clean_env, flexium_command

pytestmark = pytest.mark.timeout(180)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca.pem (a CA of the test's own), server.pem and server.key (127.0.0.1, signed by it)."""
    folder = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=flexium test CA",
        cwd=folder,
    )
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1", cwd=folder)
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "2", "-extfile", "san.ext",
        cwd=folder,
    )  # fmt: skip
    return folder


@pytest.fixture
def https_server(certificates: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServerProcess]:
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(certificates / "ca.pem"))  # this test's own requests
    home = tmp_path / "home"
    srv = ServerProcess(
        home,
        "--certfile",
        str(certificates / "server.pem"),
        "--keyfile",
        str(certificates / "server.key"),
        env=clean_env(home),
    ).start()
    yield srv
    srv.stop(signal.SIGKILL)


def _cli(srv: ServerProcess, *args: str, ca: Path | None) -> subprocess.CompletedProcess[str]:
    env = clean_env(srv.home)
    env.pop("REQUESTS_CA_BUNDLE", None)
    env[protocol.SERVER_ENV] = f"https://127.0.0.1:{srv.port}/default"
    env[protocol.TOKEN_ENV] = srv.token or ""
    if ca is not None:
        env[protocol.CA_BUNDLE_ENV] = str(ca)
    return subprocess.run([*flexium_command(), *args], env=env, capture_output=True, text=True, timeout=60)


def test_https_links_cli_and_client(https_server: ServerProcess, certificates: Path) -> None:
    srv = https_server
    out = "\n".join(srv.lines)
    assert srv.url.startswith("https://")
    assert f"dashboard {srv.url}/" in out
    assert re.search(rf"{re.escape(srv.url)}/login#code=\S+", out), out  # a one-time login code, never the token
    assert srv.token not in out.split("(shown once)")[0]
    assert f"FLEXIUM_SERVER=https://127.0.0.1:{srv.port}/default" in out
    answer = requests.get(f"{srv.url}/healthz", timeout=10)
    assert answer.json()["status"] == "ok"
    assert answer.headers["Strict-Transport-Security"] == "max-age=31536000"  # no plain HTTP to it for a year
    with pytest.raises(requests.exceptions.ConnectionError):  # plain HTTP is not served on that port
        requests.get(f"http://127.0.0.1:{srv.port}/healthz", timeout=10)

    done = _cli(srv, "ps", ca=certificates / "ca.pem")
    assert done.returncode == 0, done.stderr
    refused = _cli(srv, "ps", ca=None)  # the test's CA is not one the system trusts
    assert refused.returncode != 0
    assert "certificate verify failed" in refused.stderr and protocol.CA_BUNDLE_ENV in refused.stderr

    address = protocol.parse_server_address(f"https://127.0.0.1:{srv.port}/default")
    client = ApiClient(address, srv.token, ca_bundle=str(certificates / "ca.pem"))
    assert client.health(timeout=10).status == "ok"
    assert client.list_processes() == []
    with pytest.raises(Unreachable, match="certificate verify failed"):
        ApiClient(address, srv.token, ca_bundle=str(certificates / "server.pem")).list_processes()


def _server(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*flexium_command(), "server", "--port", "1", *args],
        env=clean_env(home),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_start_refuses_half_or_unreadable_tls_settings(certificates: Path, tmp_path: Path) -> None:
    only_cert = _server("--certfile", str(certificates / "server.pem"), home=tmp_path)
    assert only_cert.returncode == 2
    assert "--certfile needs --keyfile too" in only_cert.stderr
    only_key = _server("--keyfile", str(certificates / "server.key"), home=tmp_path)
    assert "--keyfile needs --certfile too" in only_key.stderr
    missing = _server(
        "--certfile", str(tmp_path / "nope.pem"), "--keyfile", str(certificates / "server.key"), home=tmp_path
    )
    assert missing.returncode == 2
    assert f"--certfile {tmp_path / 'nope.pem'}: no such file" in missing.stderr
    wrong_key = _server(
        "--certfile", str(certificates / "server.pem"), "--keyfile", str(certificates / "ca.key"), home=tmp_path
    )
    assert wrong_key.returncode == 1
    assert "cannot serve HTTPS with --certfile" in wrong_key.stderr
    assert "Traceback" not in wrong_key.stderr
