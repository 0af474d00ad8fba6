"""The OpenAI-compatible HTTP app: ``create_app(engine, settings) -> Starlette``.

create_app puts a ServingState on app.state (nothing global, so tests build an app around
any AsyncEngine); the endpoints are module-level functions in gateway.endpoints. The
lifespan loads the model in the background (so /health answers "loading" meanwhile), then
watches the engine: a failed load or a fatal engine error is logged and handed to
on_engine_failure, which `specstream serve` uses to exit non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway import endpoints
from gateway.api_endpoints import API_ROUTES
from gateway.drain import Drain, DrainMiddleware
from gateway.errors import APIError
from gateway.playground import playground_routes
from gateway.settings import GatewaySettings
from gateway.state import ServingState
from specstream import AsyncEngine

log = logging.getLogger("specstream.gateway")


ROUTES = [
    Route("/v1/chat/completions", endpoints.chat_completions, methods=["POST"]),
    Route("/v1/completions", endpoints.completions, methods=["POST"]),
    Route("/v1/models", endpoints.models, methods=["GET"]),
    Route("/v1/models/{model:path}", endpoints.model_detail, methods=["GET"]),
    Route("/health", endpoints.health, methods=["GET"]),
    Route("/metrics", endpoints.metrics, methods=["GET"]),
    *API_ROUTES,  # OpenAI Responses, Anthropic Messages, vLLM's /tokenize and /detokenize
]


def create_app(
    engine: AsyncEngine,
    settings: GatewaySettings | None = None,
    *,
    on_engine_failure: Callable[[BaseException], None] | None = None,
) -> Starlette:
    state = ServingState(engine, settings or GatewaySettings())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        supervisor = asyncio.create_task(supervise(state, on_engine_failure or (lambda exc: None)))
        try:
            yield
        finally:
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)
            try:
                await engine.stop()
            except Exception:  # noqa: BLE001 - shutting down anyway; say why it was not clean
                log.exception("the engine did not stop cleanly")

    settings = state.settings
    routes = ROUTES + (playground_routes(engine) if settings.playground else [])
    drain = Drain()
    app = Starlette(
        routes=routes,
        middleware=[Middleware(DrainMiddleware, drain=drain, retry_after_seconds=settings.retry_after_seconds)],
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )
    app.state.serving = state
    app.state.drain = drain  # DrainingServer drains it on SIGTERM
    return app


async def supervise(state: ServingState, on_failure: Callable[[BaseException], None]) -> None:
    """Load the model unless it is loaded, then wait for the engine to fail."""
    engine = state.engine
    if engine.state in ("loading", "stopped"):
        try:
            await engine.start()
        except Exception as exc:  # noqa: BLE001 - any load error fails the server
            state.load_error = exc
            log.error("the model failed to load: %s", exc)
            on_failure(exc)
            return
        log.info("model '%s' loaded; serving as '%s'", engine.model_name, state.model_name)
    if engine.state == "ready":  # vLLM labels its series with the name clients send
        engine.metrics.vllm.model_name = state.model_name
    failure = await engine.wait_failed()
    log.error("the engine failed and cannot serve any more: %r", failure)
    on_failure(failure)


async def api_error(request: Request, exc: APIError) -> Response:
    return exc.response_for(request.url.path)


async def http_error(request: Request, exc: HTTPException) -> Response:
    messages = {404: f"no route {request.url.path[:200]}", 405: f"method {request.method} not allowed here"}
    return APIError(exc.status_code, messages.get(exc.status_code, str(exc.detail))).response_for(request.url.path)


async def internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path[:200])
    error = APIError(500, "internal error (the server log has the details)", code="internal_error")
    return error.response_for(request.url.path)
