"""POST /v1/messages and /v1/messages/count_tokens (the Anthropic Messages API), spoken to by the
official anthropic client (its stream helpers included) and by raw httpx, against a live server
around the tiny model (fp32, greedy: temperature goes in extra_body, which this client version
no longer takes as an argument)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway_server import SCHEMA, WEATHER_PARAMETERS, FaultInjectingEngine, LiveServer, ngram_config

MODEL = "tiny"
KEY = "key-one"
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MESSAGES = [{"role": "user", "content": PROMPT}]
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Weather in a city.", "input_schema": WEATHER_PARAMETERS}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = ngram_config(tiny_model_dir)
    settings = GatewaySettings(served_model_name=MODEL, api_keys=(KEY,), max_body_bytes=64 * 1024)
    with LiveServer(create_app(FaultInjectingEngine(config), settings)) as live:
        yield live


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def create(client, **kw):
    return client.messages.create(
        model=MODEL, max_tokens=kw.pop("max_tokens", 12), messages=kw.pop("messages", MESSAGES), extra_body=GREEDY, **kw
    )


def chat_text(server, messages: list[dict], max_tokens: int) -> tuple[str, int]:
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return chat.choices[0].message.content, chat.usage.prompt_tokens


# ------------------------------------------------------------------------- create
def test_create_gives_chats_reply_as_a_text_block(client, server):
    text, prompt_tokens = chat_text(server, [{"role": "system", "content": "Be brief."}, *MESSAGES], 12)
    m = create(client, system="Be brief.")
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    # Anthropic's split: input_tokens are the prompt tokens not read from the cache
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt_tokens and m.usage.output_tokens == 12
    assert m.usage.cache_read_input_tokens > 0  # the chat request just ran the same prompt
    blocks = create(client, system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}])
    assert blocks.content[0].text == text


def test_top_k_top_p_and_the_other_accepted_fields(client):
    """top_k 1 (or a top_p so small) leaves the likeliest token: sampling equals greedy."""
    greedy = create(client).content[0].text
    for extra in ({"top_k": 1}, {"top_p": 1e-9}):
        m = client.messages.create(
            model=MODEL,
            max_tokens=12,
            messages=MESSAGES,
            metadata={"user_id": "u1"},
            thinking={"type": "disabled"},
            extra_body={"temperature": 1.0, **extra},
        )
        assert m.content[0].text == greedy


def test_stop_sequences_end_with_stop_sequence_naming_it(client):
    text = create(client, max_tokens=16).content[0].text
    stop = text[6:9]
    m = create(client, max_tokens=16, stop_sequences=["never-seen", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


def test_x_api_key_and_bearer_both_authorize(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": MESSAGES}
    by_header = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    by_bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert by_header.status_code == 200
    assert by_bearer.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES).usage.output_tokens == 2


# ------------------------------------------------------------------------ streaming
def test_stream_events_and_the_helper_assemble_the_same_message(client):
    with client.messages.stream(model=MODEL, max_tokens=20, messages=MESSAGES, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    deltas = [e for e in events if e.type == "content_block_delta"]
    text = "".join(e.delta.text for e in deltas)
    assert text == final.content[0].text == create(client, max_tokens=20).content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 20
    assert events[0].message.usage.input_tokens == final.usage.input_tokens + final.usage.cache_read_input_tokens


def test_raw_stream_has_ping_and_speculation_counts(server):
    body = {"model": MODEL, "max_tokens": 20, "messages": MESSAGES, "stream": True, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    payloads = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert names[:2] == ["message_start", "ping"] and names == [p["type"] for p in payloads]
    stats = [p.get("speculative") or {"tokens": 0} for p in payloads if p["type"].startswith("content_block_")]
    assert sum(s["tokens"] for s in stats) == 20


# ------------------------------------------------------------------------------ tools
def test_tool_use_round_trip_with_tool_result(client):
    m = create(client, tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_tokens=120)
    assert m.stop_reason == "tool_use"
    (call,) = m.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER_PARAMETERS)
    follow = [
        *MESSAGES,
        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}]},
    ]
    answer = create(client, messages=follow, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=8)
    assert answer.content[0].type == "text" and answer.stop_reason == "max_tokens"
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > m.usage.output_tokens


def test_streamed_tool_use_assembles_to_the_unstreamed_input(client):
    kw = {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}, "max_tokens": 120}
    plain = create(client, **kw)
    with client.messages.stream(model=MODEL, messages=MESSAGES, extra_body=GREEDY, **kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert json.loads(partial) == final.content[0].input == plain.content[0].input
    assert final.stop_reason == "tool_use" and final.content[0].name == "get_weather"


def test_auto_tool_choice_and_error_results(client):
    m = create(client, tools=[WEATHER], tool_choice={"type": "auto"}, max_tokens=30)
    assert m.stop_reason in ("tool_use", "max_tokens", "end_turn")
    assert all(b.type == "tool_use" for b in m.content) if m.stop_reason == "tool_use" else m.content[0].type == "text"
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "no such city"}]}
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "X", "unit": "c"}}
    turns = [*MESSAGES, {"role": "assistant", "content": [call]}]
    failed = client.messages.count_tokens(model=MODEL, messages=[*turns, {"role": "user", "content": [result]}])
    result["is_error"] = True
    errored = client.messages.count_tokens(model=MODEL, messages=[*turns, {"role": "user", "content": [result]}])
    assert errored.input_tokens > failed.input_tokens  # said so in the prompt


def test_output_config_json_schema_gives_valid_json(client):
    m = create(client, output_config={"format": {"type": "json_schema", "schema": SCHEMA}}, max_tokens=80)
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), SCHEMA)


# ---------------------------------------------------------------------- count_tokens
def test_count_tokens_counts_the_prompt_messages_would_run(client):
    kw = {"system": "Be brief.", "tools": [WEATHER]}
    counted = client.messages.count_tokens(model=MODEL, messages=MESSAGES, **kw)
    m = create(client, max_tokens=1, **kw)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert counted.input_tokens > client.messages.count_tokens(model=MODEL, messages=MESSAGES).input_tokens


# ---------------------------------------------------------------------------- errors
def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"temperature": 1.5}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice.name"),
    ],
)
def test_bad_requests_are_400_in_anthropics_shape(client, extra, words):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=4, messages=MESSAGES, extra_body=extra)
    assert caught.value.body["error"]["type"] == "invalid_request_error" and words in caught.value.message


def test_a_failure_mid_stream_is_an_error_event_in_anthropics_shape(client, server):
    with pytest.raises(anthropic.APIStatusError) as caught:
        with client.messages.stream(
            model=MODEL, max_tokens=40, messages=[{"role": "user", "content": "EXPLODE " * 3}]
        ) as s:
            list(s)
    assert caught.value.body == {
        "type": "error",
        "error": {
            "type": "api_error",
            "message": "the request failed while generating (the server log has the details)",
        },
    }
    assert create(client, max_tokens=2).usage.output_tokens == 2


def test_client_error_classes(client, server):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=4, messages=MESSAGES)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=MESSAGES
        )
    assert caught.value.body["error"]["type"] == "authentication_error"


def test_every_status_on_messages_paths_is_in_anthropics_shape(server):
    url, key = f"{server.url}/v1/messages", {"x-api-key": KEY}
    anthropic_error(httpx.post(url, json={}, headers={"x-api-key": "wrong"}), 401, "authentication_error")
    anthropic_error(httpx.get(url, headers=key), 405, "invalid_request_error")
    anthropic_error(httpx.post(f"{url}/nope", json={}, headers=key), 404, "not_found_error")
    anthropic_error(httpx.post(url, content=b"{}", headers=key), 415, "invalid_request_error")
    big = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x" * 70_000}]}
    anthropic_error(httpx.post(url, json=big, headers=key), 413, "request_too_large")
    anthropic_error(httpx.post(f"{url}/count_tokens", json={"model": MODEL}, headers=key), 400, "invalid_request_error")
    # chat's paths keep OpenAI's shape
    assert set(httpx.get(f"{server.url}/v1/chat/completions", headers=key).json()) == {"error"}
