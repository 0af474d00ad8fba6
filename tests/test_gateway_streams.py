"""The engine streams behind an HTTP response are closed on every exit path, at once and
without waiting for garbage collection: here, an SSE response whose client is gone before
its body generator yields anything (sse-starlette then cancels the generator, whose own
finally would never run)."""

from __future__ import annotations

import asyncio
import time

from gateway.choices import Choices
from gateway.serving import ChoiceStreamResponse
from specstream import AsyncEngine, EngineConfig, SamplingParams, SpeculativeConfig

CHAT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "http_version": "1.1"}


async def wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.num_running or engine.num_waiting or engine.kv_usage:
        assert time.monotonic() < deadline, "the engine streams were not aborted"
        await asyncio.sleep(0.01)


async def test_an_sse_response_whose_client_left_before_the_first_event_aborts_its_requests(tiny_model_dir):
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", speculative=SpeculativeConfig(method="off"))
    params = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    async with AsyncEngine(config) as engine:
        choices = await Choices.open(engine, [(CHAT, params), (CHAT, params)], "req")
        never = asyncio.Event()

        async def events():
            await never.wait()  # the body never gets to its first event
            yield {"data": "unreachable"}

        body = events()  # held here, so nothing is finalized by garbage collection
        sent = []

        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message["type"])

        await asyncio.wait_for(ChoiceStreamResponse(body, choices)(SCOPE, receive, send), timeout=10)
        await wait_idle(engine)
        assert "http.response.body" not in sent
        await choices.close()  # closing again is harmless
