"""The HTTP endpoints: module-level `async def endpoint(request)`, reading what they share
from request.app.state (see gateway.state)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.body import read_json_object
from gateway.errors import APIError, quoted
from gateway.protocol import ChatCompletionRequest, CompletionRequest, parse
from gateway.serving_chat import ServingChat
from gateway.serving_completion import ServingCompletion
from gateway.state import ServingState, serving
from specstream import EngineDeadError


async def _json_body(request: Request) -> tuple[ServingState, dict]:
    state = serving(request)
    state.authorize(request)
    return state, await read_json_object(request, state.settings.max_body_bytes)


async def chat_completions(request: Request) -> Response:
    state, body = await _json_body(request)
    return await ServingChat(state, parse(ChatCompletionRequest, body)).create(request)


async def completions(request: Request) -> Response:
    state, body = await _json_body(request)
    return await ServingCompletion(state, parse(CompletionRequest, body)).create(request)


def _model_card(state: ServingState) -> dict:
    return {"id": state.model_name, "object": "model", "created": int(state.started), "owned_by": "specstream"}


async def models(request: Request) -> Response:
    state = serving(request)
    state.authorize(request)
    return JSONResponse({"object": "list", "data": [_model_card(state)]})


async def model_detail(request: Request) -> Response:
    state = serving(request)
    state.authorize(request)
    name = request.path_params["model"]
    if name != state.model_name:
        raise APIError(404, f"the model {quoted(name)} does not exist", param="model", code="model_not_found")
    return JSONResponse(_model_card(state))


async def health(request: Request) -> Response:
    """200 {"status": "ok"} while serving; 503 with "loading", "failed" (and the error) or
    "stopped" otherwise, so an orchestrator can tell waiting from restarting."""
    state = serving(request)
    status, failure = state.health
    if status == "ready":
        return JSONResponse({"status": "ok", "model": state.model_name})
    body = {"status": status}
    if failure is not None:
        body["error"] = f"{type(failure).__name__}: {failure}"[:500]
    return JSONResponse(body, status_code=503)


async def metrics(request: Request) -> Response:
    try:
        registry = serving(request).engine.metrics.registry
    except EngineDeadError:  # not loaded (yet)
        raise APIError(503, "metrics are served once the model is loaded", code="model_not_ready") from None
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
