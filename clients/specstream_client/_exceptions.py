"""One exception hierarchy, rooted at APIError, built from the server's error body."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, message: str, *, status_code: int | None = None, body: dict | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.body = body or {}
        found = self.body.get("error")
        err: dict = found if isinstance(found, dict) else {}
        self.type: str | None = err.get("type")
        self.code: str | None = err.get("code")
        self.param: str | None = err.get("param")


class APIStatusError(APIError):
    """An HTTP error status with no more specific class."""


class BadRequestError(APIStatusError):
    """400, 413, 422."""


class AuthenticationError(APIStatusError):
    """401, 403."""


class NotFoundError(APIStatusError):
    """404."""


class RateLimitError(APIStatusError):
    """429."""


class InternalServerError(APIStatusError):
    """5xx, and errors a server reports in the middle of a stream."""


class APIConnectionError(APIError):
    """The connection failed or dropped (including mid-stream)."""


class APITimeoutError(APIConnectionError):
    """The request timed out."""


def error_from_body(status_code: int | None, body: dict | None, fallback: str) -> APIStatusError:
    err = (body or {}).get("error")
    message = err.get("message") if isinstance(err, dict) and err.get("message") else None
    if not isinstance(message, str):
        message = fallback
    cls: type[APIStatusError]
    if status_code in (400, 413, 422):
        cls = BadRequestError
    elif status_code in (401, 403):
        cls = AuthenticationError
    elif status_code == 404:
        cls = NotFoundError
    elif status_code == 429:
        cls = RateLimitError
    elif status_code is None or status_code >= 500:
        cls = InternalServerError
    else:
        cls = APIStatusError
    return cls(message, status_code=status_code, body=body)
