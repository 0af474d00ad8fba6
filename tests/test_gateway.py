"""The OpenAI-compatible gateway, spoken to by the official openai client and by raw httpx,
against a real uvicorn server on loopback around the tiny model. Tests see the engine only
through AsyncEngine's public surface (load gauges, the metrics registry)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway_server import FaultInjectingEngine, LiveServer
from specstream import AsyncEngine, EngineConfig, SpeculativeConfig

MODEL = "tiny"
KEYS = ("key-one", "key-two")
CHAT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. The quick brown fox"}]


def tiny_config(model_dir, **kw) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        dtype="float32",
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4),
        **kw,
    )


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = FaultInjectingEngine(tiny_config(tiny_model_dir))
    app = create_app(engine, GatewaySettings(served_model_name=MODEL, api_keys=KEYS, max_body_bytes=64 * 1024))
    with LiveServer(app) as live:
        live.engine = engine
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[1], max_retries=0)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEYS[0], max_retries=0)


def wait_idle(engine, timeout=10.0):
    """Until nothing runs or waits and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while engine.num_running or engine.num_waiting or engine.kv_usage:
        assert time.monotonic() < deadline, "engine did not go idle"
        time.sleep(0.01)


def metric(engine, name, **labels):
    return engine.metrics.registry.get_sample_value(name, labels) or 0.0


# ------------------------------------------------------------------ openai client, happy paths
def test_chat_completion_non_streaming(client, in_process_text):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    cached = r.usage.prompt_tokens_details.cached_tokens  # whole KV blocks of the prompt found cached
    assert cached % 16 == 0 and 0 <= cached < r.usage.prompt_tokens
    # The content is exactly what the engine generates for the same request in-process.
    assert r.choices[0].message.content == in_process_text
    # Fields clients send on every request, accepted and not used: the same content.
    ids = {"user": "u1", "safety_identifier": "s1", "prompt_cache_key": "k1"}
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, **ids)
    assert again.choices[0].message.content == in_process_text


@pytest.fixture(scope="module")
def in_process_text(tiny_model_dir):
    from specstream import Engine, SamplingParams

    engine = Engine(tiny_config(tiny_model_dir))
    return engine.generate([CHAT], SamplingParams(max_tokens=12, temperature=0))[0].text


@pytest.fixture(scope="module")
def drafting_client(tiny_model_dir):
    """A client of a server whose rounds all draft their cap (adaptive=False): whether a prediction drafts must not
    hang on the timings the adaptive policy prices drafts from, which a tiny model's steps leave to noise."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    engine = AsyncEngine(EngineConfig(model=str(tiny_model_dir), dtype="float32", speculative=spec))
    with LiveServer(create_app(engine, GatewaySettings(served_model_name=MODEL, api_keys=KEYS))) as live:
        yield openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEYS[0], max_retries=0)


def test_chat_template_kwargs_reach_the_template_through_chat_and_tokenize(client, server):
    """vLLM's chat_template_kwargs, as the openai client sends them (extra_body): handed to the model's template,
    which here reads none of them, so the answer and the tokens are those without."""
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False, "persona": "terse"}},
    )
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens
    body = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    with_kwargs = httpx.post(f"{server.url}/tokenize", json=body, headers=headers())
    without = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}, headers=headers())
    assert with_kwargs.status_code == 200 and with_kwargs.json()["tokens"] == without.json()["tokens"]
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "hi", "chat_template_kwargs": {}}, headers=headers())
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    body = {"messages": CHAT, "chat_template_kwargs": {"tools": []}}
    r = httpx.post(f"{server.url}/tokenize", json=body, headers=headers())
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_a_prediction_is_drafted_counted_in_usage_and_leaves_the_answer_as_it_was(drafting_client):
    """OpenAI's predicted outputs: the answer itself as the prediction (as text, then as text parts, streamed)
    is drafted and kept; a wrong one is refused by the model and changes nothing but the usage."""
    client = drafting_client
    messages = [{"role": "user", "content": "Write a poem"}]  # the tiny model's answer is text that encodes to itself
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    answer = first.choices[0].message.content
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0,
        prediction={"type": "content", "content": answer},
    )
    assert r.choices[0].message.content == answer
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens == 0
    parts = [{"type": "text", "text": answer[:5]}, {"type": "text", "text": answer[5:]}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, prediction={"type": "content", "content": parts},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0
    wrong = answer[:3] + "".join(chr(ord(c) + 1) for c in answer[3:])
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, prediction={"type": "content", "content": wrong}
    )
    assert r.choices[0].message.content == answer and r.usage.completion_tokens_details.rejected_prediction_tokens > 0
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert plain.usage.completion_tokens_details.rejected_prediction_tokens == 0
    # the legacy completions take it too (through extra_body: the openai client has no argument for it there)
    comp = client.completions.create(model=MODEL, prompt="Write a poem", max_tokens=8, temperature=0)
    again = client.completions.create(
        model=MODEL, prompt="Write a poem", max_tokens=8, temperature=0,
        extra_body={"prediction": {"type": "content", "content": comp.choices[0].text}},
    )
    assert again.choices[0].text == comp.choices[0].text
    assert again.usage.completion_tokens_details.accepted_prediction_tokens > 0, again.usage


def test_streaming_with_usage_has_one_id_role_first_and_usage_last(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens < chunks[-1].usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    assert text == plain.choices[0].message.content
    # accepted runs arrive as one chunk, with their stats in an extra field
    content = [c.choices[0] for c in chunks if c.choices and c.choices[0].delta.content]
    assert all(ch.model_extra.get("speculative") for ch in content)
    stats = [c.choices[0].model_extra.get("speculative") for c in chunks if c.choices]
    assert sum(s["tokens"] for s in stats if s) == 20


async def test_async_client_streams(aclient):
    stream = await aclient.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    r = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert "".join(pieces) == r.choices[0].message.content


def test_usage_counts_prompt_tokens_found_in_the_prefix_cache_of_the_same_salt(client):
    document = "Answer from this document. " + "The quick brown fox jumps over the lazy dog. " * 8
    messages = [{"role": "system", "content": document}, *CHAT]

    def ask(salt: str, **kw):
        body = {"cache_salt": salt}
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body=body, **kw)

    first = ask("tenant-a").usage
    again = list(ask("tenant-a", stream=True, stream_options={"include_usage": True}))[-1].usage
    other = ask("tenant-b").usage
    assert first.prompt_tokens_details.cached_tokens == 0
    # Every full 16-token block of the prompt but one that holds its last token.
    assert again.prompt_tokens_details.cached_tokens == (first.prompt_tokens - 1) // 16 * 16 > 0
    assert other.prompt_tokens_details.cached_tokens == 0


def test_stop_ends_with_stop_and_excludes_it(client):
    full = (
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0)
        .choices[0]
        .message.content
    )
    stop = full[8:11]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == full[: full.index(stop)]


def test_n_two_gives_two_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16


def test_seed_reproduces_sampling(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    assert (
        client.chat.completions.create(**kw).choices[0].message.content
        == client.chat.completions.create(**kw).choices[0].message.content
    )


def test_extra_body_top_k_ignore_eos_and_per_request_speculation(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=10,
        temperature=0.7,
        seed=1,
        extra_body={"top_k": 5, "ignore_eos": True, "speculative": {"method": "ngram", "num_speculative_tokens": 2}},
    )
    assert r.usage.completion_tokens == 10
    off = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=10, temperature=0, extra_body={"speculative": "off"}
    )
    on = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert off.choices[0].message.content == on.choices[0].message.content


def test_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_content_as_text_parts(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_completions_and_models(client):
    r = client.completions.create(
        model=MODEL, prompt=["Hello world", "Paris is"], max_tokens=5, temperature=0, logprobs=1
    )
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 10
    assert len(r.choices[0].logprobs.tokens) == 5 and r.choices[0].logprobs.text_offset[0] == 0
    s = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0, stream=True))
    assert (
        "".join(c.choices[0].text for c in s if c.choices)
        == client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0).choices[0].text
    )
    assert [m.id for m in client.models.list()] == [MODEL]


# --------------------------------------------------------------------------- error classes
def test_error_classes(client, server):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=5)
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=CHAT)
    assert nf.value.body["code"] == "model_not_found"
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


async def test_queue_full_is_429_with_retry_after_but_n_over_the_queue_limit_is_400(tiny_model_dir):
    from specstream import Engine

    inner = Engine(tiny_config(tiny_model_dir))
    gate = threading.Event()  # holds the engine's worker in its next step, so requests stay queued
    real_step = inner.step

    def gated_step():
        gate.wait()
        return real_step()

    inner.step = gated_step
    engine = await AsyncEngine(engine=inner, max_waiting=1).start()
    app = create_app(engine, GatewaySettings(served_model_name=MODEL))
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            # n above the queue limit can never be admitted: 400, not a 429 that invites retries forever
            too_many = await c.post("/v1/chat/completions", json={**body, "n": 2})
            assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
            queued = asyncio.create_task(c.post("/v1/chat/completions", json=body))
            deadline = time.monotonic() + 10
            while engine.num_waiting < 1:
                assert time.monotonic() < deadline, "the first request was never queued"
                await asyncio.sleep(0.01)
            full = await c.post("/v1/chat/completions", json=body)
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "queue_full"
            gate.set()
            assert (await queued).status_code == 200
    finally:
        gate.set()
        await engine.stop()


# ------------------------------------------------------------------------ raw HTTP checks
def headers(key=KEYS[0]):
    return {"Authorization": f"Bearer {key}"}


def test_raw_sse_framing(server):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=headers()) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.replace("\r\n", "\n").split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[6:]) for e in events[:-1]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-1]["choices"][0]["finish_reason"] == "length" and payloads[-1]["choices"][0]["delta"] == {}


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"{not json", "not valid JSON"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "NaN"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', "NaN and Infinity"),
        (b"[1, 2]", "JSON object"),
    ],
)
def test_malformed_bodies_are_400(server, body, fragment):
    r = httpx.post(
        f"{server.url}/v1/chat/completions", content=body, headers={**headers(), "content-type": "application/json"}
    )
    assert r.status_code == 400 and fragment in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"n": 1000}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"tools": [{"type": "function", "function": {"name": "not a name"}}]}, "tools"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format",
        ),
        ({"logit_bias": {"1": 200}}, "logit_bias"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": []}, "messages"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"speculative": {"method": "draft"}}, "speculative.method"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"prediction": {"type": "text", "content": "x"}}, "prediction"),
        ({"prediction": {"type": "content", "content": 5}}, "prediction"),
        ({"prediction": {"type": "content", "content": [{"type": "image_url", "text": "x"}]}}, "prediction"),
        ({"prediction": {"type": "content", "content": "word " * 3000}}, "prediction"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
    ],
)
def test_invalid_requests_are_400_and_never_reach_the_engine(server, extra, param):
    before = metric(server.engine, "specstream_prompt_tokens_total")
    body = {"model": MODEL, "messages": CHAT, **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err["param"] or "") and err["message"]
    assert metric(server.engine, "specstream_prompt_tokens_total") == before


@pytest.mark.parametrize(
    "path, prompt_field",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 3000}]}),
        ("/v1/completions", {"prompt": "word " * 3000}),
    ],
)
def test_prompt_too_long_is_400_context_length_naming_the_endpoints_prompt_field(server, path, prompt_field):
    body = {"model": MODEL, **prompt_field, "max_tokens": 4}
    r = httpx.post(f"{server.url}{path}", json=body, headers=headers())
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["param"] == next(
        iter(prompt_field)
    )


def test_body_too_large_is_413(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 70_000}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_auth(server):
    url = f"{server.url}/v1/models"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Basic abc"}).status_code == 401
    assert httpx.get(url, headers=headers("key-two")).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_unknown_route_is_404_in_openai_shape(server):
    r = httpx.get(f"{server.url}/v1/nothing", headers=headers())
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_client_disconnect_cancels_generation(server):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 900, "temperature": 0, "stream": True, "extra_body": None}
    body.pop("extra_body")
    body["ignore_eos"] = True
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=headers()) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.engine.num_running == 1
    wait_idle(server.engine)


def test_error_mid_stream_becomes_an_sse_error_event_without_internal_ids(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "EXPLODE " * 3}],
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=headers()) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    first, last = json.loads(events[0][6:]), json.loads(events[-1][6:])
    assert last["error"]["code"] == "request_failed" and last["error"]["type"] == "internal_error"
    assert first["id"] not in last["error"]["message"] and "boom" not in last["error"]["message"]
    wait_idle(server.engine)
    ok = httpx.post(
        f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4}, headers=headers()
    )
    assert ok.status_code == 200


def test_error_before_the_first_chunk_is_a_500_without_internal_ids(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "EXPLODE"}], "max_tokens": 40, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers())
    assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
    assert "chatcmpl" not in r.text and "#" not in r.json()["error"]["message"]


def test_metrics_endpoint(server, client):
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    text = httpx.get(f"{server.url}/metrics").text
    assert (
        "specstream_time_to_first_token_seconds_bucket" in text
        and "specstream_spec_decode_num_draft_tokens_total" in text
    )


async def test_health_says_loading_then_ok(tiny_model_dir):
    engine = AsyncEngine(tiny_config(tiny_model_dir))
    app = create_app(engine, GatewaySettings(served_model_name=MODEL))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        loading = await c.get("/health")
        assert loading.status_code == 503 and loading.json() == {"status": "loading"}
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
        assert (
            r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready" and r.headers["retry-after"] == "5"
        )
        await engine.start()
        try:
            ok = await c.get("/health")
            assert ok.status_code == 200 and ok.json() == {"status": "ok", "model": MODEL}
        finally:
            await engine.stop()


async def test_health_says_failed_with_the_error_when_the_engine_fails(tiny_model_dir):
    from specstream import Engine

    inner = Engine(tiny_config(tiny_model_dir))

    def broken_step():
        raise RuntimeError("injected fatal fault")

    inner.step = broken_step
    engine = await AsyncEngine(engine=inner).start()
    failures = []
    app = create_app(engine, GatewaySettings(served_model_name=MODEL), on_engine_failure=failures.append)
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        assert (await c.get("/health")).json() == {"status": "ok", "model": MODEL}
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
        health = await c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "injected fatal fault" in health.json()["error"]
        after = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4})
        assert after.status_code == 503 and "retry-after" not in after.headers
        deadline = time.monotonic() + 5
        while not failures:
            assert time.monotonic() < deadline, "the lifespan did not report the failure"
            await asyncio.sleep(0.05)
    assert "injected fatal fault" in str(failures[0])


def test_end_to_end_on_the_default_model():
    engine = AsyncEngine(EngineConfig(dtype="float32"))
    with LiveServer(create_app(engine)) as live:
        c = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
        stream = c.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
            stream=True,
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert "Paris" in text


async def test_chat_template_errors_are_400_and_the_engine_stays_healthy(tiny_model_dir, tmp_path):
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "strict-template")
    (model_dir / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    engine = AsyncEngine(tiny_config(model_dir))
    app = create_app(engine, GatewaySettings(served_model_name=MODEL))
    async with engine, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
        assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "messages"
        assert engine.state == "ready"
        ok = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
        assert ok.status_code == 200


def test_deeply_nested_json_is_400(server):
    body = b"[" * 20000 + b"]" * 20000
    r = httpx.post(
        f"{server.url}/v1/chat/completions", content=body, headers={**headers(), "content-type": "application/json"}
    )
    assert r.status_code == 400


def test_null_optional_fields_mean_defaults(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=3,
        extra_body={"n": None, "presence_penalty": None, "stream": None, "logprobs": None},
    )
    assert len(r.choices) == 1 and r.usage.completion_tokens == 3


def test_completions_limit_prompts_times_n(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=["a"] * 5, n=2, max_tokens=2)


def test_non_streaming_request_is_cancelled_when_the_client_leaves(server):
    def aborted():
        return metric(server.engine, "specstream_request_success_total", finished_reason="abort")

    before = aborted()
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 900, "n": 8, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/chat/completions", json=body, headers=headers(), timeout=httpx.Timeout(0.3, connect=5.0)
        )
    wait_idle(server.engine)
    assert aborted() == before + 8  # all eight choices were aborted, none ran to the end


def test_logprob_bytes_rebuild_characters_split_across_tokens():
    from gateway.tokens import TokenBytes
    from specstream.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("smollm2-135m"))
    text = "\u4f60\u597d \U0001f600 ok"
    ids = tok.encode(text)
    tb = TokenBytes(tok)
    assert bytes(b for i in ids for b in tb(i)[1]).decode("utf-8") == text


def test_completion_text_offsets_index_the_text_sent_streamed_or_not(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0, logprobs=1)
    full = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    streamed = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    offsets = full.logprobs.text_offset
    assert streamed == offsets and len(offsets) == 16
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] <= len(full.text)
    tokens = full.logprobs.tokens
    if "".join(tokens) == full.text:  # every token decodes on its own: offsets are exact
        assert all(full.text.startswith(t, o) for t, o in zip(tokens, offsets, strict=True))
