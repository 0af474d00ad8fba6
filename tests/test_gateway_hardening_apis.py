"""Random JSON and random bytes against the other APIs the server speaks: OpenAI's Responses (/v1/responses),
Anthropic's Messages (/v1/messages, /v1/messages/count_tokens) and vLLM's /tokenize and /detokenize. As on the
chat endpoints (test_gateway_hardening.py), whatever arrives, the answer is a 2xx with the API's own body (a
stream that ends as the API ends one, with no error event) or a 4xx in the API's error shape (Anthropic's on
/v1/messages), never a 500, and the server is healthy after."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway_server import WEATHER_PARAMETERS, LiveServer, ngram_config
from specstream import AsyncEngine
from test_gateway_hardening import JSON_VALUES, LONE_SURROGATE, assert_openai_error, post

MODEL = "tiny"
PROMPT = "The quick brown fox"
BASES = {
    "/v1/responses": {"model": MODEL, "input": PROMPT, "max_output_tokens": 4},
    "/v1/messages": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": PROMPT}]},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]},
    "/tokenize": {"model": MODEL, "prompt": PROMPT},
    "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
}
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")

TEXT = st.text(max_size=12) | st.sampled_from(["", LONE_SURROGATE, "<|im_end|>", "\x00"])
ROLES = st.sampled_from(["user", "assistant", "system", "developer", "tool", "bot"])
RESPONSE_PARTS = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["input_text", "output_text", "text", "input_image"]), "text": TEXT}
    ),
    max_size=2,
)
RESPONSE_ITEMS = st.lists(
    st.fixed_dictionaries({"role": ROLES, "content": TEXT | RESPONSE_PARTS})
    | st.fixed_dictionaries({"type": st.just("message"), "role": ROLES, "content": TEXT | RESPONSE_PARTS})
    | st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXT, "output": TEXT})
    | st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": TEXT,
            "name": TEXT,
            "arguments": TEXT | st.just('{"city": "Oslo"}'),
        }
    ),
    min_size=1,
    max_size=3,
)
BLOCKS = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "tool_result"]), "text": TEXT})
    | st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": TEXT, "content": TEXT})
    | st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": TEXT, "name": TEXT, "input": st.just({"city": "Oslo"})}
    ),
    min_size=1,
    max_size=2,
)
ANTHROPIC_MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": TEXT | BLOCKS}),
    min_size=1,
    max_size=3,
)
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather.",
    "parameters": WEATHER_PARAMETERS,
}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "Weather.", "input_schema": WEATHER_PARAMETERS}
SAMPLING = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "stream": st.booleans(),
    "model": st.just(MODEL) | TEXT,
}
# Values a client might plausibly send per field, so that many examples are valid and generate; JSON_VALUES
# supplies the nonsense.
PLAUSIBLE = {
    "/v1/responses": {
        **SAMPLING,
        "input": TEXT | RESPONSE_ITEMS,
        "instructions": TEXT,
        "max_output_tokens": st.integers(1, 8),
        "store": st.booleans(),
        "previous_response_id": TEXT | st.just("resp_0"),
        "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=6), max_size=2),
        "tools": st.just([RESPONSES_TOOL]),
        "tool_choice": st.sampled_from(["auto", "none", "required"])
        | st.just({"type": "function", "name": "get_weather"}),
        "text": st.sampled_from([{"format": {"type": "text"}}, {"format": {"type": "json_object"}}]),
        "parallel_tool_calls": st.booleans(),
        "truncation": st.sampled_from(["disabled", "auto"]),
        "user": TEXT,
    },
    "/v1/messages": {
        **SAMPLING,
        "max_tokens": st.integers(1, 8),
        "messages": ANTHROPIC_MESSAGES,
        "system": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2),
        "stop_sequences": st.lists(TEXT, max_size=3),
        "top_k": st.integers(-1, 400),
        "metadata": st.fixed_dictionaries({"user_id": TEXT}),
        "tools": st.just([ANTHROPIC_TOOL]),
        "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}])
        | st.just({"type": "tool", "name": "get_weather"}),
    },
    "/v1/messages/count_tokens": {
        "model": SAMPLING["model"],
        "messages": ANTHROPIC_MESSAGES,
        "system": TEXT,
        "tools": st.just([ANTHROPIC_TOOL]),
    },
    "/tokenize": {
        "model": SAMPLING["model"],
        "prompt": TEXT,
        "messages": st.lists(st.fixed_dictionaries({"role": ROLES, "content": TEXT}), min_size=1, max_size=2),
        "add_special_tokens": st.booleans(),
        "add_generation_prompt": st.booleans(),
        "continue_final_message": st.booleans(),
        "return_token_strs": st.booleans(),
    },
    "/detokenize": {
        "model": SAMPLING["model"],
        "tokens": st.lists(st.integers(-3, 400) | st.sampled_from([2**31, 2**63]), max_size=6),
    },
}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = AsyncEngine(ngram_config(tiny_model_dir), max_waiting=16)
    with LiveServer(create_app(engine, GatewaySettings(served_model_name=MODEL, max_body_bytes=256 * 1024))) as live:
        yield live


def bodies(path: str):
    """The endpoint's valid base body with some fields replaced, added or dropped: half the examples use
    plausible values of the endpoint's own fields only, the other half any field name with plausible or random
    JSON."""
    base, plausible = BASES[path], PLAUSIBLE[path]
    own = st.lists(st.sampled_from(sorted(plausible)), max_size=6, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: plausible[k] for k in keys})
    )
    anything = st.lists(st.sampled_from(sorted(plausible)) | st.text(max_size=8), max_size=5, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries(
            {k: plausible[k] | JSON_VALUES if k in plausible else JSON_VALUES for k in keys}
        )
    )
    dropped = st.sets(st.sampled_from(sorted(base)), max_size=2)
    return st.tuples(dropped, own | anything).map(
        lambda c: {**{k: v for k, v in base.items() if k not in c[0]}, **c[1]}
    )


def short(body: dict) -> dict:
    """A valid length becomes at most 8 tokens, so that valid examples are fast; invalid values stay."""
    for key in ("max_tokens", "max_output_tokens"):
        value = body.get(key)
        if type(value) is int and 8 < value < 2**31:
            body[key] = 8
    return body


def events(text: str) -> list[tuple[str, dict]]:
    """A named-event stream's (event, data) pairs."""
    out, kind = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            kind = line[7:].strip()
        elif line.startswith("data: "):
            out.append((kind, json.loads(line[6:])))
    return out


def check_answer(path: str, r: httpx.Response) -> bool:
    """Whether r is a success (2xx), after checking it as the module's docstring says."""
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        if path in ANTHROPIC:
            assert r.headers["content-type"].startswith("application/json")
            body = r.json()
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"]
        else:
            assert_openai_error(r, r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        seen = events(r.text)
        assert seen and all(kind != "error" for kind, _ in seen), r.text[-800:]
        last = "response.completed" if path == "/v1/responses" else "message_stop"
        assert seen[-1][0] == last and seen[-1][1]["type"] == last, r.text[-800:]
    else:
        body = r.json()
        if path == "/v1/responses":
            assert body["object"] == "response" and isinstance(body["output"], list), body
        elif path == "/v1/messages":
            assert body["type"] == "message" and body["role"] == "assistant", body
        elif path == "/v1/messages/count_tokens":
            assert type(body["input_tokens"]) is int and body["input_tokens"] >= 0, body
        elif path == "/tokenize":
            assert type(body["count"]) is int and len(body["tokens"]) == body["count"], body
        else:
            assert isinstance(body["prompt"], str), body
    return r.status_code < 300


@pytest.mark.parametrize("path", list(BASES))
def test_random_json_bodies_never_get_a_500_and_4xx_have_the_apis_shape(server, path):
    served = []

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
    @given(body=bodies(path))
    def check(body):
        served.append(check_answer(path, post(server, path, short(body))))

    check()
    assert sum(served) >= 3, f"{sum(served)} of {len(served)} examples were served: the valid path went untested"
    assert httpx.get(f"{server.url}/health").status_code == 200
    check_answer(path, post(server, path, BASES[path]))  # and the next plain request is served


@pytest.mark.parametrize("path", list(BASES))
def test_random_bytes_never_get_a_500(server, path):
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
    @given(raw=st.binary(max_size=64) | st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")))
    def check(raw):
        check_answer(path, post(server, path, raw))

    check()
