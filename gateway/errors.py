"""OpenAI-shaped errors, {"error": {"message", "type", "param", "code"}}, and the mapping of
engine exceptions onto them. On Anthropic's paths (/v1/messages...) the same errors take
Anthropic's shape, {"type": "error", "error": {"type", "message"}}.

Client-facing messages never carry internal request ids or exception details of a server
fault: those go to the log, and the client gets a message it can act on."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator

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

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PATH = "/v1/messages"


def speaks_anthropic(path: str) -> bool:
    """Whether a path belongs to the Anthropic Messages API (its errors take Anthropic's shape)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


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

    def anthropic_body(self) -> dict:
        """Anthropic's shape has no param: the message names the field instead."""
        message = self.message
        if self.param is not None and self.param not in message:
            message = f"{self.param}: {message}"
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"), "message": message}}

    def json(self, anthropic: bool = False) -> str:
        # ASCII escapes: a message quoting client text (even a lone surrogate) always encodes.
        return json.dumps(self.anthropic_body() if anthropic else self.body(), ensure_ascii=True)

    def response(self, anthropic: bool = False) -> Response:
        return Response(
            self.json(anthropic), status_code=self.status, headers=self.headers, media_type="application/json"
        )

    def response_for(self, path: str) -> Response:
        """The response in the shape of the API that path belongs to."""
        return self.response(anthropic=speaks_anthropic(path))


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


def renamed(exc: APIError, names: dict[str, str]) -> APIError:
    """exc with its param named as another API names the field: the longest key of names that param
    starts with is replaced by its value. A sub-field's tail (".schema") is kept; a list index's
    ("[3]...") is dropped, since the two APIs' lists need not line up."""
    param = exc.param
    for old in sorted(names, key=len, reverse=True):
        if param is not None and (param == old or param.startswith((old + ".", old + "["))):
            tail = param[len(old) :]
            new = names[old] + (tail if tail.startswith(".") else "")
            message = exc.message.replace(f"'{param}'", f"'{new}'")
            if "_" in old or "." in old:  # a field's name, never a word of the message's prose
                message = message.replace(old, names[old])
            return APIError(exc.status, message, param=new, code=exc.code, headers=exc.headers)
    return exc


@contextlib.contextmanager
def params_renamed(names: dict[str, str]) -> Iterator[None]:
    """Re-raise an APIError with its param renamed (see renamed)."""
    try:
        yield
    except APIError as exc:
        raise renamed(exc, names) from None
