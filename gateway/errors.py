"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error to answer with; raised anywhere in a request's handling."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "api_error"), "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
