"""The endpoints of the APIs served beside chat and completions: OpenAI's Responses
(/v1/responses), Anthropic's Messages (/v1/messages, /v1/messages/count_tokens) and vLLM's
tokenizer endpoints (/tokenize, /detokenize). API_ROUTES is their route table.

Each reads its body as chat's endpoints do (JSON only, bounded, valid Unicode) after the API
key, which may come as 'Authorization: Bearer' or as 'x-api-key'; errors on /v1/messages paths
take Anthropic's shape (gateway/errors.py), the rest OpenAI's."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.body import read_json_object
from gateway.errors import APIError, from_engine, params_renamed, quoted
from gateway.protocol import ChatCompletionRequest, TokenId, _Strict, parse
from gateway.protocol_messages import CountTokensRequest, MessagesRequest
from gateway.protocol_responses import MAX_ID_CHARS, ResponsesRequest
from gateway.response_store import ResponseStore
from gateway.serving_messages import PARAMS as MESSAGES_PARAMS
from gateway.serving_messages import ServingMessages
from gateway.serving_responses import ServingResponses
from gateway.state import ServingState, serving
from specstream import ChatPrompt


async def authorized_json(request: Request) -> tuple[ServingState, dict, bytes | None]:
    """The serving state, the JSON body and the API key it came with."""
    state = serving(request)
    key = state.authorize(request)
    return state, await read_json_object(request, state.settings.max_body_bytes), key


def check_model(state: ServingState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(
            404,
            f"the model {quoted(model)} does not exist; this server serves {quoted(state.model_name)}",
            param="model",
            code="model_not_found",
        )


# ----------------------------------------------------------------------- responses
async def create_response(request: Request) -> Response:
    state, body, key = await authorized_json(request)
    req = parse(ResponsesRequest, body)
    owner = ResponseStore.owner(key)
    history: list[dict] = []
    if req.previous_response_id is not None:
        stored = state.responses.get(owner, req.previous_response_id)
        if stored is None:
            raise not_found(req.previous_response_id, param="previous_response_id")
        history = stored.conversation
    return await ServingResponses(state, req, history, owner).create(request)


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"no stored response with id {quoted(response_id)}", param=param, code="response_not_found")


def _stored_id(request: Request) -> tuple[ServingState, str, str]:
    state = serving(request)
    owner = ResponseStore.owner(state.authorize(request))
    response_id = request.path_params["response_id"]
    if len(response_id) > MAX_ID_CHARS:
        raise not_found(response_id)
    return state, owner, response_id


async def get_response(request: Request) -> Response:
    """A stored response; 404 when it is unknown, expired or another API key's."""
    state, owner, response_id = _stored_id(request)
    stored = state.responses.get(owner, response_id)
    if stored is None:
        raise not_found(response_id)
    return JSONResponse(stored.body)


async def delete_response(request: Request) -> Response:
    state, owner, response_id = _stored_id(request)
    if not state.responses.delete(owner, response_id):
        raise not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


# ------------------------------------------------------------------------ messages
async def create_message(request: Request) -> Response:
    state, body, _ = await authorized_json(request)
    return await ServingMessages(state, parse(MessagesRequest, body)).create(request)


async def count_tokens(request: Request) -> Response:
    """{"input_tokens": n}: the prompt /v1/messages would run for the same messages, system and tools."""
    state, body, _ = await authorized_json(request)
    req = parse(CountTokensRequest, body)
    with params_renamed(MESSAGES_PARAMS):
        chat = req.chat_request()
        chat.check_supported()
    ids = await encode(state, chat, None, prompt_param="messages")
    return JSONResponse({"input_tokens": len(ids)})


# ----------------------------------------------------------------------- tokenizer
class TokenizeRequest(_Strict):
    """vLLM's: a prompt, or chat messages (with tools) templated as chat would. add_special_tokens: a prompt's,
    the tokenizer's own (default true); with messages only false, its default there (the chat template writes
    the special tokens). add_generation_prompt (default true) and continue_final_message (default false), with
    messages only: end with an opened assistant turn, or leave the last message open; chat_template_kwargs, with
    messages only, as chat takes it."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = Field(default=None, min_length=1)
    tools: list[dict] | None = Field(default=None, max_length=128)
    return_token_strs: bool = False
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


async def encode(
    state: ServingState,
    chat: ChatCompletionRequest | None,
    prompt: str | None,
    prompt_param: str,
    add_special_tokens: bool = True,
    opening: dict | None = None,
):
    """The token ids of a plain prompt, or of the chat request's messages as chat would template them (opening:
    ChatPrompt's add_generation_prompt and continue_final_message, where not chat's)."""
    check_model(state, chat.model if chat is not None else None)
    state.require_ready()
    engine = state.engine
    try:
        if chat is not None:
            prompt = chat.chat_messages(engine.template_calls_tools)
            if opening:
                prompt = ChatPrompt(prompt, None, **opening) if isinstance(prompt, list) else replace(prompt, **opening)
        return await engine.encode(prompt, add_special_tokens)
    except APIError:
        raise
    except Exception as exc:
        raise from_engine(exc, prompt_param=prompt_param, retry_after=state.settings.retry_after_seconds) from None


async def tokenize(request: Request) -> Response:
    state, body, _ = await authorized_json(request)
    req = parse(TokenizeRequest, body)
    check_model(state, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt" if req.prompt is None else "messages")
    for name in ("tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
        if getattr(req, name) is not None and req.messages is None:
            raise APIError(400, f"{name} goes with messages, not with a prompt", param=name)
    if req.messages is not None and req.add_special_tokens:
        raise APIError(
            400,
            "add_special_tokens goes with a prompt: the chat template writes the special tokens of messages",
            param="add_special_tokens",
        )
    chat, opening = None, {}
    if req.messages is not None:
        fields = {"messages": req.messages, "tools": req.tools, "chat_template_kwargs": req.chat_template_kwargs}
        chat = parse(ChatCompletionRequest, {"model": state.model_name, **fields})
        chat.check_supported()
        opening = {"add_generation_prompt": req.add_generation_prompt is not False}
        opening["continue_final_message"] = bool(req.continue_final_message)
    special = req.add_special_tokens is not False
    ids = await encode(state, chat, req.prompt, "prompt" if chat is None else "messages", special, opening)
    strs = state.engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return JSONResponse(
        {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids, "token_strs": strs}
    )


async def detokenize(request: Request) -> Response:
    state, body, _ = await authorized_json(request)
    req = parse(DetokenizeRequest, body)
    check_model(state, req.model)
    state.require_ready()
    try:
        text = await state.engine.decode(req.tokens)
    except Exception as exc:
        raise from_engine(exc, prompt_param="tokens", retry_after=state.settings.retry_after_seconds) from None
    return JSONResponse({"prompt": text})


API_ROUTES = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
    Route("/v1/messages", create_message, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
]
