"""The httpx SDK: SSE parsing, retries, timeouts and early close with httpx.MockTransport;
then the same calls against a live gateway."""

from __future__ import annotations

import json

import httpx
import pytest

import specstream_client
from specstream_client import AsyncClient, Client
from specstream_client._sse import SSEDecoder

CHAT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. The quick brown fox"}]


def chunk(content=None, finish=None, role=None, spec=None, usage=None, choices=True):
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    c = {"index": 0, "delta": delta, "finish_reason": finish}
    if spec:
        c["speculative"] = spec
    body = {
        "id": "c1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [c] if choices else [],
    }
    if usage:
        body["usage"] = usage
    return "data: " + json.dumps(body) + "\n\n"


class RecordingStream(httpx.SyncByteStream):
    def __init__(self, parts, fail_after=None):
        self.parts, self.fail_after, self.closed = parts, fail_after, False

    def __iter__(self):
        for i, p in enumerate(self.parts):
            if self.fail_after is not None and i == self.fail_after:
                raise httpx.ReadError("connection reset")
            yield p.encode()

    def close(self):
        self.closed = True


def make_client(handler, **kw) -> Client:
    return Client("http://test/v1", "sk-test", transport=httpx.MockTransport(handler), backoff=0.001, **kw)


COMPLETION = {
    "id": "x",
    "object": "chat.completion",
    "created": 5,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


# --------------------------------------------------------------------------- SSE parsing
def test_sse_decoder_joins_multiline_data_and_skips_comments():
    d = SSEDecoder()
    events = [d.feed(line) for line in [": keep-alive", "event: update", 'data: {"a":', "data: 1}", "id: 7", ""]]
    assert events[:-1] == [None] * 5
    assert events[-1].event == "update" and events[-1].data == '{"a":\n1}'


def test_stream_yields_typed_chunks_until_done():
    parts = [
        ": ping\n\n",
        chunk(role="assistant", content=""),
        chunk("Hel", spec={"drafted": 4, "accepted": 3, "tokens": 4}),
        'data: {"id":"c1","created":1,"model":"m",\n'
        'data: "choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}\n\n',
        chunk(finish="stop"),
        chunk(choices=False, usage={"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}),
        "data: [DONE]\n\n",
        chunk("never"),
    ]
    seen = []

    def handler(request):
        seen.append(request)
        return httpx.Response(200, stream=RecordingStream(parts), headers={"content-type": "text/event-stream"})

    with make_client(handler) as c:
        chunks = list(
            c.chat.completions.create(model="m", messages=CHAT, stream=True, stream_options={"include_usage": True})
        )
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Hello"
    assert chunks[1].choices[0].speculative == specstream_client.SpeculativeStats(4, 3, 4)
    assert chunks[-1].usage.completion_tokens == 3
    body = json.loads(seen[0].content)
    assert body["stream"] is True and seen[0].headers["authorization"] == "Bearer sk-test"
    assert str(seen[0].url) == "http://test/v1/chat/completions"


def test_error_event_mid_stream_raises():
    parts = [chunk("a"), 'data: {"error": {"message": "engine died", "type": "service_unavailable", "code": "x"}}\n\n']
    c = make_client(lambda r: httpx.Response(200, stream=RecordingStream(parts)))
    stream = c.chat.completions.create(model="m", messages=CHAT, stream=True)
    it = iter(stream)
    next(it)
    with pytest.raises(specstream_client.APIError, match="engine died"):
        next(it)


def test_malformed_data_raises():
    c = make_client(lambda r: httpx.Response(200, stream=RecordingStream(["data: {not json\n\n"])))
    with pytest.raises(specstream_client.APIError, match="malformed"):
        list(c.chat.completions.create(model="m", messages=CHAT, stream=True))


def test_dropped_connection_mid_stream_raises_and_is_not_retried():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(200, stream=RecordingStream([chunk("a"), chunk("b"), chunk("c")], fail_after=2))

    c = make_client(handler, max_retries=3)
    got = []
    with pytest.raises(specstream_client.APIConnectionError):
        for ch in c.chat.completions.create(model="m", messages=CHAT, stream=True):
            got.append(ch)
    assert len(got) == 2 and len(calls) == 1


def test_stream_ending_without_done_raises_unless_every_choice_finished():
    c = make_client(lambda r: httpx.Response(200, stream=RecordingStream([chunk("a")])))
    with pytest.raises(specstream_client.APIConnectionError, match="DONE"):
        list(c.chat.completions.create(model="m", messages=CHAT, stream=True))
    # Some servers close right after the final finish_reason without [DONE]: complete.
    c = make_client(lambda r: httpx.Response(200, stream=RecordingStream([chunk("a"), chunk(finish="stop")])))
    assert len(list(c.chat.completions.create(model="m", messages=CHAT, stream=True))) == 2


def event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: " + json.dumps({"type": kind, "sequence_number": 0, **fields}) + "\n\n"


def test_a_response_stream_is_complete_at_its_last_event_and_dropped_before_it():
    response = {"id": "resp_1", "status": "completed", "model": "m", "output": []}
    parts = [event("response.created", response=response), event("response.output_text.delta", delta="hi")]
    c = make_client(lambda r: httpx.Response(200, stream=RecordingStream(parts)))
    with pytest.raises(specstream_client.APIConnectionError):
        list(c.responses.create(model="m", input="x", stream=True))
    whole = parts + [event("response.completed", response=response)]
    c = make_client(lambda r: httpx.Response(200, stream=RecordingStream(whole)))
    with c.responses.stream(model="m", input="x") as stream:
        assert list(stream.text_deltas()) == ["hi"] and stream.get_final_response().id == "resp_1"
    error = event("error", code="request_failed", message="boom", param=None)
    c = make_client(lambda r: httpx.Response(200, stream=RecordingStream(parts[:1] + [error])))
    with pytest.raises(specstream_client.InternalServerError, match="boom"):
        list(c.responses.create(model="m", input="x", stream=True))


def test_early_close_closes_the_response():
    body = RecordingStream([chunk(str(i)) for i in range(50)] + ["data: [DONE]\n\n"])
    c = make_client(lambda r: httpx.Response(200, stream=body))
    with c.chat.completions.create(model="m", messages=CHAT, stream=True) as stream:
        for _ in stream:
            break
    assert body.closed


# ------------------------------------------------------------------------------- retries
def test_retries_5xx_then_succeeds():
    statuses = iter([503, 502, 200])

    def handler(request):
        s = next(statuses)
        return httpx.Response(s, json=COMPLETION if s == 200 else {"error": {"message": "busy"}})

    r = make_client(handler, max_retries=2).chat.completions.create(model="m", messages=CHAT)
    assert r.text == "hello" and r.usage.total_tokens == 4


def test_429_honours_retry_after(monkeypatch):
    sleeps = []
    monkeypatch.setattr("specstream_client._client.time.sleep", sleeps.append)
    statuses = iter([429, 200])

    def handler(request):
        s = next(statuses)
        return httpx.Response(
            s, json=COMPLETION if s == 200 else {"error": {"message": "full"}}, headers={"Retry-After": "3"}
        )

    make_client(handler).chat.completions.create(model="m", messages=CHAT)
    assert sleeps == [3.0]


def test_backoff_grows_exponentially_with_jitter():
    c = Client("http://x", backoff=1.0, max_backoff=100.0)
    delays = [c.retry_delay(a) for a in range(4)]
    assert all(0.75 * 2**a <= d <= 2**a for a, d in enumerate(delays))


def test_exhausted_retries_raise_rate_limit_error():
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(
            429,
            json={"error": {"message": "queue full", "type": "rate_limit_error", "code": "queue_full"}},
            headers={"Retry-After": "0"},
        )

    with pytest.raises(specstream_client.RateLimitError) as err:
        make_client(handler, max_retries=2).chat.completions.create(model="m", messages=CHAT)
    assert len(calls) == 3 and err.value.code == "queue_full" and err.value.status_code == 429


def test_connect_errors_are_retried_then_raised():
    calls = []

    def handler(request):
        calls.append(1)
        raise httpx.ConnectError("refused")

    with pytest.raises(specstream_client.APIConnectionError):
        make_client(handler, max_retries=2).models.list()
    assert len(calls) == 3


@pytest.mark.parametrize(
    "status, cls",
    [
        (400, specstream_client.BadRequestError),
        (401, specstream_client.AuthenticationError),
        (404, specstream_client.NotFoundError),
        (413, specstream_client.BadRequestError),
    ],
)
def test_client_errors_map_to_classes_and_are_not_retried(status, cls):
    calls = []

    def handler(request):
        calls.append(1)
        return httpx.Response(status, json={"error": {"message": "nope", "type": "t", "param": "p", "code": "c"}})

    with pytest.raises(cls) as err:
        make_client(handler).chat.completions.create(model="m", messages=CHAT)
    assert len(calls) == 1 and err.value.message == "nope" and err.value.param == "p"
    assert isinstance(err.value, specstream_client.APIError)


def test_timeouts_raise_timeout_error_and_per_call_override_is_sent():
    seen = []

    def handler(request):
        seen.append(request.extensions["timeout"])
        raise httpx.ReadTimeout("slow")

    with pytest.raises(specstream_client.APITimeoutError):
        make_client(handler).chat.completions.create(model="m", messages=CHAT, timeout=2.5)
    assert seen[0]["read"] == 2.5 and len(seen) == 1


async def test_async_client_streams_and_retries():
    statuses = iter([503, 200])

    async def handler(request):
        s = next(statuses)
        if s != 200:
            return httpx.Response(s, json={"error": {"message": "busy"}})
        return httpx.Response(
            200, content=(chunk("Hi") + chunk(" there") + chunk(finish="stop") + "data: [DONE]\n\n").encode()
        )

    async with AsyncClient("http://t/v1", transport=httpx.MockTransport(handler), backoff=0.001) as c:
        text = [t async for t in c.chat.completions.stream_text(model="m", messages=CHAT)]
    assert "".join(text) == "Hi there"


# ------------------------------------------------------------------------- live gateway
@pytest.fixture(scope="module")
def live(tiny_model_dir):
    from gateway.app import create_app
    from gateway.settings import GatewaySettings
    from gateway_server import LiveServer
    from specstream import AsyncEngine, EngineConfig, SpeculativeConfig

    engine = AsyncEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4),
        )
    )
    with LiveServer(create_app(engine, GatewaySettings(served_model_name="tiny", api_keys=("k",)))) as server:
        yield server


def test_live_sync_client(live):
    with Client(f"{live.url}/v1", "k") as c:
        r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
        text = "".join(c.chat.completions.stream_text(model="tiny", messages=CHAT, max_tokens=12, temperature=0))
        chunks = list(
            c.chat.completions.create(
                model="tiny",
                messages=CHAT,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        comp = c.completions.create(model="tiny", prompt="Hello", max_tokens=3, temperature=0)
        assert [m.id for m in c.models.list()] == ["tiny"]
        with pytest.raises(specstream_client.NotFoundError):
            c.chat.completions.create(model="other", messages=CHAT)
    assert r.text == text and r.usage.completion_tokens == 12
    assert chunks[-1].usage.completion_tokens == 12
    assert sum(ch.choices[0].speculative.tokens for ch in chunks if ch.choices and ch.choices[0].speculative) == 12
    assert comp.choices[0].text and comp.usage.completion_tokens == 3


async def test_live_async_client(live):
    async with AsyncClient(f"{live.url}/v1", "k") as c:
        r = await c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0)
        stream = await c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0, stream=True)
        text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
        with pytest.raises(specstream_client.AuthenticationError):
            await AsyncClient(f"{live.url}/v1", "bad").models.list()
    assert r.text == text


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_live_responses(live):
    prompt = CHAT[0]["content"]
    with Client(f"{live.url}/v1", "k") as c:
        r = c.responses.create(model="tiny", input=prompt, max_output_tokens=10, temperature=0, store=True)
        with c.responses.stream(model="tiny", input=prompt, max_output_tokens=10, temperature=0) as stream:
            deltas = list(stream.text_deltas())
            final = stream.get_final_response()
        stored = c.responses.retrieve(r.id)
        call = c.responses.create(
            model="tiny", input=prompt, tools=[WEATHER], tool_choice="required", max_output_tokens=120, temperature=0
        ).function_calls[0]
        c.responses.delete(r.id)
        with pytest.raises(specstream_client.NotFoundError):
            c.responses.retrieve(r.id)
    assert "".join(deltas) == final.output_text == r.output_text == stored.output_text
    assert r.status == "incomplete" and r.usage.output_tokens == 10 and r.usage.input_tokens > r.usage.cached_tokens
    assert call.name == "get_weather" and set(call.parsed_arguments()) == {"city"} and call.call_id


async def test_live_async_responses(live):
    prompt = CHAT[0]["content"]
    async with AsyncClient(f"{live.url}/v1", "k") as c:
        r = await c.responses.create(model="tiny", input=prompt, max_output_tokens=8, temperature=0)
        async with await c.responses.stream(model="tiny", input=prompt, max_output_tokens=8, temperature=0) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta or "" for e in deltas) == final.output_text == r.output_text
    assert all(e.speculative and e.speculative.tokens for e in deltas)
    assert events[0].type == "response.created" and events[-1].type == "response.completed"


def test_chat_repl_keeps_the_conversation_and_prints_stats(live):
    import io

    from gateway.chat_repl import run_chat

    inputs = iter(["The quick brown fox", "", "/reset", "jumps over", "/exit"])
    out = io.StringIO()
    with Client(f"{live.url}/v1", "k") as c:
        assert run_chat(c, max_tokens=8, temperature=0, read=lambda prompt: next(inputs), out=out) == 0
    text = out.getvalue()
    assert "chatting with tiny" in text and text.count("tok/s") == 2 and "(conversation cleared)" in text


def test_usage_reads_the_prediction_and_cache_details():
    from specstream_client.types import Usage

    usage = Usage.parse(
        {
            "prompt_tokens": 9,
            "completion_tokens": 20,
            "total_tokens": 29,
            "prompt_tokens_details": {"cached_tokens": 4},
            "completion_tokens_details": {"accepted_prediction_tokens": 12, "rejected_prediction_tokens": 3},
        }
    )
    assert (usage.cached_tokens, usage.accepted_prediction_tokens, usage.rejected_prediction_tokens) == (4, 12, 3)
    plain = Usage.parse({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3})
    assert (plain.cached_tokens, plain.accepted_prediction_tokens, plain.rejected_prediction_tokens) == (0, 0, 0)
