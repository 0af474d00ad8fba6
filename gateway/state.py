"""What every request handler shares, set up once in the app's lifespan and read from
request.app.state (Starlette's pattern; vLLM's api_server does the same)."""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from functools import cached_property

from starlette.requests import Request

from gateway.errors import APIError
from gateway.response_store import ResponseStore
from gateway.settings import GatewaySettings
from gateway.tokens import TokenBytes
from specstream import AsyncEngine


@dataclass
class ServingState:
    engine: AsyncEngine
    settings: GatewaySettings
    started: float = field(default_factory=time.time)
    # Set when the background model load raised; the engine's state reports it too, but
    # this keeps /health right whichever way the engine records a failed load.
    load_error: BaseException | None = None

    @cached_property
    def keys(self) -> tuple[bytes, ...]:
        return tuple(k.encode() for k in self.settings.api_keys)

    @cached_property
    def token_bytes(self) -> TokenBytes:
        """Built on first use: the tokenizer exists only once the model has loaded."""
        return TokenBytes(self.engine.tokenizer)

    @cached_property
    def responses(self) -> ResponseStore:
        """Responses kept for previous_response_id and GET /v1/responses/{id} (store: true)."""
        s = self.settings
        return ResponseStore(s.response_store_max_count, s.response_store_max_bytes, s.response_store_max_age_s)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_name or self.engine.model_name

    @property
    def health(self) -> tuple[str, BaseException | None]:
        """("loading" | "ready" | "failed" | "stopped", the failure when failed)."""
        if self.load_error is not None:
            return "failed", self.load_error
        state = self.engine.state
        return state, (self.engine.failure if state == "failed" else None)

    def authorize(self, request: Request) -> bytes | None:
        """The request's API key once checked (None when the server has none): 'Authorization: Bearer
        <key>', or 'x-api-key: <key>' as Anthropic's clients send it."""
        if not self.keys:
            return None
        header = request.headers.get("authorization")
        if header is None and "x-api-key" in request.headers:
            token = request.headers["x-api-key"]
        else:
            scheme, _, token = (header or "").partition(" ")
            token = token if scheme.lower() == "bearer" else ""
        if not token.strip():
            raise APIError(
                401, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'", code="invalid_api_key"
            )
        given = token.strip().encode("latin-1")  # the raw header bytes (Starlette decodes latin-1)
        # Compare against every key so the time does not tell which one came close.
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")
        return given

    def require_ready(self) -> None:
        state, _ = self.health
        if state == "loading":
            raise APIError(503, "the model is still loading", code="model_not_ready", headers={"Retry-After": "5"})
        if state != "ready":
            raise APIError(503, f"the engine is {state}; retry on a healthy replica", code="engine_unavailable")


def serving(request: Request) -> ServingState:
    return request.app.state.serving
