"""OpenAI-shaped errors, {"error": {"message", "type", "param", "code"}}, and the mapping of
engine exceptions onto them.

Client-facing messages never carry internal request ids or exception details of a server
fault: those go to the log, and the client gets a message it can act on."""

from __future__ import annotations

import json
import logging

from starlette.responses import Response

from specstream import EngineDeadError, InvalidRequestError, QueueFull, RequestFailed

log = logging.getLogger("specstream.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to answer with; raised anywhere in a request's handling."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        error = {
            "message": self.message,
            "type": _TYPES.get(self.status, "api_error"),
            "param": self.param,
            "code": self.code,
        }
        return {"error": error}

    def json(self) -> str:
        # ASCII escapes: a message quoting client text (even a lone surrogate) always encodes.
        return json.dumps(self.body(), ensure_ascii=True)

    def response(self) -> Response:
        return Response(self.json(), status_code=self.status, headers=self.headers, media_type="application/json")


def quoted(value: object, limit: int = 64) -> str:
    """Client text for an error message: repr'd (so control characters stay visible) and cut."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def from_engine(exc: BaseException, *, prompt_param: str, retry_after: int) -> APIError:
    """The APIError for an exception from the engine. prompt_param is what this endpoint
    calls its prompt ("messages" for chat, "prompt" for completions): the engine names the
    prompt "prompt" whatever the endpoint."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        param = prompt_param if exc.param in ("prompt", "messages") else exc.param
        return APIError(400, str(exc), param=param, code=exc.code)
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), code="queue_full", headers={"Retry-After": str(retry_after)})
    if isinstance(exc, EngineDeadError):
        log.warning("request refused, the engine is not running: %s", exc)
        return APIError(503, "the engine is not available; retry on a healthy replica", code="engine_unavailable")
    if isinstance(exc, RequestFailed):
        log.warning("request failed while generating: %s", exc)
        return APIError(
            500, "the request failed while generating (the server log has the details)", code="request_failed"
        )
    log.error("unexpected error while generating", exc_info=exc)
    return APIError(500, "internal error (the server log has the details)", code="internal_error")
