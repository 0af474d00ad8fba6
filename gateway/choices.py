"""The engine streams behind one HTTP request, one per choice, read as one merged stream.

Each stream is primed to its first chunk before the response starts, so that errors at
admission (validation, a full queue) become HTTP errors rather than stream errors. close()
ends every stream on every exit path (finished, failed, cancelled, or a response that was
never sent): closing a stream aborts its request in the engine and frees its KV."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from specstream import AsyncEngine, SamplingParams, StreamChunk

_END = object()  # a pump's last item: its choice has no more chunks


class Choices:
    def __init__(self, streams: list[AsyncGenerator[StreamChunk, None]]) -> None:
        self._streams = streams
        self._first: list[StreamChunk | None] = [None] * len(streams)
        self._pumps: list[asyncio.Task] = []
        self._closed = False

    def __len__(self) -> int:
        return len(self._streams)

    @classmethod
    async def open(cls, engine: AsyncEngine, jobs: Sequence[tuple[object, SamplingParams]], request_id: str) -> Choices:
        """Start one engine stream per (prompt, params) and wait for each first chunk;
        raises the first stream's error after closing them all."""
        choices = cls(
            [engine.stream(prompt, params, request_id=f"{request_id}-{i}") for i, (prompt, params) in enumerate(jobs)]
        )
        try:
            results = await asyncio.gather(*(choices._prime(i) for i in range(len(choices))), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                raise errors[0]
        except BaseException:
            await choices.close()
            raise
        return choices

    def prompt_tokens(self, index: int) -> int:
        """The prompt's length in tokens, known from the choice's first chunk."""
        first = self._first[index]
        return len(first.prompt_token_ids or []) if first is not None else 0

    async def _prime(self, index: int) -> None:
        self._first[index] = await anext(self._streams[index])

    async def _chunks(self, index: int) -> AsyncIterator[StreamChunk]:
        first = self._first[index]
        assert first is not None, "open() primes every stream"
        yield first
        if not first.finished:
            async for chunk in self._streams[index]:
                yield chunk

    async def merged(self) -> AsyncIterator[tuple[int, StreamChunk]]:
        """(choice index, chunk) as chunks arrive from any choice; raises the first error
        of any stream. Read it once; close() ends it."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for chunk in self._chunks(index):
                    await queue.put((index, chunk))
            except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
                await queue.put((index, exc))
            finally:
                await queue.put((index, _END))

        self._pumps = [asyncio.create_task(pump(i)) for i in range(len(self))]
        open_streams = len(self)
        while open_streams:
            index, item = await queue.get()
            if item is _END:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    async def close(self) -> None:
        """Idempotent. Pumps are cancelled first: a stream cannot be closed while a pump is
        suspended inside it, and cancelling the pump runs the stream's own cleanup."""
        if self._closed:
            return
        self._closed = True
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        await asyncio.gather(*(stream.aclose() for stream in self._streams), return_exceptions=True)
