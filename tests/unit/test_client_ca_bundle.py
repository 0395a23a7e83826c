"""A CA bundle that names no file is refused by name (issue 41 item 7), not raised by requests from
inside the first request as a traceback: the command line says so and stops, a training job says
so once and trains without the server."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from flexium import protocol
from flexium.cli.main import main
from flexium.client import start_client
from flexium.client.http import ApiClient
from flexium.errors import ConfigError
from flexium.protocol import parse_server_address

HTTPS = parse_server_address("https://gpu-server:8443/team")


def test_a_missing_bundle_is_named_with_its_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "ca.pem"
    monkeypatch.setenv(protocol.CA_BUNDLE_ENV, str(missing))
    with pytest.raises(ConfigError) as raised:
        ApiClient(HTTPS, "flx_x")
    assert str(raised.value).startswith(f"${protocol.CA_BUNDLE_ENV} names {missing}, which does not exist: ")
    with pytest.raises(ConfigError, match=f"^the CA bundle names {tmp_path}/other.pem, which does not exist"):
        ApiClient(HTTPS, "flx_x", ca_bundle=str(tmp_path / "other.pem"))


def test_a_readable_bundle_or_a_plain_http_server_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = tmp_path / "ca.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv(protocol.CA_BUNDLE_ENV, str(bundle))
    assert ApiClient(HTTPS, "flx_x").verify == str(bundle)
    monkeypatch.setenv(protocol.CA_BUNDLE_ENV, str(tmp_path / "gone.pem"))
    assert ApiClient(parse_server_address("gpu-server:8080/team"), "flx_x").verify  # never used over http
    monkeypatch.delenv(protocol.CA_BUNDLE_ENV)
    assert ApiClient(HTTPS, "flx_x").verify is True


def test_the_command_line_says_it_without_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # no .flexiumrc of the machine's
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(protocol.CA_BUNDLE_ENV, str(tmp_path / "ca.pem"))
    status = main(["ps", "--server", "https://gpu-server:8443/team", "--token", "flx_x"])
    err = capsys.readouterr().err
    assert status != 0 and "Traceback" not in err
    assert f"{protocol.CA_BUNDLE_ENV} names {tmp_path / 'ca.pem'}, which does not exist" in err


def test_a_job_trains_on_without_the_server_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(protocol.CA_BUNDLE_ENV, str(tmp_path / "ca.pem"))
    training = SimpleNamespace(config=SimpleNamespace(address=HTTPS, token="flx_x"))
    with caplog.at_level(logging.ERROR, logger="flexium.client"):
        assert start_client(training) is None  # type: ignore[arg-type]
    assert f"{protocol.CA_BUNDLE_ENV} names {tmp_path / 'ca.pem'}, which does not exist" in caplog.text
    assert "this process trains without the server" in caplog.text
