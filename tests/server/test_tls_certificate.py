"""The server's certificate checked at start (issue 41 item 7): an expired one refuses to serve,
one that expires within 14 days is said, and its end of validity is read from the PEM's DER as
openssl wrote it (UTCTime before 2050, GeneralizedTime after)."""

from __future__ import annotations

import calendar
import subprocess
import time
from pathlib import Path

import pytest

from flexium.server.tls_certificate import WARN_BEFORE_S, check_certificate, not_after

DAY = 86400.0


def _certificate(folder: Path, name: str, days: int) -> tuple[str, str, float]:
    """(certfile, keyfile, its notAfter as openssl says it) of a new self-signed certificate."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1", "-days", str(days)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    said = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-enddate", "-dateopt", "iso_8601"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    end = said.strip().removeprefix("notAfter=")
    return str(cert), str(key), float(calendar.timegm(time.strptime(end, "%Y-%m-%d %H:%M:%SZ")))


@pytest.mark.parametrize("days", [3, 40000])  # 2136 is past UTCTime's years: GeneralizedTime
def test_not_after_is_read_as_openssl_says(tmp_path: Path, days: int) -> None:
    cert, _key, end = _certificate(tmp_path, "server", days)
    chain = Path(cert).read_text() + Path(cert).read_text()
    assert not_after(Path(cert).read_text()) == end
    assert not_after(chain) == end  # the server's own comes first, its chain after


def test_an_expired_certificate_refuses_to_serve(tmp_path: Path) -> None:
    cert, key, end = _certificate(tmp_path, "server", 3)
    check = check_certificate(cert, key, now=end + 1)
    assert check.problem is not None and check.warning is None
    assert f"--certfile {cert}: the certificate expired on " in check.problem and "renew it" in check.problem


def test_a_certificate_near_its_end_is_said_and_serves(tmp_path: Path) -> None:
    cert, key, end = _certificate(tmp_path, "server", 3)
    check = check_certificate(cert, key, now=end - 2 * DAY)
    assert check.problem is None and check.warning is not None
    assert "expires on " in check.warning and "in 2.0 days" in check.warning
    assert check_certificate(cert, key, now=end - WARN_BEFORE_S - 1) == check_certificate(None, None, now=0)


def test_a_file_that_is_no_certificate_is_refused(tmp_path: Path) -> None:
    _cert, key, _end = _certificate(tmp_path, "server", 3)
    check = check_certificate(key, key, now=0)
    assert check.problem is not None and check.problem.startswith(f"cannot serve HTTPS with --certfile {key}")
