"""Structured outputs and tool calling through the OpenAI API, spoken to by the official
openai client against a live server around the tiny model (fp32, greedy unless stated)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway_server import LiveServer, ngram_config
from specstream import AsyncEngine

MODEL = "tiny"
CHAT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. The quick brown fox"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "color": {"enum": ["red", "green"]},
    },
    "required": ["name", "count", "color"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}
# A conversation with one earlier tool call and its result.
HISTORY = CHAT + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = ngram_config(tiny_model_dir)
    engine = AsyncEngine(config)
    with LiveServer(create_app(engine, GatewaySettings(served_model_name=MODEL))) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def create(client, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=kw.pop("messages", CHAT), temperature=0, max_tokens=kw.pop("max_tokens", 80), **kw
    )


def streamed(client, **kw) -> tuple[str, dict[int, dict], str, list]:
    """(content, tool calls assembled by index, finish_reason, raw deltas) of a streamed reply."""
    content, calls, finish, deltas = [], {}, None, []
    for chunk in create(client, stream=True, **kw):
        for choice in chunk.choices:
            deltas.append(choice.delta)
            content.append(choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id:
                    slot["id"], slot["name"] = call.id, call.function.name
                slot["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(content), calls, finish, deltas


# ------------------------------------------------------------------------ response_format
def test_json_schema_response_validates_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    r = create(client, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    text, calls, finish, _ = streamed(client, response_format=fmt)
    assert text == r.choices[0].message.content and finish == "stop" and not calls


def test_json_object_response_is_a_json_object_streamed_and_not(client):
    fmt = {"type": "json_object"}
    r = create(client, response_format=fmt, max_tokens=40)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    streamed_text, _, finish, _ = streamed(client, response_format=fmt, max_tokens=40)
    assert streamed_text == text and finish == r.choices[0].finish_reason


def test_logit_bias_applies_under_the_grammar_mask(client, tiny_model_dir):
    from transformers import AutoTokenizer

    (close,) = AutoTokenizer.from_pretrained(tiny_model_dir).encode("}")
    r = create(client, response_format={"type": "json_object"}, logit_bias={str(close): 100})
    assert r.choices[0].finish_reason == "stop" and json.loads(r.choices[0].message.content) == {}


# ------------------------------------------------------------------------------ tools
def check_calls(calls: list[dict], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call["id"].startswith("call_") and call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_stream_like_openai_and_match_unstreamed(client, tool_choice):
    r = create(client, tools=TOOLS, tool_choice=tool_choice, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls
    ]
    assert all(c.type == "function" for c in choice.message.tool_calls)
    names = {"add"} if isinstance(tool_choice, dict) else set(SCHEMAS)
    check_calls(calls, names)
    text, streamed_calls, finish, deltas = streamed(client, tools=TOOLS, tool_choice=tool_choice, max_tokens=120)
    assert finish == "tool_calls" and text == ""
    assert [(c["name"], c["arguments"]) for c in streamed_calls.values()] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    firsts = [d.tool_calls[0] for d in deltas if d.tool_calls and d.tool_calls[0].id]
    assert all(f.type == "function" and f.function.name and f.function.arguments == "" for f in firsts)
    assert len(firsts) == len(calls)


def test_auto_tool_choice_gives_text_or_calls_identically_streamed(client):
    r = create(client, tools=TOOLS, tool_choice="auto", max_tokens=30)
    message = r.choices[0].message
    text, calls, finish, _ = streamed(client, tools=TOOLS, max_tokens=30)
    if message.tool_calls:
        assert finish == r.choices[0].finish_reason == "tool_calls"
        assert [c["arguments"] for c in calls.values()] == [c.function.arguments for c in message.tool_calls]
    else:
        assert text == message.content and not message.content.startswith("<") and not calls


def test_tool_choice_none_answers_in_text(client):
    r = create(client, tools=TOOLS, tool_choice="none", max_tokens=12)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_tool_turns_are_rendered_into_the_prompt(client):
    with_tools = create(client, messages=HISTORY, tools=TOOLS, max_tokens=4)
    plain = create(client, messages=CHAT, max_tokens=4)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 40


# ------------------------------------------------------------------------- bad requests
@pytest.mark.parametrize(
    "kw, param, words",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}},
                }
            },
            "response_format.json_schema.schema",
            "strin",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format.json_schema.schema",
            "uniqueItems",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
            "schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"format": "nope", "type": "string"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "nope",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
            "tool_choice.function.name",
            "missing",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"logit_bias": {"5": 150}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"999999": 1}}, "logit_bias", "below"),
        ({"functions": [{"name": "f"}]}, "functions", "legacy"),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
            "guided_regex",
            "cannot be combined",
        ),
    ],
)
def test_bad_structured_requests_are_400s_naming_the_field(client, kw, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **kw)
    error = info.value.body
    assert error["param"] == param and words in error["message"], error


# ---------------------------------------------------------------------------- extras
def test_guided_choice_and_regex_extras(client):
    r = create(client, extra_body={"guided_choice": ["alpha", "beta gamma"]})
    assert r.choices[0].message.content in ("alpha", "beta gamma") and r.choices[0].finish_reason == "stop"
    r = create(client, extra_body={"guided_regex": "[0-9]{3}-[a-c]{2}"})
    assert r.choices[0].message.content[3] == "-" and len(r.choices[0].message.content) == 6


def test_completions_take_guided_json_and_logit_bias(server):
    body = {"model": MODEL, "prompt": "Paris", "max_tokens": 80, "temperature": 0, "guided_json": SCHEMA}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    jsonschema.validate(json.loads(r["choices"][0]["text"]), SCHEMA)
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={**body, "guided_json": None, "logit_bias": {"42": 100}, "max_tokens": 5},
        timeout=60,
    ).json()
    assert r["choices"][0]["text"] == r["choices"][0]["text"][0] * 5


def test_forced_drafts_show_in_stream_stats_and_metrics(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    _, _, _, _ = streamed(client, response_format=fmt)
    stream = create(client, response_format=fmt, stream=True)
    forced = sum((c.choices[0].model_extra.get("speculative") or {}).get("forced", 0) for c in stream if c.choices)
    assert forced > 0
    metrics = httpx.get(f"{server.url}/metrics").text
    line = next(m for m in metrics.splitlines() if m.startswith("specstream_spec_decode_num_forced_tokens_total"))
    assert float(line.split()[-1]) >= forced


def test_sdk_types_tool_calls_assembles_streamed_deltas_and_parses_json(server):
    from specstream_client import Client, ToolCallAssembler

    with Client(f"{server.url}/v1") as sdk:
        kw = {
            "model": MODEL,
            "messages": CHAT,
            "temperature": 0,
            "max_tokens": 120,
            "tools": TOOLS,
            "tool_choice": "required",
        }
        whole = sdk.chat.completions.create(**kw)
        calls = whole.choices[0].message.tool_calls
        assert whole.choices[0].finish_reason == "tool_calls" and calls
        jsonschema.validate(calls[0].function.parsed_arguments(), SCHEMAS[calls[0].function.name])
        assembler = ToolCallAssembler()
        with sdk.chat.completions.create(stream=True, **kw) as stream:
            for chunk in stream:
                for choice in chunk.choices:
                    assembler.add(choice.delta)
        assert [(c.function.name, c.function.arguments) for c in assembler.calls] == [
            (c.function.name, c.function.arguments) for c in calls
        ]
        assert all(c.id.startswith("call_") and c.type == "function" for c in assembler.calls)
        fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
        reply = sdk.chat.completions.create(
            model=MODEL, messages=CHAT, temperature=0, max_tokens=80, response_format=fmt
        )
        jsonschema.validate(reply.choices[0].message.parsed(), SCHEMA)
