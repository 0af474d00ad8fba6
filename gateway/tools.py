"""Tool calling in one clear default format, for chat templates without tool support.

Prompt: the tool definitions go into the system message (appended to the first one, or a new
one), an assistant turn's tool calls become ``<tool_call>`` blocks in its content, and a
``tool`` message becomes a user turn holding a ``<tool_response>`` block:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Output: a grammar holds the model to that format, per tool_choice:
- "none": no grammar and no tool definitions in the prompt; the model answers in text;
- "auto": either plain text that does not begin with "<", or one or more tool calls;
- "required": one or more tool calls (exactly one when parallel_tool_calls is false);
- a named function: exactly one call of it.
Each call's arguments are held to the function's JSON schema, and the key order is fixed
(name, then arguments), so the parser below can stream a call's name as soon as it is
complete and its arguments as they are written. A streamed call's argument fragments
concatenate to exactly the arguments of the same output unstreamed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from specstream import JSON_OPTIONS, StructuredOutput

CALL_OPEN = "<tool_call>\n"
CALL_CLOSE = "}\n</tool_call>"
_CALL_HEAD = re.compile(r'\s*<tool_call>\n\{"name": "([A-Za-z0-9_.\-]+)", "arguments": ')

SYSTEM_TOOLS = """# Tools

You may call one or more functions to help with the user's request. The functions are:
<tools>
{tools}
</tools>

To call a function, reply with a JSON object holding its name and arguments inside <tool_call></tool_call> tags:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>"""


def render_messages(messages: list[dict], tools: list[dict], tool_choice) -> list[dict]:
    """OpenAI chat messages (with tool calls and tool results) -> plain role/content messages
    in the default format. tools: OpenAI tool definitions; rendered unless tool_choice is "none"."""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [render_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if tools and tool_choice != "none":
        spec = SYSTEM_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{spec}"}
        else:
            out.insert(0, {"role": "system", "content": spec})
    return out


def render_call(name: str, arguments: str) -> str:
    return f'{CALL_OPEN}{{"name": "{name}", "arguments": {arguments}{CALL_CLOSE}'


def _lark_literal(text: str) -> str:
    return json.dumps(text)


def tool_grammar(tools: list[dict], tool_choice, parallel: bool) -> StructuredOutput | None:
    """The grammar for the model's reply given the tools and tool_choice (None for "none")."""
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        wanted = tool_choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == wanted]
    rules = []
    alternatives = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        schema = dict(fn.get("parameters") or {"type": "object", "properties": {}})
        schema["x-guidance"] = JSON_OPTIONS
        head = f'{CALL_OPEN}{{"name": "{fn["name"]}", "arguments": '
        rules.append(f"call_{i}: {_lark_literal(head)} args_{i} {_lark_literal(CALL_CLOSE)}")
        rules.append(f"args_{i}: %json {json.dumps(schema)}")
        alternatives.append(f"call_{i}")
    rules.append("call: " + " | ".join(alternatives))
    calls = 'call ("\\n" call)*' if parallel and not isinstance(tool_choice, dict) else "call"
    if tool_choice == "auto":
        start = f"start: text | {calls}\ntext: /[^<](.|\\n)*/"
    else:
        start = f"start: {calls}"
    return StructuredOutput(grammar="\n".join([start] + rules), param="tools")


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallParser:
    """Incremental: feed() the reply's text as it arrives; get content deltas and tool-call
    deltas in OpenAI's streaming shape. calls_expected: the reply can only be tool calls
    (required / named); otherwise the first character decides (auto: text never starts with "<")."""

    calls_expected: bool
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _mode: str = "start"  # start | text | head | args | close
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> list[dict]:
        """Deltas for the chat.completion.chunk stream: {"content": ...} or {"tool_calls": [...]}."""
        self._buffer += text
        deltas: list[dict] = []
        while self._buffer:
            before = (self._mode, len(self._buffer))
            self._step(deltas)
            if (self._mode, len(self._buffer)) == before:
                break  # waiting for more text
        return deltas

    def _step(self, deltas: list[dict]) -> None:
        if self._mode == "start":
            head = self._buffer.lstrip()
            if not head:
                return
            self._mode = "head" if self.calls_expected or head.startswith("<") else "text"
        elif self._mode == "text":
            self.content += self._buffer
            deltas.append({"content": self._buffer})
            self._buffer = ""
        elif self._mode == "head":
            match = _CALL_HEAD.match(self._buffer)
            if match is None:
                if len(self._buffer) > 200:  # not the format: give it back as text
                    self._mode = "text"
                return
            call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", match.group(1))
            self.calls.append(call)
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": len(self.calls) - 1,
                            "id": call.id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": ""},
                        }
                    ]
                }
            )
            self._buffer = self._buffer[match.end() :]
            self._mode, self._depth, self._in_string, self._escaped = "args", 0, False, False
        elif self._mode == "args":
            end = self._scan_arguments()
            fragment, self._buffer = self._buffer[:end], self._buffer[end:]
            if fragment:
                self.calls[-1].arguments += fragment
                deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": fragment}}]})
            if self._depth == 0 and self.calls[-1].arguments:
                self._mode = "close"
        elif self._mode == "close":
            if len(self._buffer) < len(CALL_CLOSE):
                return
            self._buffer = self._buffer[len(CALL_CLOSE) :]
            self._mode = "head"

    def _scan_arguments(self) -> int:
        """How much of the buffer belongs to the arguments (a JSON value): all of it, or up to
        the end of the value."""
        for i, ch in enumerate(self._buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return len(self._buffer)

    def finish(self) -> list[dict]:
        """Deltas for text held back at the end (an unfinished call head becomes content)."""
        if self._mode in ("start", "head") and self._buffer.strip() and not self.calls:
            self._mode = "text"
            return self.feed("")
        return []


def parser_for(tool_mode) -> ToolCallParser | None:
    """A parser for a chat request's reply, or None when no tools are in play."""
    return None if tool_mode is None else ToolCallParser(calls_expected=tool_mode != "auto")


def assistant_message(text: str, tool_mode) -> dict:
    """The non-streamed message: content, or tool_calls parsed from the reply."""
    parser = parser_for(tool_mode)
    if parser is None:
        return {"role": "assistant", "content": text, "refusal": None}
    parser.feed(text)
    parser.finish()
    if not parser.calls:
        return {"role": "assistant", "content": parser.content, "refusal": None}
    return {
        "role": "assistant",
        "content": parser.content or None,
        "refusal": None,
        "tool_calls": [c.as_dict() for c in parser.calls],
    }


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """OpenAI ends a reply that called tools with "tool_calls"."""
    return "tool_calls" if made_calls and reason == "stop" else reason
