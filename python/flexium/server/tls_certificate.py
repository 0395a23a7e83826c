"""The server's own certificate, checked at start rather than by the first client: it and its key
must load, and it must not have expired (a client refuses it without a word to the server's
operator); one that expires soon is said.

Its end of validity is read from the PEM file itself: Python's ssl module gives a certificate's
dates only through a private call, and ``cryptography`` is not a dependency, so the few DER fields
on the way to ``notAfter`` are walked here (RFC 5280 4.1: Certificate, TBSCertificate, then
version, serialNumber, signature, issuer, validity)."""

from __future__ import annotations

import calendar
import re
import ssl
import time
from dataclasses import dataclass

from flexium.units import utc_time

# A certificate this close to its end is said at start: time to renew it before clients refuse it.
WARN_BEFORE_S = 14 * 86400.0
_FIRST_CERTIFICATE = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)
_EXPLICIT_VERSION = 0xA0
_UTC_TIME = 0x17
_GENERALIZED_TIME = 0x18


@dataclass(frozen=True)
class CertificateCheck:
    """``problem`` refuses to serve; ``warning`` is printed and the server starts."""

    problem: str | None = None
    warning: str | None = None


def check_certificate(certfile: str | None, keyfile: str | None, *, now: float) -> CertificateCheck:
    if certfile is None or keyfile is None:
        return CertificateCheck()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
        with open(certfile, encoding="ascii", errors="replace") as pem:
            expires = not_after(pem.read())
    except (ssl.SSLError, OSError, ValueError) as exc:
        return CertificateCheck(
            problem=f"cannot serve HTTPS with --certfile {certfile} --keyfile {keyfile}: {exc} "
            "(both must be PEM files, the key the certificate's, unencrypted)"
        )
    until = utc_time(expires)
    if expires <= now:
        return CertificateCheck(
            problem=f"cannot serve HTTPS with --certfile {certfile}: the certificate expired on {until} "
            "and every client refuses it: renew it"
        )
    if expires - now < WARN_BEFORE_S:
        return CertificateCheck(
            warning=f"warning: the certificate of --certfile {certfile} expires on {until}, in "
            f"{(expires - now) / 86400:.1f} days, and clients refuse it from then: renew it before"
        )
    return CertificateCheck()


def not_after(pem: str) -> float:
    """The end of validity of the first certificate in ``pem`` (the server's own; its chain
    follows it), in seconds since the epoch. ValueError when there is none to read."""
    found = _FIRST_CERTIFICATE.search(pem)
    if found is None:
        raise ValueError("no PEM certificate in it")
    der = ssl.PEM_cert_to_DER_cert(found.group(0))
    _tag, start, _end = _element(der, 0)  # Certificate
    _tag, pos, _end = _element(der, start)  # TBSCertificate: its fields in order
    if der[pos] == _EXPLICIT_VERSION:
        pos = _element(der, pos)[2]
    for _skipped in ("serialNumber", "signature", "issuer"):
        pos = _element(der, pos)[2]
    _tag, validity, _end = _element(der, pos)
    not_before_end = _element(der, validity)[2]
    tag, start, end = _element(der, not_before_end)
    return _time(tag, der[start:end].decode("ascii"))


def _element(der: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, where its content starts, where it ends) of the DER element at ``pos``."""
    if pos + 2 > len(der):
        raise ValueError("the certificate ends early")
    tag, length = der[pos], der[pos + 1]
    start = pos + 2
    if length & 0x80:
        count = length & 0x7F
        length = int.from_bytes(der[start : start + count], "big")
        start += count
    if start + length > len(der):
        raise ValueError("the certificate ends early")
    return tag, start, start + length


def _time(tag: int, text: str) -> float:
    if tag == _UTC_TIME:  # YYMMDDHHMMSSZ; RFC 5280: YY below 50 is 20YY
        year = int(text[:2])
        text = f"{2000 + year if year < 50 else 1900 + year}{text[2:]}"
    elif tag != _GENERALIZED_TIME:
        raise ValueError(f"notAfter has DER tag {tag:#x}, not a time")
    return float(calendar.timegm(time.strptime(text, "%Y%m%d%H%M%SZ")))
