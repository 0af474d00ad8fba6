"""Tool calling through a chat template that has its own tool support (the Hermes <tool_call>
format of Qwen 2.5/3, SmolLM3, Hermes 2/3): definitions, earlier calls and tool results are
rendered by the template itself (ChatPrompt), and the output is parsed and held to the same
format. Templates without tool support keep the gateway's default rendering (tests in
test_gateway_structured.py)."""

from __future__ import annotations

import json
import random

import openai
import pytest
from transformers import AutoTokenizer

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway_server import LiveServer
from specstream import (
    AsyncEngine,
    ChatPrompt,
    EngineConfig,
    InvalidRequestError,
    SpeculativeConfig,
    template_calls_tools,
)
from specstream.engine.processor import InputProcessor
from test_gateway_structured import ADD, CHAT, HISTORY, MODEL, TOOLS, check_calls

# A Qwen 2.5-style template, cut down: tools in the system turn, calls as <tool_call> blocks,
# tool results as <tool_response> blocks in a user turn.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}{%- else %}You are a helpful assistant.{%- endif %}"
    "\n\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant"
    "{%- if message.content %}\n{{ message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    '\n<tool_call>\n{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = HERMES_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    config = EngineConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        chat_template=HERMES_TEMPLATE,
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4),
    )
    with LiveServer(create_app(AsyncEngine(config), GatewaySettings(served_model_name=MODEL))) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def template_ids(tokenizer, messages, tools=None) -> list[int]:
    """What the template alone makes of an OpenAI conversation (tool-call arguments as objects)."""
    rendered = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        rendered.append(m)
    kw = {"tools": tools} if tools else {}
    return list(
        tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True, return_dict=False, **kw)
    )


def test_which_templates_render_tools_themselves(tokenizer, tiny_model_dir):
    assert template_calls_tools(tokenizer)
    assert not template_calls_tools(AutoTokenizer.from_pretrained(tiny_model_dir))  # plain ChatML


def test_the_template_renders_tools_calls_and_results(client, tokenizer):
    """The prompt the engine ran is exactly the template's rendering (the default format would
    differ in length): tools offered, and a history of a call and its result."""
    r = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == len(template_ids(tokenizer, CHAT, TOOLS))
    r = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == len(template_ids(tokenizer, HISTORY, TOOLS))
    # tool_choice "none": the history is still the template's, with no definitions offered.
    r = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert r.usage.prompt_tokens == len(template_ids(tokenizer, HISTORY))


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_calls_in_the_template_format_parse_streamed_and_not(client, tool_choice):
    kw = dict(model=MODEL, messages=HISTORY, tools=[ADD], tool_choice=tool_choice, max_tokens=100, temperature=0)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    calls = [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in r.choices[0].message.tool_calls
    ]
    check_calls(calls, {"add"})
    streamed: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            slot = streamed.setdefault(call.index, {"name": None, "arguments": ""})
            slot["name"] = call.function.name or slot["name"]
            slot["arguments"] += call.function.arguments or ""
    assert list(streamed.values()) == [{"name": c["name"], "arguments": c["arguments"]} for c in calls]


@pytest.mark.parametrize("arguments", ["{not json", '{"a": NaN}', "[1, 2]", "[" * 100_000 + "]" * 100_000])
def test_bad_arguments_in_a_history_call_are_a_400(client, arguments):
    bad = json.loads(json.dumps(HISTORY))
    bad[1]["tool_calls"][0]["function"]["arguments"] = arguments
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=bad, tools=[ADD], max_tokens=2)
    assert err.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def processor(tokenizer, max_prompt_chars=None) -> InputProcessor:
    return InputProcessor(
        tokenizer=tokenizer,
        output_tokenizer=tokenizer,
        vocab_size=len(tokenizer),
        max_model_len=1024,
        rng=random.Random(0),
        max_prompt_chars=max_prompt_chars,
    )


def test_chat_prompts_are_checked_before_the_template_runs(tokenizer, tiny_model_dir):
    tools = [ADD]
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert processor(tokenizer).encode(ChatPrompt(messages, tools)) == template_ids(
        tokenizer,
        [
            messages[0],
            {**messages[1], "tool_calls": [{**call, "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        ],
        tools,
    )
    for bad in ({**call, "function": {"name": "add", "arguments": "{}"}}, {"id": "c"}, "add"):
        with pytest.raises(InvalidRequestError, match="tool_calls"):
            processor(tokenizer).encode(
                ChatPrompt([messages[0], {"role": "assistant", "content": "", "tool_calls": [bad]}])
            )
    with pytest.raises(InvalidRequestError, match="plain JSON"):
        processor(tokenizer).encode(ChatPrompt(messages, [{"type": "function", "function": {"name": "f", "x": {1, 2}}}]))
    with pytest.raises(InvalidRequestError, match="tools must be") as err:
        processor(tokenizer).encode(ChatPrompt(messages, tools="add"))
    assert err.value.param == "tools"
    # Tool definitions count towards the prompt's character cap, before any templating.
    huge = [{**ADD, "function": {**ADD["function"], "description": "x" * 5000}}]
    with pytest.raises(InvalidRequestError, match="characters"):
        processor(tokenizer, max_prompt_chars=4000).encode(ChatPrompt(messages, huge))
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(InvalidRequestError, match="<tool_call> format") as err:
        processor(plain).encode(ChatPrompt(messages, tools))
    assert err.value.param == "tools"
