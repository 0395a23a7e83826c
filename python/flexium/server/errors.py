"""Errors storage functions and routes raise on purpose. Each carries a protocol error code
(``flexium.protocol.ERROR_STATUS`` gives its HTTP status) and a message meant for a person."""

from __future__ import annotations

from typing import Any

from flexium import protocol


class ApiError(Exception):
    code = "internal"

    def __init__(self, message: str, *, detail: Any | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail

    @property
    def status(self) -> int:
        return protocol.ERROR_STATUS[self.code]

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"error": self.code, "message": self.message}
        if self.detail is not None:
            body["detail"] = self.detail
        return body


class BadRequest(ApiError):
    code = "bad_request"


class Unauthorized(ApiError):
    """401 with the challenge RFC 6750 asks for: which scheme to use and, when a token was sent,
    what was wrong with it (``invalid_token``, ``invalid_request``)."""

    code = "unauthorized"

    def __init__(self, message: str, *, error: str | None = None) -> None:
        super().__init__(message)
        self.error = error

    @property
    def challenge(self) -> str:
        if self.error is None:
            return 'Bearer realm="flexium"'
        description = self.message.replace("\\", "").replace('"', "'")
        return f'Bearer realm="flexium", error="{self.error}", error_description="{description}"'


class Forbidden(ApiError):
    code = "forbidden"


class NotFound(ApiError):
    code = "not_found"


class InvalidState(ApiError):
    code = "invalid_state"


class Busy(ApiError):
    code = "busy"


class Stale(ApiError):
    code = "stale"


class InvalidRequest(ApiError):
    code = "invalid_request"


class TargetRefused(ApiError):
    code = "target_refused"


class CapabilityMissing(ApiError):
    code = "capability"


class PayloadTooLarge(ApiError):
    code = "payload_too_large"


class HeaderFieldsTooLarge(ApiError):
    """A request's header block past the server's bound (answered by ``connections.py``)."""

    code = "header_fields_too_large"


class QuotaExceeded(ApiError):
    """The workspace holds as much of something as its quota allows (storage/quotas.py)."""

    code = "quota_exceeded"


class Unavailable(ApiError):
    code = "unavailable"


class TooManyRequests(ApiError):
    """A client over its own share of a bound (``fair_share.py``): it may retry after
    ``retry_after_s``, once something it holds has ended."""

    code = "too_many_requests"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Conflict(ApiError):
    """A name that must be unique is taken (workspace create)."""

    code = "invalid_state"
