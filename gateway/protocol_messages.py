"""The Anthropic Messages API request (POST /v1/messages, /v1/messages/count_tokens) and its
translation into the chat request the engine already serves: system becomes a system message,
tool_use blocks an assistant turn's tool calls, tool_result blocks tool messages, tools and
tool_choice chat's (auto, any = required, tool = a named function, none), stop_sequences stop.

Validation is as strict as chat's, with Anthropic's own bounds (temperature at most 1, top_k at
least 0); blocks this server cannot take (images, documents, thinking) are 400s naming them."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, Field

from gateway.errors import APIError
from gateway.protocol import MAX_TOKENS, MAX_TOP_K, ChatCompletionRequest, _Strict, parse
from gateway.protocol_responses import NAME, validate_object

MAX_ID_CHARS = 256


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None  # accepted: the prefix cache needs no marks
    citations: list | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: str = Field(pattern=NAME)
    input: dict
    cache_control: dict | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    content: str | list[dict] | None = None
    is_error: bool | None = None
    cache_control: dict | None = None


BLOCKS: dict[str, type[BaseModel]] = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock}
ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[dict]


class Tool(_Strict):
    name: str = Field(pattern=NAME)
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: dict | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, pattern=NAME)
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["disabled"]


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted; no thinking to spend it on


class Metadata(_Strict):
    user_id: str | None = Field(default=None, max_length=256)


class CountTokensRequest(_Strict):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: dict | None = None  # accepted: the prefix cache needs no marks

    def chat_body(self) -> dict:
        """The chat request's body (what both endpoints share)."""
        messages = self.system_messages()
        for i, message in enumerate(self.messages):
            messages += chat_messages(message, f"messages[{i}]")
        tools = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in self.tools or []
        ]
        choice: Any = None
        parallel = True
        if self.tool_choice is not None:
            kind = self.tool_choice.type
            choice = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
            if kind == "tool":
                if self.tool_choice.name is None:
                    raise APIError(400, "tool_choice of type 'tool' needs name", param="tool_choice.name")
                choice = {"type": "function", "function": {"name": self.tool_choice.name}}
            parallel = not self.tool_choice.disable_parallel_tool_use
        for tool in tools:
            tool["function"] = {k: v for k, v in tool["function"].items() if v is not None}
        return {
            "model": self.model,
            "messages": messages,
            "tools": tools or None,
            "tool_choice": choice,
            "parallel_tool_calls": parallel,
        }

    def system_messages(self) -> list[dict]:
        if self.system is None:
            return []
        if isinstance(self.system, str):
            return [{"role": "system", "content": self.system}]
        blocks = [_block(raw, f"system[{j}]", ("text",)) for j, raw in enumerate(self.system)]
        return [{"role": "system", "content": "".join(b.text for b in blocks)}]

    def chat_request(self) -> ChatCompletionRequest:
        return parse(ChatCompletionRequest, self.chat_body())


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=MAX_TOP_K)
    stream: bool = False
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None

    def chat_request(self) -> ChatCompletionRequest:
        body = {
            **self.chat_body(),
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stream": self.stream,
            "user": self.metadata.user_id if self.metadata is not None else None,
            "response_format": self.response_format(),
        }
        return parse(ChatCompletionRequest, body)

    def response_format(self) -> dict | None:
        """output_config.format as chat's response_format: the same grammar path."""
        fmt = self.output_config.format if self.output_config is not None else None
        return (
            None if fmt is None else {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
        )


def _block(raw: Any, where: str, allowed: tuple[str, ...]):
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind not in allowed:
        shown = str(kind)[:40]
        raise APIError(
            400,
            f"{where}: blocks of type {shown!r} are not supported here (this server takes {', '.join(allowed)})",
            param=f"{where}.type",
        )
    return validate_object(BLOCKS[kind], raw, where)


def _result_text(block: ToolResultBlock, where: str) -> str:
    content = block.content
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        text = "".join(_block(raw, f"{where}.content[{j}]", ("text",)).text for j, raw in enumerate(content))
    return f"Error: {text}" if block.is_error else text


def chat_messages(message: Message, where: str) -> list[dict]:
    """One Anthropic message as chat messages: a user turn's tool results become tool messages
    (before its text); an assistant turn's tool_use blocks become its tool calls."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    blocks = [_block(raw, f"{where}.content[{j}]", ROLE_BLOCKS[message.role]) for j, raw in enumerate(message.content)]
    text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
    if message.role == "assistant":
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in blocks
            if isinstance(b, ToolUseBlock)
        ]
        return [
            {"role": "assistant", "content": text or None, "tool_calls": calls}
            if calls
            else {"role": "assistant", "content": text}
        ]
    results = [
        {"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b, f"{where}.content[{j}]")}
        for j, b in enumerate(blocks)
        if isinstance(b, ToolResultBlock)
    ]
    return results + ([{"role": "user", "content": text}] if text or not results else [])
