"""The OpenAI-compatible gateway, spoken to by the official openai client and by raw httpx,
against a real uvicorn server on loopback around the tiny model."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway_server import LiveServer
from specstream import AsyncEngine, EngineConfig, SpeculativeConfig

MODEL = "tiny"
KEYS = ("key-one", "key-two")
CHAT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. The quick brown fox"}]


def tiny_config(model_dir, **kw) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4), **kw)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = AsyncEngine(tiny_config(tiny_model_dir))
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
    deadline = time.monotonic() + timeout
    pool = engine.engine.pool
    while engine.engine.num_running or engine.engine.num_waiting or pool.num_free_blocks != pool.num_blocks:
        assert time.monotonic() < deadline, "engine did not go idle"
        time.sleep(0.01)


# ------------------------------------------------------------------ openai client, happy paths
def test_chat_completion_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_streaming_with_usage_has_one_id_role_first_and_usage_last(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
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
    stream = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    r = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert "".join(pieces) == r.choices[0].message.content


def test_stop_ends_with_stop_and_excludes_it(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0).choices[0].message.content
    stop = full[8:11]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == full[: full.index(stop)]


def test_n_two_gives_two_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, n=2, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16


def test_seed_reproduces_sampling(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    assert client.chat.completions.create(**kw).choices[0].message.content == client.chat.completions.create(**kw).choices[0].message.content


def test_extra_body_top_k_ignore_eos_and_per_request_speculation(client):
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=10, temperature=0.7, seed=1,
        extra_body={"top_k": 5, "ignore_eos": True, "speculative": {"method": "ngram", "num_speculative_tokens": 2}},
    )
    assert r.usage.completion_tokens == 10
    off = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, extra_body={"speculative": "off"})
    on = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert off.choices[0].message.content == on.choices[0].message.content


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_content_as_text_parts(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_completions_and_models(client):
    r = client.completions.create(model=MODEL, prompt=["Hello world", "Paris is"], max_tokens=5, temperature=0, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 10
    assert len(r.choices[0].logprobs.tokens) == 5 and r.choices[0].logprobs.text_offset[0] == 0
    s = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in s if c.choices) == client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0).choices[0].text
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


def test_queue_full_is_429_with_retry_after(tiny_model_dir):
    engine = AsyncEngine(tiny_config(tiny_model_dir), max_waiting=0)
    with LiveServer(create_app(engine, GatewaySettings(served_model_name=MODEL))) as live:
        c = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as err:
            c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
        assert err.value.response.headers["retry-after"] == "1"


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
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers={**headers(), "content-type": "application/json"})
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
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}, "response_format"),
        ({"logit_bias": {"1": 200}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0]"),
        ({"messages": []}, "messages"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"speculative": {"method": "draft"}}, "speculative.method"),
    ],
)
def test_invalid_requests_are_400_and_never_reach_the_engine(server, extra, param):
    before = server.engine.metrics.prompt_tokens._value.get()
    body = {"model": MODEL, "messages": CHAT, **extra}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and param in (err["param"] or "") and err["message"]
    assert server.engine.metrics.prompt_tokens._value.get() == before


def test_prompt_too_long_is_400_context_length(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 4}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers())
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


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
        assert server.engine.engine.num_running == 1
    wait_idle(server.engine)


def test_error_mid_stream_becomes_an_sse_error_event(server):
    engine = server.engine.engine
    real = engine.prepare

    def prepare(prompt, params, request_id):
        seq = real(prompt, params, request_id)
        if "EXPLODE" in str(prompt):
            count = {"n": 0}
            add = seq.detokenizer.add

            def flaky(token_id):
                count["n"] += 1
                if count["n"] > 3:
                    raise RuntimeError("boom")
                return add(token_id)

            seq.detokenizer.add = flaky
        return seq

    engine.prepare = prepare
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "EXPLODE " * 3}], "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=headers()) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        last = json.loads(events[-1][6:])
        assert "error" in last and "boom" in last["error"]["message"]
        ok = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4}, headers=headers())
        assert ok.status_code == 200
    finally:
        engine.prepare = real


def test_metrics_endpoint(server, client):
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    text = httpx.get(f"{server.url}/metrics").text
    assert "specstream_time_to_first_token_seconds_bucket" in text and "specstream_spec_decode_num_draft_tokens_total" in text


async def test_health_is_503_until_the_model_is_ready(tiny_model_dir):
    engine = AsyncEngine(tiny_config(tiny_model_dir))
    app = create_app(engine, GatewaySettings(served_model_name=MODEL))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        assert (await c.get("/health")).status_code == 503
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
        assert r.status_code == 503
        await engine.start()
        try:
            assert (await c.get("/health")).status_code == 200
        finally:
            await engine.stop()


def test_end_to_end_on_the_default_model():
    engine = AsyncEngine(EngineConfig(dtype="float32"))
    with LiveServer(create_app(engine)) as live:
        c = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
        stream = c.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=20, temperature=0, stream=True
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert "Paris" in text


def test_chat_template_errors_are_400_and_the_engine_stays_healthy(server):
    engine = server.engine.engine
    real = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT}, headers=headers())
        assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"]
    finally:
        engine.tokenizer.chat_template = real
    assert server.engine.is_healthy
    assert httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2}, headers=headers()).status_code == 200


def test_deeply_nested_json_is_400(server):
    body = b"[" * 20000 + b"]" * 20000
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers={**headers(), "content-type": "application/json"})
    assert r.status_code == 400


def test_null_optional_fields_mean_defaults(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, extra_body={"n": None, "presence_penalty": None, "stream": None, "logprobs": None})
    assert len(r.choices) == 1 and r.usage.completion_tokens == 3


def test_completions_limit_prompts_times_n(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=["a"] * 5, n=2, max_tokens=2)


def test_non_streaming_request_is_cancelled_when_the_client_leaves(server):
    engine = server.engine.engine
    finished = engine.metrics.finished.labels(finished_reason="abort")
    before = finished._value.get()
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 900, "n": 8, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers(), timeout=httpx.Timeout(0.3, connect=5.0))
    wait_idle(server.engine)
    assert finished._value.get() == before + 8  # all eight choices were aborted, none ran to the end


def test_logprob_bytes_rebuild_characters_split_across_tokens():
    from gateway.tokens import TokenBytes
    from specstream.models import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model("smollm2-135m"))
    text = "\u4f60\u597d \U0001f600 ok"
    ids = tok.encode(text)
    tb = TokenBytes(tok)
    assert bytes(b for i in ids for b in tb(i)[1]).decode("utf-8") == text
