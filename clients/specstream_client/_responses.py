"""client.responses (the OpenAI Responses API, POST /v1/responses) on Client and AsyncClient alike:
create (a Response, or with stream=True its typed events), stream (the events, with the final
Response once read), retrieve and delete (stored responses)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from typing import TYPE_CHECKING
from urllib.parse import quote

from specstream_client._exceptions import APIError
from specstream_client.types import Response, ResponseEvent

if TYPE_CHECKING:
    from specstream_client._client import AsyncClient, Client

# A streamed response ends with one of these (no "data: [DONE]" follows).
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponseStream:
    """The typed events of one streamed response; a with-block or close() ends it early."""

    def __init__(self, payloads: Generator[dict, None, None]) -> None:
        self._payloads = payloads
        self.final: Response | None = None

    def __iter__(self) -> Iterator[ResponseEvent]:
        for payload in self._payloads:
            event = ResponseEvent.parse(payload)
            if event.type in TERMINAL:
                self.final = event.response
            yield event

    def text_deltas(self) -> Iterator[str]:
        """Only the output text, as it arrives."""
        for event in self:
            if event.type == "response.output_text.delta":
                yield event.delta or ""

    def get_final_response(self) -> Response:
        """Reads the rest of the stream; the response its last event carries."""
        for _ in self:
            pass
        if self.final is None:
            raise APIError("the stream ended without its final response")
        return self.final

    def close(self) -> None:
        self._payloads.close()

    def __enter__(self) -> ResponseStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncResponseStream:
    def __init__(self, payloads: AsyncGenerator[dict, None]) -> None:
        self._payloads = payloads
        self.final: Response | None = None

    async def __aiter__(self) -> AsyncIterator[ResponseEvent]:
        async for payload in self._payloads:
            event = ResponseEvent.parse(payload)
            if event.type in TERMINAL:
                self.final = event.response
            yield event

    async def text_deltas(self) -> AsyncIterator[str]:
        async for event in self:
            if event.type == "response.output_text.delta":
                yield event.delta or ""

    async def get_final_response(self) -> Response:
        async for _ in self:
            pass
        if self.final is None:
            raise APIError("the stream ended without its final response")
        return self.final

    async def aclose(self) -> None:
        await self._payloads.aclose()

    async def __aenter__(self) -> AsyncResponseStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def _path(response_id: str) -> str:
    return "/responses/" + quote(response_id, safe="")


class Responses:
    def __init__(self, client: Client) -> None:
        self._client = client

    def create(
        self, *, model: str, input, stream: bool = False, timeout=None, extra_body: dict | None = None, **kw
    ) -> Response | ResponseStream:
        """A Response, or with stream=True a ResponseStream of its events. kw: the API's fields
        (instructions, max_output_tokens, tools, text, store, previous_response_id, ...)."""
        body = self._client.body({"model": model, "input": input, **kw}, extra_body)
        if stream:
            body["stream"] = True
            return ResponseStream(self._client._events("/responses", body, timeout, TERMINAL))
        return Response.parse(self._client._json("POST", "/responses", body, timeout))

    def stream(self, *, model: str, input, **kw) -> ResponseStream:
        """``with client.responses.stream(...) as s:`` iterate events, then s.get_final_response()."""
        stream = self.create(model=model, input=input, stream=True, **kw)
        assert isinstance(stream, ResponseStream)
        return stream

    def retrieve(self, response_id: str, timeout=None) -> Response:
        """A stored response (store=True); NotFoundError when unknown, expired or another key's."""
        return Response.parse(self._client._json("GET", _path(response_id), timeout=timeout))

    def delete(self, response_id: str, timeout=None) -> None:
        self._client._json("DELETE", _path(response_id), timeout=timeout)


class AsyncResponses:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(
        self, *, model: str, input, stream: bool = False, timeout=None, extra_body: dict | None = None, **kw
    ) -> Response | AsyncResponseStream:
        body = self._client.body({"model": model, "input": input, **kw}, extra_body)
        if stream:
            body["stream"] = True
            return AsyncResponseStream(self._client._events("/responses", body, timeout, TERMINAL))
        return Response.parse(await self._client._json("POST", "/responses", body, timeout))

    async def stream(self, *, model: str, input, **kw) -> AsyncResponseStream:
        """``async with await client.responses.stream(...) as s:`` as Responses.stream."""
        stream = await self.create(model=model, input=input, stream=True, **kw)
        assert isinstance(stream, AsyncResponseStream)
        return stream

    async def retrieve(self, response_id: str, timeout=None) -> Response:
        return Response.parse(await self._client._json("GET", _path(response_id), timeout=timeout))

    async def delete(self, response_id: str, timeout=None) -> None:
        await self._client._json("DELETE", _path(response_id), timeout=timeout)
