"""What Client and AsyncClient share and that does no I/O: configuration, headers, request
bodies, the retry policy and turning responses into errors."""

from __future__ import annotations

import email.utils
import os
import random
import time

import httpx

from specstream_client._exceptions import APIConnectionError, APITimeoutError, error_from_body

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
MAX_RETRY_AFTER = 60.0


class BaseClient:
    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float | httpx.Timeout = 120.0,
        max_retries: int = 2,
        headers: dict[str, str] | None = None,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.base_url = (
            base_url or os.environ.get("SPECSTREAM_BASE_URL") or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
        ).rstrip("/")
        self.api_key = (
            api_key if api_key is not None else os.environ.get("SPECSTREAM_API_KEY") or os.environ.get("OPENAI_API_KEY")
        )
        self.timeout = (
            timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout, connect=min(timeout, 10.0))
        )
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.headers = {"Accept": "application/json", **(headers or {})}
        if self.api_key:
            self.headers["Authorization"] = f"Bearer {self.api_key}"

    # ------------------------------------------------------------------- requests
    @staticmethod
    def body(params: dict, extra_body: dict | None) -> dict:
        """The JSON body: arguments left at None are not sent; extra_body is merged last."""
        body = {k: v for k, v in params.items() if v is not None}
        body.update(extra_body or {})
        return body

    def request_timeout(self, timeout: float | httpx.Timeout | None) -> httpx.Timeout:
        if timeout is None:
            return self.timeout
        return timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout, connect=min(timeout, 10.0))

    # -------------------------------------------------------------------- retries
    def should_retry(self, attempt: int, status: int | None = None, exc: Exception | None = None) -> bool:
        if attempt >= self.max_retries:
            return False
        if exc is not None:
            # Only errors where the request surely never reached the server.
            return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
        return status in RETRY_STATUSES

    def retry_delay(self, attempt: int, response: httpx.Response | None = None) -> float:
        """Retry-After when the server gives one (capped), else exponential backoff with jitter."""
        if response is not None:
            after = retry_after_seconds(response.headers.get("retry-after"))
            if after is not None:
                return min(after, MAX_RETRY_AFTER)
        delay = min(self.backoff * 2**attempt, self.max_backoff)
        return delay * random.uniform(0.75, 1.0)

    # --------------------------------------------------------------------- errors
    @staticmethod
    def status_error(response: httpx.Response) -> Exception:
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            body = None
        return error_from_body(response.status_code, body, f"HTTP {response.status_code}: {response.text[:200]}")

    @staticmethod
    def json_body(response: httpx.Response) -> dict:
        try:
            return response.json()
        except ValueError as exc:
            raise APIConnectionError(f"the server sent invalid JSON: {response.text[:200]!r}") from exc

    @staticmethod
    def transport_error(exc: httpx.TransportError) -> Exception:
        if isinstance(exc, httpx.TimeoutException):
            return APITimeoutError(f"request timed out: {exc!r}")
        return APIConnectionError(f"connection error: {exc!r}")


def retry_after_seconds(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        parsed = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(parsed.timestamp() - time.time(), 0.0)
