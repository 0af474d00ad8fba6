"""Client and AsyncClient: twins over BaseClient, each with chat.completions, completions,
responses (_responses.py) and models. Streams are iterators of typed chunks that close their
HTTP response when the consumer stops early (close()/aclose(), a with-block, or leaving the loop)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator

import httpx

from specstream_client._base import BaseClient
from specstream_client._exceptions import APIConnectionError
from specstream_client._responses import AsyncResponses, Responses
from specstream_client._sse import DONE, aiter_payloads, decode_payload, iter_payloads
from specstream_client.types import ChatCompletion, ChatCompletionChunk, Completion, Model


class StreamEnd:
    """Tells a finished stream from a dropped one when the body ends: "data: [DONE]" is the
    OpenAI convention, but some servers close right after the last choice's finish_reason
    (or the usage chunk), which counts as complete too; a typed-event stream (the Responses
    API) is complete once an event of a terminal type came."""

    def __init__(self, terminal: frozenset[str] = frozenset()) -> None:
        self.open: set[int] = set()
        self.finished = False
        self.terminal = terminal

    def see(self, payload: dict) -> None:
        if payload.get("type") in self.terminal:
            self.finished = True
        for choice in payload.get("choices") or []:
            index = choice.get("index", 0)
            if choice.get("finish_reason"):
                self.open.discard(index)
                self.finished = True
            else:
                self.open.add(index)
        if payload.get("usage") and not payload.get("choices"):
            self.open.clear()
            self.finished = True

    def check(self) -> None:
        if not self.finished or self.open:
            raise APIConnectionError("the stream ended before it was complete ([DONE], or its last event)")


def _chat_params(model, messages, kw) -> dict:
    return {"model": model, "messages": messages, **kw}


class Stream:
    """Typed chunks of one streamed response."""

    def __init__(self, payloads: Generator[dict, None, None], parse) -> None:
        self._payloads = payloads
        self._parse = parse

    def __iter__(self):
        for payload in self._payloads:
            yield self._parse(payload)

    def close(self) -> None:
        self._payloads.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStream:
    def __init__(self, payloads: AsyncGenerator[dict, None], parse) -> None:
        self._payloads = payloads
        self._parse = parse

    async def __aiter__(self):
        async for payload in self._payloads:
            yield self._parse(payload)

    async def aclose(self) -> None:
        await self._payloads.aclose()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


# ------------------------------------------------------------------------------ sync
class Client(BaseClient):
    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        transport: httpx.BaseTransport | None = None,
        **kw,
    ) -> None:
        super().__init__(base_url, api_key, **kw)
        self._http = httpx.Client(
            base_url=self.base_url, headers=self.headers, timeout=self.timeout, transport=transport
        )
        self.chat = _Chat(_ChatCompletions(self))
        self.completions = _Completions(self)
        self.responses = Responses(self)
        self.models = _Models(self)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, method: str, path: str, body: dict | None, timeout, stream: bool) -> httpx.Response:
        attempt = 0
        while True:
            try:
                request = self._http.build_request(method, path, json=body, timeout=self.request_timeout(timeout))
                response = self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if self.should_retry(attempt, exc=exc):
                    time.sleep(self.retry_delay(attempt))
                    attempt += 1
                    continue
                raise self.transport_error(exc) from exc
            if response.status_code < 400:
                return response
            response.read()
            response.close()
            if self.should_retry(attempt, status=response.status_code):
                time.sleep(self.retry_delay(attempt, response))
                attempt += 1
                continue
            raise self.status_error(response)

    def _json(self, method: str, path: str, body: dict | None = None, timeout=None) -> dict:
        return self.json_body(self._send(method, path, body, timeout, stream=False))

    def _events(self, path: str, body: dict, timeout=None, terminal=frozenset()) -> Generator[dict, None, None]:
        response = self._send("POST", path, body, timeout, stream=True)
        ended = StreamEnd(terminal)
        try:
            for event in iter_payloads(response.iter_lines()):
                payload = decode_payload(event)
                if payload is DONE:
                    return
                ended.see(payload)
                yield payload
            ended.check()
        except httpx.TransportError as exc:
            raise self.transport_error(exc) from exc
        finally:
            response.close()


class _Chat:
    def __init__(self, completions) -> None:
        self.completions = completions


class _ChatCompletions:
    def __init__(self, client: Client) -> None:
        self._client = client

    def create(
        self,
        *,
        model: str,
        messages: list[dict],
        stream: bool = False,
        timeout=None,
        extra_body: dict | None = None,
        **kw,
    ):
        """A ChatCompletion, or with stream=True a Stream of ChatCompletionChunk."""
        body = self._client.body(_chat_params(model, messages, kw), extra_body)
        if stream:
            body["stream"] = True
            return Stream(self._client._events("/chat/completions", body, timeout), ChatCompletionChunk.parse)
        return ChatCompletion.parse(self._client._json("POST", "/chat/completions", body, timeout))

    def stream_text(self, *, model: str, messages: list[dict], **kw) -> Iterator[str]:
        """Only the text deltas of choice 0."""
        with self.create(model=model, messages=messages, stream=True, **kw) as stream:
            for chunk in stream:
                for choice in chunk.choices:
                    if choice.index == 0 and choice.delta.content:
                        yield choice.delta.content


class _Completions:
    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, *, model: str, prompt, stream: bool = False, timeout=None, extra_body: dict | None = None, **kw):
        body = self._client.body({"model": model, "prompt": prompt, **kw}, extra_body)
        if stream:
            body["stream"] = True
            return Stream(self._client._events("/completions", body, timeout), Completion.parse)
        return Completion.parse(self._client._json("POST", "/completions", body, timeout))


class _Models:
    def __init__(self, client: Client) -> None:
        self._client = client

    def list(self, timeout=None) -> list[Model]:
        return [Model.parse(m) for m in self._client._json("GET", "/models", timeout=timeout).get("data", [])]


# ----------------------------------------------------------------------------- async
class AsyncClient(BaseClient):
    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        **kw,
    ) -> None:
        super().__init__(base_url, api_key, **kw)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self.headers, timeout=self.timeout, transport=transport
        )
        self.chat = _Chat(_AsyncChatCompletions(self))
        self.completions = _AsyncCompletions(self)
        self.responses = AsyncResponses(self)
        self.models = _AsyncModels(self)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _send(self, method: str, path: str, body: dict | None, timeout, stream: bool) -> httpx.Response:
        attempt = 0
        while True:
            try:
                request = self._http.build_request(method, path, json=body, timeout=self.request_timeout(timeout))
                response = await self._http.send(request, stream=stream)
            except httpx.TransportError as exc:
                if self.should_retry(attempt, exc=exc):
                    await asyncio.sleep(self.retry_delay(attempt))
                    attempt += 1
                    continue
                raise self.transport_error(exc) from exc
            if response.status_code < 400:
                return response
            await response.aread()
            await response.aclose()
            if self.should_retry(attempt, status=response.status_code):
                await asyncio.sleep(self.retry_delay(attempt, response))
                attempt += 1
                continue
            raise self.status_error(response)

    async def _json(self, method: str, path: str, body: dict | None = None, timeout=None) -> dict:
        return self.json_body(await self._send(method, path, body, timeout, stream=False))

    async def _events(self, path: str, body: dict, timeout=None, terminal=frozenset()) -> AsyncGenerator[dict, None]:
        response = await self._send("POST", path, body, timeout, stream=True)
        ended = StreamEnd(terminal)
        try:
            async for event in aiter_payloads(response.aiter_lines()):
                payload = decode_payload(event)
                if payload is DONE:
                    return
                ended.see(payload)
                yield payload
            ended.check()
        except httpx.TransportError as exc:
            raise self.transport_error(exc) from exc
        finally:
            await response.aclose()


class _AsyncChatCompletions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(
        self,
        *,
        model: str,
        messages: list[dict],
        stream: bool = False,
        timeout=None,
        extra_body: dict | None = None,
        **kw,
    ):
        body = self._client.body(_chat_params(model, messages, kw), extra_body)
        if stream:
            body["stream"] = True
            return AsyncStream(self._client._events("/chat/completions", body, timeout), ChatCompletionChunk.parse)
        return ChatCompletion.parse(await self._client._json("POST", "/chat/completions", body, timeout))

    async def stream_text(self, *, model: str, messages: list[dict], **kw) -> AsyncIterator[str]:
        stream = await self.create(model=model, messages=messages, stream=True, **kw)
        async with stream:
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.index == 0 and choice.delta.content:
                        yield choice.delta.content


class _AsyncCompletions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(
        self, *, model: str, prompt, stream: bool = False, timeout=None, extra_body: dict | None = None, **kw
    ):
        body = self._client.body({"model": model, "prompt": prompt, **kw}, extra_body)
        if stream:
            body["stream"] = True
            return AsyncStream(self._client._events("/completions", body, timeout), Completion.parse)
        return Completion.parse(await self._client._json("POST", "/completions", body, timeout))


class _AsyncModels:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self, timeout=None) -> list[Model]:
        return [Model.parse(m) for m in (await self._client._json("GET", "/models", timeout=timeout)).get("data", [])]
