"""Hostile and careless input against a live server: wrong content types, text that is not
valid Unicode, numbers out of every bound, random JSON. Whatever arrives, the answer is a 2xx
or a 4xx in its API's error shape (OpenAI's, or Anthropic's on /v1/messages), never a 500, and
the next request is served as before."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway_server import LiveServer, ngram_config
from specstream import AsyncEngine, EngineConfig

MODEL = "tiny"
CHAT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
CHAT_BODY = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
COMPLETION_BODY = {"model": MODEL, "prompt": "Hello world", "max_tokens": 4}
ENDPOINTS = {"/v1/chat/completions": CHAT_BODY, "/v1/completions": COMPLETION_BODY}
LONE_SURROGATE = "\ud800"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = ngram_config(tiny_model_dir)
    engine = AsyncEngine(config, max_waiting=16)
    with LiveServer(create_app(engine, GatewaySettings(served_model_name=MODEL, max_body_bytes=256 * 1024))) as live:
        live.engine = engine
        yield live


def post(server, path: str, body, *, content_type: str | None = "application/json", **kw) -> httpx.Response:
    """POST raw bytes: json.dumps escapes lone surrogates, which httpx's json= would refuse."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": content_type} if content_type else {}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60, **kw)


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert isinstance(body["error"]["type"], str)
    return body["error"]


def prompt_tokens(server) -> float:
    return server.engine.metrics.registry.get_sample_value("specstream_prompt_tokens_total") or 0.0


# ------------------------------------------------------------------------- content type
@pytest.mark.parametrize("path", list(ENDPOINTS))
@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "application/json; charset=latin-1",
        "application/jsonx",
        "text/json",
    ],
)
def test_a_body_not_sent_as_json_is_415_and_never_reaches_the_engine(server, path, content_type):
    before = prompt_tokens(server)
    error = assert_openai_error(post(server, path, ENDPOINTS[path], content_type=content_type), 415)
    assert error["code"] == "unsupported_media_type"
    assert prompt_tokens(server) == before


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_multipart_form_is_415(server, path):
    r = httpx.post(f"{server.url}{path}", files={"body": ("b.json", json.dumps(ENDPOINTS[path]), "application/json")})
    assert_openai_error(r, 415)


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", "Application/JSON", 'application/json; charset="UTF-8"']
)
def test_json_content_types_with_utf8_charset_are_served(server, content_type):
    assert post(server, "/v1/chat/completions", CHAT_BODY, content_type=content_type).status_code == 200


# ------------------------------------------------------------------ invalid Unicode text
@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {**CHAT_BODY, "model": LONE_SURROGATE}, "model"),
        ("/v1/completions", {**COMPLETION_BODY, "model": "x" + LONE_SURROGATE}, "model"),
        ("/v1/completions", {**COMPLETION_BODY, "prompt": "Hello " + LONE_SURROGATE}, "prompt"),
        ("/v1/completions", {**COMPLETION_BODY, "prompt": ["fine", LONE_SURROGATE]}, "prompt[1]"),
        ("/v1/completions", {**COMPLETION_BODY, "stop": [LONE_SURROGATE]}, "stop[0]"),
        ("/v1/chat/completions", {**CHAT_BODY, "stop": LONE_SURROGATE}, "stop"),
        ("/v1/chat/completions", {**CHAT_BODY, "user": LONE_SURROGATE}, "user"),
        (
            "/v1/chat/completions",
            {**CHAT_BODY, "messages": [{"role": "user", "content": LONE_SURROGATE}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {**CHAT_BODY, "messages": [{"role": "user", "content": "hi", "name": "\udfff"}]},
            "messages[0].name",
        ),
        (
            "/v1/chat/completions",
            {**CHAT_BODY, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE_SURROGATE}]}]},
            "messages[0].content[0].text",
        ),
        ("/v1/chat/completions", {**CHAT_BODY, LONE_SURROGATE: 1}, None),
    ],
)
def test_lone_surrogates_anywhere_are_400_without_internal_ids(server, path, body, param):
    before = prompt_tokens(server)
    r = post(server, path, body)
    error = assert_openai_error(r, 400)
    assert error["param"] == param
    assert "cmpl" not in r.text and "#" not in r.text
    assert prompt_tokens(server) == before


# ---------------------------------------------------------------------- numeric bounds
BAD_NUMBERS = [
    ("top_k", 2**70),
    ("top_k", 2**21),
    ("top_k", -2),
    ("seed", 2**63),
    ("seed", -(2**63) - 1),
    ("max_tokens", 2**40),
    ("max_tokens", 0),
    ("n", 0),
    ("n", 2**70),
    ("temperature", 10**400),
    ("top_p", 0),
    ("presence_penalty", 2**70),
    ("frequency_penalty", -3),
    ("min_p", 1.5),
    ("min_p", -0.1),
    ("repetition_penalty", 0),
    ("repetition_penalty", 2**70),
    ("min_tokens", -1),
    ("min_tokens", 2**40),
]


@pytest.mark.parametrize("path", list(ENDPOINTS))
@pytest.mark.parametrize("field, value", BAD_NUMBERS)
def test_numbers_out_of_bounds_are_400_before_admission(server, path, field, value):
    before = prompt_tokens(server)
    body = (
        {**ENDPOINTS[path], field: value, "temperature": 1.0}
        if field != "temperature"
        else {**ENDPOINTS[path], field: value}
    )
    error = assert_openai_error(post(server, path, body), 400)
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert prompt_tokens(server) == before


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/chat/completions", "top_logprobs", 21),
        ("/v1/chat/completions", "max_completion_tokens", 2**70),
        ("/v1/completions", "logprobs", 6),
        ("/v1/completions", "best_of", 2**70),
        ("/v1/completions", "prompt", [2**70]),
        ("/v1/completions", "prompt", [[1, -1]]),
        ("/v1/chat/completions", "speculative", {"num_speculative_tokens": 2**70}),
    ],
)
def test_endpoint_specific_numbers_out_of_bounds_are_400(server, path, field, value):
    body = {**ENDPOINTS[path], field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    error = assert_openai_error(post(server, path, body), 400)
    assert (error["param"] or "").startswith(field)


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_top_k_2_to_the_70_is_400_and_the_server_keeps_serving(server, temperature):
    """The request that once killed the engine for good (greedy or sampled)."""
    body = {**CHAT_BODY, "temperature": temperature, "top_k": 2**70}
    error = assert_openai_error(post(server, "/v1/chat/completions", body), 400)
    assert error["param"] == "top_k"
    ok = post(server, "/v1/chat/completions", {**CHAT_BODY, "temperature": 1.0, "top_k": 5, "seed": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_the_largest_seed_with_several_choices_wraps_instead_of_failing(server):
    r = post(server, "/v1/chat/completions", {**CHAT_BODY, "seed": 2**63 - 1, "n": 2, "temperature": 1.0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_top_k_beyond_the_vocabulary_is_never_a_500(server):
    r = post(server, "/v1/chat/completions", {**CHAT_BODY, "top_k": 2**20, "temperature": 1.0})
    assert r.status_code in (200, 400)
    if r.status_code == 400:
        assert_openai_error(r, 400)


def test_n_times_prompts_over_the_queue_limit_is_400_not_429(server):
    body = {**COMPLETION_BODY, "prompt": ["a", "b", "c", "d", "e", "f"], "n": 3}  # 18 > max_waiting 16
    error = assert_openai_error(
        post(
            server,
            "/v1/completions",
            body,
        ),
        400,
    )
    assert error["param"] == "n"


# -------------------------------------------------------------------- random JSON bodies
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, 1, 2, 3, -1, 2**63, 2**31]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(["", LONE_SURROGATE, "tiny", "user", "text", "off", "ngram", "\x00", "<|im_end|>"]),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["role", "content", "type", "text", "method"]) | st.text(max_size=6), inner, max_size=4
        )
    ),
    max_leaves=12,
)
SHORT_TEXT = st.text(max_size=12)
# chat_template_kwargs: names a template may read, and names the server refuses
TEMPLATE_KWARGS = st.dictionaries(
    st.sampled_from(["enable_thinking", "persona", "messages", "9x", "eos_token"]),
    st.booleans() | SHORT_TEXT | st.integers(-5, 5),
    max_size=3,
)
# Values a client might plausibly send per field, so that many examples are valid and run the
# engine with random sampling settings (streamed or not); JSON_VALUES supplies the nonsense.
PLAUSIBLE = {
    "model": st.just(MODEL),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": SHORT_TEXT}
        ),
        min_size=1,
        max_size=3,
    ),
    "prompt": SHORT_TEXT
    | st.lists(st.integers(0, 383), min_size=1, max_size=6)
    | st.lists(SHORT_TEXT, min_size=1, max_size=2),
    "max_tokens": st.integers(1, 8),
    "max_completion_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 400),
    "n": st.integers(1, 2),
    "stop": SHORT_TEXT | st.lists(SHORT_TEXT, max_size=4),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.booleans() | st.integers(0, 5),
    "top_logprobs": st.integers(0, 20),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 8),
    "user": SHORT_TEXT,
    "ignore_eos": st.booleans(),
    "speculative": st.just("off")
    | st.fixed_dictionaries({"method": st.sampled_from(["ngram", "off"]), "num_speculative_tokens": st.integers(0, 8)}),
    "best_of": st.integers(1, 2),
    "echo": st.booleans(),
    "response_format": st.just({"type": "text"}),
    "modalities": st.just(["text"]),
    "prediction": st.fixed_dictionaries(
        {
            "type": st.just("content"),
            "content": SHORT_TEXT
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": SHORT_TEXT}), max_size=3),
        }
    ),
    "chat_template_kwargs": TEMPLATE_KWARGS,
}


COMMON_FIELDS = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "user",
    "ignore_eos",
    "speculative",
    "prediction",
]
ENDPOINT_FIELDS = {
    "/v1/chat/completions": COMMON_FIELDS
    + ["messages", "max_completion_tokens", "top_logprobs", "response_format", "modalities", "chat_template_kwargs"],
    "/v1/completions": COMMON_FIELDS + ["prompt", "best_of", "echo"],
}
LOGPROBS = {"/v1/chat/completions": st.booleans(), "/v1/completions": st.integers(0, 5)}


def bodies(path: str):
    """The endpoint's valid base body, streamed or not, with some fields replaced, added or
    dropped: half the examples use plausible values of the endpoint's own fields only, the
    other half any field name with plausible or random JSON."""
    base = ENDPOINTS[path]
    plausible = {**PLAUSIBLE, "logprobs": LOGPROBS[path]}
    own = st.lists(st.sampled_from(ENDPOINT_FIELDS[path] + ["logprobs"]), max_size=6, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: plausible[k] for k in keys})
    )
    anything = st.lists(st.sampled_from(sorted(plausible)) | st.text(max_size=8), max_size=5, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries(
            {k: plausible[k] | JSON_VALUES if k in plausible else JSON_VALUES for k in keys}
        )
    )
    dropped = st.sets(st.sampled_from(sorted(base)), max_size=2)
    return st.tuples(st.booleans(), dropped, own | anything).map(
        lambda c: {"stream": c[0], **{k: v for k, v in base.items() if k not in c[1]}, **c[2]}
    )


def short(body: dict) -> dict:
    """Keeps the examples that are valid fast: a valid length becomes at most 8 tokens (an
    absent one 4, not the whole context) and a valid n at most 2; invalid values stay."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and 8 < value < 2**31:
            body[key] = 8
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4
    if type(body.get("n")) is int and 2 < body["n"] <= 1024:
        body["n"] = 2
    return body


def check_answer(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and not any('"error"' in e[:20] for e in events), r.text[-500:]
    else:
        assert r.json()["choices"]


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_random_json_bodies_never_get_a_500_and_4xx_have_openais_shape(server, path):
    @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
    @given(body=bodies(path))
    def check(body):
        check_answer(post(server, path, short(body)))

    check()
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_random_bytes_never_get_a_500(server, path):
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
    @given(raw=st.binary(max_size=64) | st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")))
    def check(raw):
        check_answer(post(server, path, raw))

    check()


# ------------------------------------------- random JSON bodies on the Responses, Messages and tokenizer APIs
FUNCTION_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": FUNCTION_PARAMETERS}
MESSAGES_TOOL = {"name": "get_weather", "input_schema": FUNCTION_PARAMETERS}
# path -> (its valid base body, the shape of its errors, its own fields)
OTHER_APIS = {
    "/v1/responses": (
        {"model": MODEL, "input": "The quick brown fox", "max_output_tokens": 4},
        "openai",
        ["input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "store"]
        + ["previous_response_id", "parallel_tool_calls", "metadata", "text", "tools", "tool_choice"],
    ),
    "/v1/messages": (
        {"model": MODEL, "max_tokens": 4, "messages": CHAT},
        "anthropic",
        ["messages", "system", "max_tokens", "temperature", "top_p", "top_k", "stream", "stop_sequences"]
        + ["tools", "tool_choice", "output_config"],
    ),
    "/v1/messages/count_tokens": (
        {"model": MODEL, "messages": CHAT},
        "anthropic",
        ["messages", "system", "tools", "tool_choice"],
    ),
    "/tokenize": (
        {"prompt": "Hello world"},
        "openai",
        ["prompt", "messages", "return_token_strs", "model", "add_special_tokens", "add_generation_prompt"]
        + ["continue_final_message", "chat_template_kwargs"],
    ),
    "/detokenize": ({"tokens": [1, 2, 3]}, "openai", ["tokens", "model"]),
}
ROLE_TEXT = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": SHORT_TEXT})
RESPONSES_ITEMS = st.lists(
    ROLE_TEXT
    | st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user"]),
            "content": st.lists(st.fixed_dictionaries({"type": st.just("input_text"), "text": SHORT_TEXT}), max_size=2),
        }
    )
    | st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": SHORT_TEXT,
            "name": st.just("get_weather"),
            "arguments": SHORT_TEXT,
        }
    )
    | st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": SHORT_TEXT, "output": SHORT_TEXT}),
    max_size=4,
)
ANTHROPIC_BLOCKS = st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": SHORT_TEXT})
    | st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": SHORT_TEXT, "name": st.just("get_weather"), "input": st.just({"city": "x"})}
    )
    | st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": SHORT_TEXT, "content": SHORT_TEXT}),
    max_size=3,
)
OTHER_PLAUSIBLE = {
    "model": st.just(MODEL),
    "input": SHORT_TEXT | RESPONSES_ITEMS,
    "instructions": SHORT_TEXT,
    "max_output_tokens": st.integers(1, 8),
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 400),
    "stream": st.booleans(),
    "store": st.booleans(),
    "previous_response_id": SHORT_TEXT,
    "parallel_tool_calls": st.booleans(),
    "metadata": st.dictionaries(SHORT_TEXT, SHORT_TEXT, max_size=3),
    "text": st.sampled_from(
        [{"format": {"type": "text"}}, {"format": {"type": "json_object"}}, {"format": {"type": "json_schema"}}]
    )
    | st.just({"format": {"type": "json_schema", "name": "x", "schema": FUNCTION_PARAMETERS}}),
    "tools": st.lists(JSON_VALUES, max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "messages": st.lists(
        ROLE_TEXT
        | st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]), "content": ANTHROPIC_BLOCKS}),
        min_size=1,
        max_size=3,
    ),
    "system": SHORT_TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": SHORT_TEXT}), max_size=2),
    "stop_sequences": st.lists(SHORT_TEXT, max_size=5),
    "output_config": st.just({"format": {"type": "json_schema", "schema": FUNCTION_PARAMETERS}}),
    "prompt": SHORT_TEXT,
    "tokens": st.lists(st.integers(0, 400), max_size=6),
    "return_token_strs": st.booleans(),
    "add_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "chat_template_kwargs": TEMPLATE_KWARGS,
}


# The tools and tool_choice each API takes.
TOOL_FIELDS = {
    "/v1/responses": {
        "tools": st.just([RESPONSES_TOOL]),
        "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "get_weather"}]),
    },
    "/v1/messages": {
        "tools": st.just([MESSAGES_TOOL]),
        "tool_choice": st.fixed_dictionaries(
            {"type": st.sampled_from(["auto", "any", "tool", "none"]), "name": st.just("get_weather")}
        ),
    },
}
TOOL_FIELDS["/v1/messages/count_tokens"] = TOOL_FIELDS["/v1/messages"]


def other_bodies(path: str):
    """As bodies(): the API's base body with some fields replaced, added or dropped; half the examples
    use plausible values of the API's own fields only, the other half any field with plausible or
    random JSON."""
    base, _, own_fields = OTHER_APIS[path]
    plausible = {**OTHER_PLAUSIBLE, **TOOL_FIELDS.get(path, {})}
    own = st.lists(st.sampled_from(own_fields), max_size=6, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: plausible[k] for k in keys})
    )
    anything = st.lists(st.sampled_from(sorted(plausible)) | st.text(max_size=8), max_size=5, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries(
            {k: plausible[k] | JSON_VALUES if k in plausible else JSON_VALUES for k in keys}
        )
    )
    dropped = st.just(set()) | st.sets(st.sampled_from(sorted(base)), max_size=1)
    return st.tuples(dropped, own | anything).map(
        lambda c: {**{k: v for k, v in base.items() if k not in c[0]}, **c[1]}
    )


def assert_anthropic_error(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def check_other_answer(path: str, r: httpx.Response) -> bool:
    """Whether r was served (2xx), after checking it: never a 500, a 4xx in the API's error shape, a stream that
    ends as the API ends one with no error event, or the API's own body."""
    assert r.status_code < 500, r.text
    anthropic = OTHER_APIS[path][1] == "anthropic"
    if r.status_code >= 400:
        (assert_anthropic_error if anthropic else assert_openai_error)(r, r.status_code)
    elif r.headers["content-type"].startswith("text/event-stream"):
        names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
        assert names[-1] == ("message_stop" if anthropic else "response.completed") and "error" not in names, r.text
    else:
        body = r.json()
        if path == "/v1/responses":
            assert body["object"] == "response" and isinstance(body["output"], list), body
        elif path == "/v1/messages":
            assert body["type"] == "message" and body["role"] == "assistant", body
        elif path == "/v1/messages/count_tokens":
            assert type(body["input_tokens"]) is int and body["input_tokens"] > 0, body
        elif path == "/tokenize":
            assert type(body["count"]) is int and len(body["tokens"]) == body["count"], body
        else:
            assert isinstance(body["prompt"], str), body
    return r.status_code < 300


@pytest.mark.parametrize("path", list(OTHER_APIS))
def test_random_json_bodies_on_the_other_apis_never_get_a_500_and_4xx_have_their_apis_shape(server, path):
    served = []

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
    @given(body=other_bodies(path))
    def check(body):
        for key in ("max_output_tokens", "max_tokens"):  # valid lengths stay short; invalid ones stay
            if type(body.get(key)) is int and 8 < body[key] < 2**31:
                body[key] = 8
        if path == "/v1/responses" and body.get("max_output_tokens") is None:
            body["max_output_tokens"] = 4
        served.append(check_other_answer(path, post(server, path, body)))

    check()
    assert sum(served) >= 3, f"{sum(served)} of {len(served)} examples were served: the valid path went untested"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert check_other_answer(path, post(server, path, OTHER_APIS[path][0]))  # the next plain request is served


@pytest.mark.parametrize("path", list(OTHER_APIS))
def test_random_bytes_on_the_other_apis_never_get_a_500(server, path):
    @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)
    @given(raw=st.binary(max_size=64) | st.text(max_size=64).map(lambda t: t.encode("utf-8", "surrogatepass")))
    def check(raw):
        check_other_answer(path, post(server, path, raw))

    check()


# --------------------------------------------------------------------------- headers
@pytest.mark.parametrize(
    "headers",
    [
        {"authorization": b"Bearer \xff\xfe"},
        {"authorization": "Bearer"},
        {"authorization": "Basic a2V5"},
        {"authorization": "Bearer " + "k" * 4000},
    ],
)
async def test_odd_authorization_headers_are_401_in_openais_shape(headers):
    from specstream import AsyncEngine as Engine

    app = create_app(Engine(EngineConfig(model="unused")), GatewaySettings(api_keys=("key",)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/chat/completions", json=CHAT_BODY, headers=headers)
    assert_openai_error(r, 401)


def test_a_huge_declared_content_length_is_413_before_reading(server):
    import socket

    request = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"Content-Length: {10**12}\r\nConnection: close\r\n\r\n{{}}"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request.encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:300]
    assert json.loads(body)["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(
    "method, path", [("GET", "/v1/chat/completions"), ("DELETE", "/v1/completions"), ("POST", "/health")]
)
def test_wrong_methods_are_405_in_openais_shape(server, method, path):
    assert_openai_error(httpx.request(method, f"{server.url}{path}"), 405)


def test_serve_flags_reach_the_engine_config():
    from gateway.cli import build_parser, engine_config

    args = build_parser().parse_args(
        [
            "serve",
            "--allow-special-tokens-in-content",
            "--max-prompt-chars",
            "1000",
            "--seed",
            "7",
            "--no-prefix-caching",
            "--no-tree-drafts",
        ]
    )
    config = engine_config(args)
    assert not config.speculative.tree_drafts
    assert config.allow_special_tokens_in_content and config.max_prompt_chars == 1000 and config.seed == 7
    assert not config.enable_prefix_caching
    defaults = engine_config(build_parser().parse_args(["serve"]))
    assert not defaults.allow_special_tokens_in_content and defaults.max_prompt_chars is None
    assert defaults.speculative.tree_drafts
