"""The OpenAI-compatible HTTP app: ``create_app(engine, settings) -> Starlette``.

Endpoints are plain ``async def f(request)``; all state lives in the closure of
create_app (no globals), so tests build an app around any AsyncEngine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import tools as tool_format
from gateway.errors import APIError
from gateway.protocol import ChatCompletionRequest, CompletionRequest, parse
from gateway.settings import GatewaySettings
from gateway.tokens import TokenBytes
from specstream import (
    AsyncEngine,
    EngineDeadError,
    InvalidRequestError,
    QueueFull,
    RequestFailed,
    SamplingParams,
    StreamChunk,
)

log = logging.getLogger("specstream.gateway")


def _reject_constant(name: str):
    raise APIError(400, f"invalid JSON number {name}: NaN and Infinity are not allowed")


def _map_engine_error(exc: BaseException, settings: GatewaySettings) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), code="queue_full", headers={"Retry-After": str(settings.retry_after_seconds)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    if isinstance(exc, RequestFailed):
        return APIError(500, str(exc), code="request_failed")
    return APIError(500, f"internal error: {type(exc).__name__}")


class _Choice:
    """One choice (one engine sequence) of a request, primed to its first chunk so that
    errors before generation become HTTP errors rather than stream errors."""

    def __init__(self, index: int, stream: AsyncIterator[StreamChunk]) -> None:
        self.index = index
        self.stream = stream
        self.first: StreamChunk | None = None

    async def prime(self) -> None:
        self.first = await self.stream.__anext__()

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        yield self.first
        if not self.first.finished:
            async for chunk in self.stream:
                yield chunk

    async def close(self) -> None:
        await self.stream.aclose()


def create_app(engine: AsyncEngine, settings: GatewaySettings | None = None) -> Starlette:
    settings = settings or GatewaySettings()
    keys = [k.encode() for k in settings.api_keys]
    started = time.time()

    def model_name() -> str:
        return settings.served_model_name or engine.config.model

    def engine_method() -> str:
        spec = engine.config.speculative
        return spec.method if spec.enabled else "off"

    # ------------------------------------------------------------- request plumbing
    def authorize(request: Request) -> None:
        if not keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        given = token.strip().encode()
        # Compare against every key so the time does not tell which one came close.
        matched = False
        for key in keys:
            matched |= hmac.compare_digest(given, key)
        if not matched:
            raise APIError(401, "incorrect API key provided", code="invalid_api_key")

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            raise APIError(413, f"request body exceeds {settings.max_body_bytes} bytes", code="request_too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > settings.max_body_bytes:
                raise APIError(413, f"request body exceeds {settings.max_body_bytes} bytes", code="request_too_large")
        try:
            return json.loads(body, parse_constant=_reject_constant)
        except APIError:
            raise
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise APIError(400, f"the request body is not valid JSON: {type(exc).__name__}: {exc}"[:300]) from None

    def check_ready() -> None:
        if not engine.is_ready:
            raise APIError(503, "the model is still loading", code="model_not_ready", headers={"Retry-After": "5"})
        if not engine.is_healthy:
            raise APIError(503, "the engine is unhealthy", code="engine_unavailable")

    def check_common(req) -> None:
        req.check_supported()
        if req.model != model_name():
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves '{model_name()}'", param="model", code="model_not_found")
        if req.n > settings.max_n:
            raise APIError(400, f"n must be at most {settings.max_n}", param="n")
        if len(req.stops) > settings.max_stop:
            raise APIError(400, f"at most {settings.max_stop} stop sequences are allowed", param="stop")

    def check_max_tokens(max_tokens: int | None) -> None:
        limit = engine.engine.max_model_len
        if max_tokens is not None and max_tokens >= limit:
            raise APIError(400, f"max_tokens must be below this model's context of {limit} tokens", param="max_tokens", code="context_length_exceeded")

    def sampling(req, **kw) -> SamplingParams:
        try:
            return req.sampling_params(engine_method=engine_method(), **kw)
        except InvalidRequestError as exc:
            raise _map_engine_error(exc, settings) from None

    async def open_choices(prompts_params: list[tuple[object, SamplingParams]], request_id: str) -> list[_Choice]:
        choices = [_Choice(i, engine.stream(p, sp, request_id=f"{request_id}-{i}")) for i, (p, sp) in enumerate(prompts_params)]
        try:
            results = await asyncio.gather(*(c.prime() for c in choices), return_exceptions=True)
        except BaseException:
            await close_all(choices)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await close_all(choices)
            raise _map_engine_error(errors[0], settings)
        return choices

    async def close_all(choices: list[_Choice]) -> None:
        await asyncio.gather(*(c.close() for c in choices), return_exceptions=True)

    async def until_disconnected(request: Request, work) -> Response:
        """Run work (a coroutine returning the response), cancelling it when the client
        goes away first; cancelling aborts its engine streams."""
        task = asyncio.ensure_future(work)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(disconnected())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the handler itself was cancelled (shutdown): take the work along
            task.cancel()
            raise
        finally:
            watcher.cancel()
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        return Response(status_code=499)  # nobody is listening any more

    async def merged(choices: list[_Choice]) -> AsyncIterator[tuple[int, StreamChunk | BaseException]]:
        """Chunks of every choice as they arrive; closing this closes every stream."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: _Choice) -> None:
            try:
                async for chunk in choice.chunks():
                    await queue.put((choice.index, chunk))
            except Exception as exc:  # noqa: BLE001 - forwarded to the client as an error event
                await queue.put((choice.index, exc))
            finally:
                await queue.put((choice.index, None))

        tasks = [asyncio.create_task(pump(c)) for c in choices]
        try:
            open_ = len(choices)
            while open_:
                index, item = await queue.get()
                if item is None:
                    open_ -= 1
                    continue
                yield index, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await close_all(choices)

    def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}

    token_bytes: list[TokenBytes] = []  # built on first use, once the tokenizer is loaded

    def chat_logprobs(chunk: StreamChunk, tokenizer) -> list[dict]:
        if not token_bytes:
            token_bytes.append(TokenBytes(tokenizer))

        def entry(token_id: int, logprob: float) -> dict:
            text, raw = token_bytes[0](token_id)
            return {"token": text, "logprob": logprob, "bytes": raw}

        return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in chunk.logprobs or []]

    def add_stats(pending: dict, chunk: StreamChunk) -> dict:
        """Per-choice speculative stats; a round whose text is held back (an unfinished
        character or a possible stop string) rides on the next chunk that is sent."""
        pending["drafted"] = pending.get("drafted", 0) + chunk.num_drafted
        pending["accepted"] = pending.get("accepted", 0) + chunk.num_accepted
        pending["tokens"] = pending.get("tokens", 0) + len(chunk.token_ids)
        if chunk.num_forced:  # [structured] drafts a grammar forced (counted in drafted too)
            pending["forced"] = pending.get("forced", 0) + chunk.num_forced
        return pending

    # -------------------------------------------------------------------- endpoints
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        req = parse(ChatCompletionRequest, await read_json(request))
        check_common(req)
        check_ready()
        max_tokens = req.requested_max_tokens
        check_max_tokens(max_tokens)
        messages = req.chat_messages()
        params = [
            sampling(req, max_tokens=max_tokens, logprobs=req.logprobs_count, seed_offset=i)
            for i in range(req.n)
        ]
        return await until_disconnected(request, respond_chat(req, messages, params))

    async def respond_chat(req: ChatCompletionRequest, messages: list[dict], params: list[SamplingParams]) -> Response:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        choices = await open_choices([(messages, p) for p in params], request_id)
        created = int(time.time())
        model = model_name()
        tokenizer = engine.engine.tokenizer
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventSourceResponse(
                chat_events(choices, request_id, created, model, include_usage, req.logprobs, tokenizer, req.tool_mode),
                ping=15,
                send_timeout=30,
            )
        texts = [[] for _ in choices]
        lps = [[] for _ in choices]
        finish = [None] * len(choices)
        prompt_tokens = completion_tokens = 0
        async with contextlib.aclosing(merged(choices)) as chunks:
            async for index, item in chunks:
                if isinstance(item, BaseException):
                    raise _map_engine_error(item, settings)
                texts[index].append(item.text)
                if req.logprobs:
                    lps[index] += chat_logprobs(item, tokenizer)
                if item.finished:
                    finish[index] = item.finish_reason
                    prompt_tokens = item.usage.prompt_tokens
                    completion_tokens += item.usage.completion_tokens
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": i,
                    "message": (message := tool_format.assistant_message("".join(texts[i]), req.tool_mode)),  # [structured]
                    "logprobs": {"content": lps[i], "refusal": None} if req.logprobs else None,
                    "finish_reason": tool_format.finish_reason(finish[i], "tool_calls" in message),
                }
                for i in range(len(choices))
            ],
            "usage": usage_dict(prompt_tokens, completion_tokens),
        }
        return JSONResponse(body)

    async def chat_events(choices, request_id, created, model, include_usage, want_logprobs, tokenizer, tool_mode=None):
        try:
            base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}

            def event(choice_list: list, usage: dict | None = None) -> dict:
                payload = {**base, "choices": choice_list}
                if include_usage:
                    payload["usage"] = usage
                return {"data": json.dumps(payload, ensure_ascii=False)}

            prompt_tokens = completion_tokens = 0
            stats = {c.index: {} for c in choices}
            parsers = {c.index: tool_format.parser_for(tool_mode) for c in choices}  # [structured] tool-call deltas
            for c in choices:
                yield event([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            async with contextlib.aclosing(merged(choices)) as chunks:
                async for index, item in chunks:
                    if isinstance(item, BaseException):
                        err = _map_engine_error(item, settings)
                        yield {"data": json.dumps(err.body())}
                        return
                    add_stats(stats[index], item)
                    parser = parsers[index]
                    if parser is None:
                        deltas = [{"content": item.text}] if item.text or item.logprobs else []
                    else:  # [structured] content or tool-call deltas
                        deltas = parser.feed(item.text) + (parser.finish() if item.finished else [])
                        if not deltas and item.logprobs:
                            deltas = [{"content": ""}]
                    for n, delta in enumerate(deltas):
                        yield event(
                            [
                                {
                                    "index": index,
                                    "delta": delta,
                                    "logprobs": {"content": chat_logprobs(item, tokenizer), "refusal": None} if want_logprobs and not n else None,
                                    "finish_reason": None,
                                    "speculative": stats[index],
                                }
                            ]
                        )
                        stats[index] = {}
                    if item.finished:
                        prompt_tokens = item.usage.prompt_tokens
                        completion_tokens += item.usage.completion_tokens
                        reason = tool_format.finish_reason(item.finish_reason, parser is not None and bool(parser.calls))
                        final = {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
                        if stats[index]:
                            final["speculative"] = stats[index]
                        yield event([final])
            if include_usage:
                yield event([], usage_dict(prompt_tokens, completion_tokens))
            yield {"data": "[DONE]"}
        finally:
            await close_all(choices)

    async def completions(request: Request) -> Response:
        authorize(request)
        req = parse(CompletionRequest, await read_json(request))
        check_common(req)
        check_ready()
        check_max_tokens(req.max_tokens)
        prompts = req.prompts()
        if len(prompts) * req.n > settings.max_n:
            raise APIError(400, f"at most {settings.max_n} completions per request (prompts x n)", param="prompt")
        jobs = [(prompt, sampling(req, max_tokens=req.max_tokens, logprobs=req.logprobs, seed_offset=j)) for prompt in prompts for j in range(req.n)]
        return await until_disconnected(request, respond_completion(req, jobs))

    async def respond_completion(req: CompletionRequest, jobs: list) -> Response:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        choices = await open_choices(jobs, request_id)
        created = int(time.time())
        base = {"id": request_id, "object": "text_completion", "created": created, "model": model_name()}
        tokenizer = engine.engine.tokenizer
        offsets = [0] * len(choices)  # per choice: characters of completion text so far
        prompt_tokens: dict[int, int] = {}

        def logprobs_block(index: int, chunk: StreamChunk) -> dict | None:
            """The completions API's logprobs for one chunk; text_offset counts from the
            start of the completion."""
            if req.logprobs is None:
                return None
            lps = chunk.logprobs or []
            tokens = [tokenizer.decode([lp.token_id]) for lp in lps]
            starts = []
            for t in tokens:
                starts.append(offsets[index])
                offsets[index] += len(t)
            return {
                "tokens": tokens,
                "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{tokenizer.decode([t]): v for t, v in lp.top} for lp in lps],
                "text_offset": starts,
            }

        def finished(index: int, chunk: StreamChunk) -> int:
            prompt_tokens[index // req.n] = chunk.usage.prompt_tokens
            return chunk.usage.completion_tokens

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def events():
                completion_tokens = 0
                try:
                    async with contextlib.aclosing(merged(choices)) as chunks:
                        async for index, item in chunks:
                            if isinstance(item, BaseException):
                                yield {"data": json.dumps(_map_engine_error(item, settings).body())}
                                return
                            choice = {
                                "index": index,
                                "text": item.text,
                                "logprobs": logprobs_block(index, item),
                                "finish_reason": item.finish_reason,
                                "speculative": add_stats({}, item),
                            }
                            payload = {**base, "choices": [choice]}
                            if include_usage:
                                payload["usage"] = None
                            yield {"data": json.dumps(payload, ensure_ascii=False)}
                            if item.finished:
                                completion_tokens += finished(index, item)
                    if include_usage:
                        usage = usage_dict(sum(prompt_tokens.values()), completion_tokens)
                        yield {"data": json.dumps({**base, "choices": [], "usage": usage})}
                    yield {"data": "[DONE]"}
                finally:
                    await close_all(choices)

            return EventSourceResponse(events(), ping=15, send_timeout=30)

        texts = [[] for _ in choices]
        blocks: list[list[dict]] = [[] for _ in choices]
        finish = [None] * len(choices)
        completion_tokens = 0
        async with contextlib.aclosing(merged(choices)) as chunks:
            async for index, item in chunks:
                if isinstance(item, BaseException):
                    raise _map_engine_error(item, settings)
                texts[index].append(item.text)
                if req.logprobs is not None:
                    blocks[index].append(logprobs_block(index, item))
                if item.finished:
                    finish[index] = item.finish_reason
                    completion_tokens += finished(index, item)

        def joined(parts: list[dict]) -> dict | None:
            if req.logprobs is None:
                return None
            return {k: [x for b in parts for x in b[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}

        return JSONResponse(
            {
                **base,
                "choices": [
                    {"index": i, "text": "".join(texts[i]), "logprobs": joined(blocks[i]), "finish_reason": finish[i]}
                    for i in range(len(choices))
                ],
                "usage": usage_dict(sum(prompt_tokens.values()), completion_tokens),
            }
        )

    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model_detail(request: Request) -> Response:
        authorize(request)
        if request.path_params["model"] != model_name():
            raise APIError(404, f"the model '{request.path_params['model']}' does not exist", param="model", code="model_not_found")
        return JSONResponse(model_card())

    def model_card() -> dict:
        return {"id": model_name(), "object": "model", "created": int(started), "owned_by": "specstream"}

    async def health(request: Request) -> Response:
        if engine.is_healthy:
            return JSONResponse({"status": "ok", "model": model_name()})
        status = "unhealthy" if engine.is_ready else "loading"
        return JSONResponse({"status": status}, status_code=503)

    async def metrics(request: Request) -> Response:
        if engine.engine is None:
            raise APIError(503, "the model is still loading", code="model_not_ready")
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # --------------------------------------------------------------- error handlers
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = {404: f"no route {request.method} {request.url.path}", 405: f"method {request.method} not allowed on {request.url.path}"}
        return APIError(exc.status_code, message.get(exc.status_code, exc.detail)).response()

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}").response()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        task = None
        if not engine.is_ready:
            # Load in the background so /health answers 503 while the model loads.
            task = asyncio.create_task(engine.start())
            task.add_done_callback(_log_start)
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            await engine.stop()

    def _log_start(task: asyncio.Task) -> None:
        if task.cancelled():
            return
        if task.exception() is not None:
            log.error("the engine failed to start: %s", task.exception())
        else:
            log.info("model '%s' loaded; serving as '%s'", engine.config.model, model_name())

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model_detail, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan,
    )
