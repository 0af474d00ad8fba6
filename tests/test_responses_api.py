"""POST /v1/responses (the OpenAI Responses API) and vLLM's /tokenize and /detokenize, spoken to
by the official openai client (its own stream helpers included) and by raw httpx, against a live
server around the tiny model (fp32, greedy unless stated)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway_server import SCHEMA, WEATHER_PARAMETERS, FaultInjectingEngine, LiveServer, ngram_config

MODEL = "tiny"
KEYS = ("key-one", "key-two")
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
CHAT = [{"role": "user", "content": PROMPT}]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city.",
    "parameters": WEATHER_PARAMETERS,
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = ngram_config(tiny_model_dir)
    settings = GatewaySettings(served_model_name=MODEL, api_keys=KEYS, response_store_max_count=3)
    with LiveServer(create_app(FaultInjectingEngine(config), settings)) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[0], max_retries=0)


@pytest.fixture
def other_client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[1], max_retries=0)


def create(client, **kw):
    return client.responses.create(model=MODEL, input=kw.pop("input", PROMPT), temperature=0, **kw)


def post(server, path: str, body: dict, key: str = KEYS[0]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60)


# ------------------------------------------------------------------------- create
def test_create_gives_the_chat_reply_as_one_message_with_usage(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Answer briefly."}, *CHAT],
        max_tokens=12,
        temperature=0,
    )
    r = create(client, max_output_tokens=12, instructions="Answer briefly.")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    cached = r.usage.input_tokens_details.cached_tokens  # whole KV blocks found in the prefix cache
    assert cached % 16 == 0 and 0 < cached < r.usage.input_tokens
    assert r.instructions == "Answer briefly." and r.store is False and r.max_output_tokens == 12


def test_input_items_with_text_parts_equal_the_string_input(client):
    items = [{"role": "user", "content": [{"type": "input_text", "text": PROMPT}]}]
    assert (
        create(client, input=items, max_output_tokens=6).output_text == create(client, max_output_tokens=6).output_text
    )


def test_every_other_accepted_field(client):
    """top_p (so small that only the likeliest token is left: greedy), metadata and the fields
    accepted for clients that always send them."""
    r = client.responses.create(
        model=MODEL,
        input=PROMPT,
        temperature=1.0,
        top_p=1e-9,
        max_output_tokens=8,
        metadata={"run": "7"},
        user="u1",
        safety_identifier="s1",
        prompt_cache_key="k1",
        truncation="disabled",
        reasoning={"effort": "low"},
        include=["reasoning.encrypted_content"],
    )
    assert r.output_text == create(client, max_output_tokens=8).output_text
    assert r.metadata == {"run": "7"} and r.top_p == 1e-9 and r.user == "u1"


# ------------------------------------------------------------------------ streaming
def test_stream_sends_the_typed_events_in_order_and_the_helper_assembles_the_same_text(client):
    with client.responses.stream(model=MODEL, input=PROMPT, temperature=0, max_output_tokens=20) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    text = "".join(e.delta for e in deltas)
    assert text == final.output_text == events[-4].text == create(client, max_output_tokens=20).output_text
    assert final.usage.output_tokens == 20 and final.status == "incomplete"


def test_streamed_deltas_carry_speculation_counts_like_chats_chunks(client):
    """An extra field on the raw events (the stream helper rebuilds its events without extras)."""
    events = list(create(client, max_output_tokens=20, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    stats = [e.model_extra["speculative"] for e in deltas]
    done = next(e for e in events if e.type == "response.output_text.done")
    stats.append(done.model_extra.get("speculative") or {"drafted": 0, "accepted": 0, "tokens": 0})
    assert all(s["tokens"] for s in stats[:-1]) and sum(s["tokens"] for s in stats) == 20
    assert sum(s["accepted"] for s in stats) <= sum(s["drafted"] for s in stats)


async def test_async_client_streams(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEYS[0], max_retries=0)
    stream = await client.responses.create(model=MODEL, input=PROMPT, temperature=0, max_output_tokens=8, stream=True)
    text = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
    r = await client.responses.create(model=MODEL, input=PROMPT, temperature=0, max_output_tokens=8)
    assert text == r.output_text


# ---------------------------------------------------------------- function calling
def test_function_call_round_trip_with_function_call_output(client):
    r = create(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_output_tokens=120)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.status == "completed" and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    follow = [*CHAT, call, {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    answer = create(client, input=follow, tools=[WEATHER], tool_choice="none", max_output_tokens=8)
    assert answer.output[0].type == "message" and answer.output_text
    # the call and its result reached the prompt (the tools' definitions did not: tool_choice none)
    assert answer.usage.input_tokens > create(client, max_output_tokens=1).usage.input_tokens + 20


def test_streamed_function_call_assembles_to_the_unstreamed_call(client):
    kw = {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 120}
    plain = create(client, **kw)
    with client.responses.stream(model=MODEL, input=PROMPT, temperature=0, **kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (call,) = final.output
    assert pieces == call.arguments == events[-3].arguments == plain.output[0].arguments
    assert call.name == "get_weather"


# --------------------------------------------------------------------- text.format
def test_text_format_json_schema_gives_valid_json_streamed_and_not(client):
    fmt = {"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}}
    r = create(client, text=fmt, max_output_tokens=80)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"
    with client.responses.stream(model=MODEL, input=PROMPT, temperature=0, text=fmt, max_output_tokens=80) as s:
        assert s.get_final_response().output_text == r.output_text


def test_text_format_json_object(client):
    r = create(client, text={"format": {"type": "json_object"}}, max_output_tokens=40)
    assert r.output_text.startswith("{")


# -------------------------------------------------------------------------- store
def test_stored_responses_continue_with_previous_response_id_and_are_retrieved(client, server):
    first = create(client, input="Paris is the capital of", max_output_tokens=6, store=True)
    assert first.store is True
    second = create(client, input="Berlin is", previous_response_id=first.id, max_output_tokens=6, store=True)
    assert second.previous_response_id == first.id
    # the second prompt is the first turn, its reply and the new turn, as chat would template them
    messages = [
        {"role": "user", "content": "Paris is the capital of"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Berlin is"},
    ]
    assert second.usage.input_tokens == post(server, "/tokenize", {"messages": messages}).json()["count"]
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    third = create(client, input="and Rome", previous_response_id=second.id, max_output_tokens=6)
    assert third.usage.input_tokens > second.usage.input_tokens


def test_unknown_unstored_and_other_keys_responses_are_404(client, other_client):
    stored = create(client, max_output_tokens=2, store=True)
    unstored = create(client, max_output_tokens=2)
    for response_id in (stored.id, "resp_unknown", "x" * 5000):
        with pytest.raises(openai.NotFoundError):
            other_client.responses.retrieve(response_id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as caught:
        create(other_client, previous_response_id=stored.id, max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(stored.id).id == stored.id
    with client.responses.stream(model=MODEL, input=PROMPT, max_output_tokens=2, store=True) as stream:
        streamed = stream.get_final_response()
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text


def test_the_store_is_bounded_per_key_oldest_out_first(client, other_client):
    """At most 3 per key here (response_store_max_count=3): a fourth drops the key's oldest only."""
    theirs = create(other_client, max_output_tokens=1, store=True)
    mine = [create(client, max_output_tokens=1, store=True) for _ in range(4)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(mine[0].id)
    assert [client.responses.retrieve(r.id).id for r in mine[1:]] == [r.id for r in mine[1:]]
    assert other_client.responses.retrieve(theirs.id).id == theirs.id
    client.responses.delete(mine[3].id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(mine[3].id)


# -------------------------------------------------------------------------- errors
def test_a_failure_mid_stream_is_an_error_event_without_internal_ids(server):
    body = {"model": MODEL, "input": "EXPLODE " * 3, "max_output_tokens": 40, "temperature": 0, "stream": True}
    r = post(server, "/v1/responses", body)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "error"
    assert events[-1]["code"] == "request_failed" and events[-1]["sequence_number"] == len(events) - 1
    assert events[0]["response"]["id"] not in events[-1]["message"] and "boom" not in events[-1]["message"]
    assert post(server, "/v1/responses", {"model": MODEL, "input": PROMPT, "max_output_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice.name"),
        ({"metadata": {"k": "v" * 600}}, "metadata"),
        ({"background": True}, "background"),
    ],
)
def test_bad_requests_are_400_in_openais_shape_naming_the_responses_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, **{"input": PROMPT, **kw})
    assert caught.value.body["param"] == param and caught.value.body["type"] == "invalid_request_error"


def test_unknown_model_and_wrong_key_are_404_and_401(client, server):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input=PROMPT)
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.responses.create(model=MODEL, input=PROMPT)


# ---------------------------------------------------------------------- tokenizer
def test_tokenize_and_detokenize_round_trip(server, client):
    text = "Caf\u00e9 na\u00efve \u4f60\u597d \U0001f600 " + PROMPT
    tokenized = post(server, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"]) > 0
    assert tokenized["max_model_len"] == 1024
    assert post(server, "/detokenize", {"tokens": tokenized["tokens"]}).json() == {"prompt": text}
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert post(server, "/tokenize", {"messages": CHAT}).json()["count"] == chat.usage.prompt_tokens


def test_tokenize_takes_vllms_template_and_special_token_options(server, tiny_model_dir):
    """add_generation_prompt (default true) opens the assistant turn after the messages; continue_final_message
    leaves the last message open instead; add_special_tokens, with a prompt, is the tokenizer's own."""
    convo = [*CHAT, {"role": "assistant", "content": "The quick"}]

    def tokens(body: dict) -> list[int]:
        r = post(server, "/tokenize", body)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    opened = tokens({"messages": convo})
    closed = tokens({"messages": convo, "add_generation_prompt": False})
    continued = tokens({"messages": convo, "add_generation_prompt": False, "continue_final_message": True})
    assert len(opened) > len(closed) and opened[: len(closed)] == closed
    assert len(continued) < len(closed) and closed[: len(continued)] == continued
    assert post(server, "/detokenize", {"tokens": continued}).json()["prompt"].endswith("The quick")
    assert tokens({"messages": convo, "add_special_tokens": False}) == opened
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokens({"prompt": PROMPT}) == tokenizer.encode(PROMPT)
    assert tokens({"prompt": PROMPT, "add_special_tokens": False}) == tokenizer.encode(PROMPT, add_special_tokens=False)


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt"),
        ("/tokenize", {"prompt": "a", "continue_final_message": False}, 400, "continue_final_message"),
        ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": CHAT, "continue_final_message": True}, 400, "continue_final_message"),
        ("/tokenize", {"messages": CHAT, "add_generation_prompt": "yes"}, 400, "add_generation_prompt"),
        ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "messages"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "model"),
        ("/tokenize", {"prompt": "a" * 40_000}, 400, "prompt"),
        ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": [1] * 2000}, 400, "tokens"),
    ],
)
def test_tokenizer_errors_are_in_openais_shape(server, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["param"] == param
