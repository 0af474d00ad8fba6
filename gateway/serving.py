"""OpenAIServing: what chat and text completions share. A request becomes engine jobs, its
choices are opened, and ONE path, deltas(), turns engine chunks into per-choice deltas that
full() collects into a JSON body and stream() sends as server-sent events.

ServingChat and ServingCompletion (their own modules) supply only the endpoint's shapes:
its logprobs entries, a choice of the full body, and the choices of a streamed chunk."""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import ClassVar

import anyio
from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.cancellation import with_cancellation
from gateway.choices import Choices
from gateway.errors import APIError, from_engine, quoted
from gateway.state import ServingState
from specstream import SamplingParams, StreamChunk, Usage


def add_stats(into: dict, stats: dict) -> None:
    """Add a delta's speculative counts into a running total (the rounds by method included)."""
    for key, value in stats.items():
        if isinstance(value, dict):
            add_stats(into.setdefault(key, {}), value)
        else:
            into[key] = into.get(key, 0) + value


def zero_stats(stats: dict) -> dict:
    """The same keys with nothing counted."""
    return {key: {} if isinstance(value, dict) else 0 for key, value in stats.items()}


@dataclass
class Delta:
    """What one engine chunk adds to one choice, in the endpoint's terms."""

    index: int
    text: str
    logprobs: list  # per-token entries in the endpoint's shape (empty unless asked for)
    finish_reason: str | None
    speculative: dict  # drafted/accepted/tokens since the previous delta of this choice
    stop_string: str | None = None  # on the finishing delta: the stop string that ended the choice, if one did


class UsageCount:
    """Usage of a request: prompt tokens once per prompt (its n choices share it),
    completion tokens summed over choices."""

    def __init__(self, choices_per_prompt: int) -> None:
        self.choices_per_prompt = choices_per_prompt
        self.prompts: dict[int, Usage] = {}
        self.completion_tokens = 0
        self.prediction_tokens = [0, 0]  # accepted, rejected (predicted outputs)

    def add(self, index: int, usage: Usage | None) -> None:
        if usage is not None:
            self.prompts[index // self.choices_per_prompt] = usage
            self.completion_tokens += usage.completion_tokens
            self.prediction_tokens[0] += usage.accepted_prediction_tokens
            self.prediction_tokens[1] += usage.rejected_prediction_tokens

    def body(self) -> dict:
        prompt_tokens = sum(u.prompt_tokens for u in self.prompts.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in self.prompts.values())},
            "completion_tokens_details": {
                "accepted_prediction_tokens": self.prediction_tokens[0],
                "rejected_prediction_tokens": self.prediction_tokens[1],
            },
        }


class ChoiceStreamResponse(EventSourceResponse):
    """An SSE response that closes its choices however it ends. sse-starlette may cancel
    the body generator before it starts (a generator's finally then never runs), so the
    close lives here, around the whole response, shielded from that cancellation."""

    def __init__(self, events: AsyncIterator[dict], choices: Choices) -> None:
        super().__init__(events, ping=15, send_timeout=30)
        self.choices = choices

    async def close_streams(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.choices.close()

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close_streams()


class OpenAIServing(ABC):
    object_full: ClassVar[str]
    object_chunk: ClassVar[str]
    id_prefix: ClassVar[str]
    prompt_param: ClassVar[str]  # the request field that holds the prompt

    def __init__(self, state: ServingState, req, prompts: list, choices_per_prompt: int) -> None:
        self.state = state
        self.req = req
        self.prompts = prompts
        self.choices_per_prompt = choices_per_prompt
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.usage = UsageCount(choices_per_prompt)
        self.include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)

    # ------------------------------------------------------------- endpoint hooks
    @property
    @abstractmethod
    def max_tokens(self) -> int | None: ...

    @property
    @abstractmethod
    def logprobs(self) -> int | None:
        """The engine's logprobs parameter: None = none, k = the token's and k alternatives."""

    @abstractmethod
    def logprob_entries(self, index: int, chunk: StreamChunk) -> list:
        """This chunk's tokens as the endpoint's per-token logprobs entries."""

    @abstractmethod
    def choice_body(self, index: int, text: str, logprobs: list, finish_reason: str | None) -> dict:
        """One choice of the full (non-streamed) response."""

    @abstractmethod
    def chunk_choices(self, delta: Delta) -> list[dict]:
        """The choices of the streamed chunks that carry one delta (one chunk each)."""

    def opening_choices(self) -> list[dict]:
        """Choices to stream before any delta."""
        return []

    # --------------------------------------------------------------- validation
    def validate(self) -> list[tuple[object, SamplingParams]]:
        """Every check that needs no engine work, then the engine jobs: (prompt, params)
        per choice. Raises APIError; nothing has reached the engine yet."""
        req, settings, engine = self.req, self.state.settings, self.state.engine
        req.check_supported()
        if req.model != self.state.model_name:
            raise APIError(
                404,
                f"the model {quoted(req.model)} does not exist; this server serves {quoted(self.state.model_name)}",
                param="model",
                code="model_not_found",
            )
        num_choices = len(self.prompts) * self.choices_per_prompt
        if num_choices > settings.max_n:
            raise APIError(400, f"at most {settings.max_n} choices per request (prompts x n)", param="n")
        if len(req.stops) > settings.max_stop:
            raise APIError(400, f"at most {settings.max_stop} stop sequences are allowed", param="stop")
        self.state.require_ready()
        if num_choices > engine.max_waiting:
            # A 429 would invite retries that can never succeed.
            raise APIError(
                400, f"at most {engine.max_waiting} choices per request on this server (its queue limit)", param="n"
            )
        if self.max_tokens is not None and self.max_tokens >= engine.max_model_len:
            raise APIError(
                400,
                f"max_tokens must be below this model's context of {engine.max_model_len} tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        try:
            return [
                (
                    prompt,
                    req.sampling_params(
                        max_tokens=self.max_tokens,
                        logprobs=self.logprobs,
                        seed_offset=j,
                        engine_method=engine.speculative_method,
                    ),
                )
                for prompt in self.prompts
                for j in range(self.choices_per_prompt)
            ]
        except Exception as exc:
            raise self.error(exc) from None

    def error(self, exc: BaseException) -> APIError:
        return from_engine(exc, prompt_param=self.prompt_param, retry_after=self.state.settings.retry_after_seconds)

    # ----------------------------------------------------------------- responses
    async def create(self, request: Request) -> Response:
        jobs = self.validate()
        return await self.respond(request, jobs)

    @with_cancellation
    async def respond(self, request: Request, jobs: list[tuple[object, SamplingParams]]) -> Response:
        try:
            choices = await Choices.open(self.state.engine, jobs, self.request_id)
        except Exception as exc:
            raise self.error(exc) from None
        if self.req.stream:
            return ChoiceStreamResponse(self.events(choices), choices)
        return await self.full(choices)

    async def deltas(self, choices: Choices) -> AsyncIterator[Delta]:
        """The one path from engine chunks to deltas. A round whose text is held back (an
        unfinished character, a possible stop string) has its stats carried to the next
        delta of its choice; usage is counted as choices finish."""
        pending: dict[int, dict] = {}
        async for index, chunk in choices.merged():
            stats = pending.setdefault(index, {"drafted": 0, "accepted": 0, "tokens": 0})
            stats["drafted"] += chunk.num_drafted
            stats["accepted"] += chunk.num_accepted
            stats["tokens"] += len(chunk.token_ids)
            if chunk.num_forced:  # [structured] drafts a grammar forced (counted in drafted too)
                stats["forced"] = stats.get("forced", 0) + chunk.num_forced
            if chunk.method:  # which proposer drafted each round: rounds by method
                methods = stats.setdefault("methods", {})
                methods[chunk.method] = methods.get(chunk.method, 0) + 1
            entries = self.logprob_entries(index, chunk) if self.logprobs is not None else []
            if chunk.finished:
                self.usage.add(index, chunk.usage)
            if chunk.text or entries or chunk.finished:
                yield Delta(index, chunk.text, entries, chunk.finish_reason, pending.pop(index), chunk.stop_string)

    async def full(self, choices: Choices) -> Response:
        texts: list[list[str]] = [[] for _ in range(len(choices))]
        logprobs: list[list] = [[] for _ in range(len(choices))]
        finish: list[str | None] = [None] * len(choices)
        try:
            async for delta in self.deltas(choices):
                texts[delta.index].append(delta.text)
                logprobs[delta.index] += delta.logprobs
                finish[delta.index] = delta.finish_reason
        except Exception as exc:
            raise self.error(exc) from None
        finally:
            await choices.close()
        return JSONResponse(
            {
                **self._header(self.object_full),
                "choices": [
                    self.choice_body(i, "".join(texts[i]), logprobs[i], finish[i]) for i in range(len(choices))
                ],
                "usage": self.usage.body(),
            }
        )

    async def events(self, choices: Choices) -> AsyncIterator[dict]:
        for choice in self.opening_choices():
            yield self._event([choice])
        try:
            async for delta in self.deltas(choices):
                for choice in self.chunk_choices(delta):
                    yield self._event([choice])
        except Exception as exc:  # noqa: BLE001 - the status is sent: report it as an error event
            yield {"data": self.error(exc).json()}
            return
        if self.include_usage:
            yield self._event([], self.usage.body())
        yield {"data": "[DONE]"}

    def _header(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.state.model_name}

    def _event(self, choices: list[dict], usage: dict | None = None) -> dict:
        payload = {**self._header(self.object_chunk), "choices": choices}
        if self.include_usage:
            payload["usage"] = usage
        return {"data": json.dumps(payload, ensure_ascii=False)}
