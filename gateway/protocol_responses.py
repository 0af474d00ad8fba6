"""The OpenAI Responses API request (POST /v1/responses) and its translation into the chat
request the engine already serves: input items become chat messages, instructions a system
message, function tools chat tools, text.format a response_format, max_output_tokens max_tokens.

Validation is as strict as chat's: unknown fields, wrong types and out-of-range numbers are 400s
naming the field as the client sent it (input[2].call_id, text.format.schema), and features this
server does not implement (built-in tools, images, background runs) are named in the error."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from gateway.errors import APIError
from gateway.protocol import MAX_TOKENS, ChatCompletionRequest, _Strict, parse

NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
MAX_ID_CHARS = 256
# Input content kinds and items of the API that this server does not take (text only, no built-in tools).
UNSUPPORTED_CONTENT = ("input_image", "input_file", "input_audio")
MESSAGE_PARTS = {"user": "input_text", "system": "input_text", "developer": "input_text", "assistant": "output_text"}
ID = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=NAME)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Strict):
    """Accepted for clients that always send it; this server's models do not reason apart."""

    effort: Literal["minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict]
    id: str | None = ID
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    name: str = Field(pattern=NAME)
    arguments: str
    id: str | None = ID
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    output: str | list[dict]
    id: str | None = ID
    status: Literal["in_progress", "completed", "incomplete"] | None = None


ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}
Item = MessageItem | FunctionCallItem | FunctionCallOutputItem


class ResponsesRequest(_Strict):
    model: str
    input: str | list[dict] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[dict] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = False
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    truncation: Literal["disabled"] | None = None
    # Only what there is nothing to add for (no reasoning items); asking for logprobs is a 400, not ignored.
    include: list[Literal["reasoning.encrypted_content"]] | None = Field(default=None, max_length=8)
    reasoning: Reasoning | None = None
    background: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None

    def check_metadata(self) -> None:
        for key, value in (self.metadata or {}).items():
            if not 0 < len(key) <= 64 or len(value) > 512:
                raise APIError(400, "metadata keys have 1 to 64 characters and values at most 512", param="metadata")

    def items(self) -> list[Item]:
        """The input as items (a string is one user message), each checked with its own param."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return [parse_item(raw, f"input[{i}]") for i, raw in enumerate(self.input)]

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for i, raw in enumerate(self.tools or []):
            kind = raw.get("type")
            if kind != "function":
                raise APIError(
                    400,
                    f"tools[{i}]: only function tools are supported by this server (not {str(kind)[:40]!r})",
                    param=f"tools[{i}].type",
                    code="unsupported_parameter",
                )
            tools.append(validate_object(FunctionTool, raw, f"tools[{i}]"))
        return tools

    def chat_request(self, history: list[Item]) -> ChatCompletionRequest:
        """The chat request this asks for, after the stored conversation `history` (previous_response_id)."""
        self.check_metadata()
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else []) + (
            chat_messages(history + self.items(), offset=len(history))
        )
        tools = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
            for t in self.function_tools()
        ]
        choice: Any = self.tool_choice
        if isinstance(choice, NamedFunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        body = {
            "model": self.model,
            "messages": messages,
            "stream": self.stream,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "tools": tools or None,
            "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.response_format(),
            "user": self.user,
            "prompt_cache_key": self.prompt_cache_key,
        }
        return parse(ChatCompletionRequest, body)

    def response_format(self) -> dict | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            return None if fmt is None else {"type": fmt.type}
        if fmt.name is None or fmt.schema_ is None:
            raise APIError(400, "text.format json_schema needs name and schema", param="text.format")
        schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}

    def text_config(self) -> dict:
        """text as the response echoes it."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        return {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}}


def validate_object(model: type[BaseModel], raw: Any, where: str):
    if not isinstance(raw, dict):
        raise APIError(400, f"{where} must be an object", param=where)
    try:
        return model.model_validate({k: v for k, v in raw.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in err["loc"])
        param = f"{where}{loc}"[:100]
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized argument supplied: {param}", param=param) from None
        raise APIError(400, f"Invalid value for '{param}': {err['msg']}", param=param) from None


def parse_item(raw: Any, where: str) -> Item:
    kind = raw.get("type", "message") if isinstance(raw, dict) else None
    model = ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        shown = str(kind)[:40]
        raise APIError(
            400,
            f"{where}: items of type {shown!r} are not supported by this server "
            "(message, function_call and function_call_output are)",
            param=f"{where}.type",
            code="unsupported_parameter",
        )
    return validate_object(model, raw, where)


def _content_text(content: str | list[dict], where: str, part_type: str) -> str:
    """Text parts of the kind the role takes (input_text, or output_text for the assistant) joined."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in UNSUPPORTED_CONTENT:
            raise APIError(
                400,
                f"{where}: {kind} content is not supported by this server (text only)",
                param=f"{where}.content[{j}]",
                code="unsupported_parameter",
            )
        allowed = {"type", "text"} | ({"annotations", "logprobs"} if kind == "output_text" else set())
        if kind not in (part_type, "input_text") or not isinstance(part.get("text"), str) or set(part) - allowed:
            raise APIError(
                400,
                f"{where}.content[{j}] must be {{'type': '{part_type}', 'text': str}}",
                param=f"{where}.content[{j}]",
            )
        texts.append(part["text"])
    return "".join(texts)


def chat_messages(items: list[Item], offset: int = 0) -> list[dict]:
    """Items as chat messages: function calls join the assistant turn they follow, and each
    output becomes a tool message. offset: items before the request's own input (a stored conversation)."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i - offset}]" if i >= offset else "previous_response_id"
        if isinstance(item, MessageItem):
            role = item.role
            messages.append({"role": role, "content": _content_text(item.content, where, MESSAGE_PARTS[role])})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            output = _content_text(item.output, where, "input_text")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages
