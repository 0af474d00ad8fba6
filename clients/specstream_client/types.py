"""Typed results, built from the server's JSON; unknown fields are kept in `extra`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any


def _known(cls, data: dict) -> tuple[dict, dict]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}, {k: v for k, v in data.items() if k not in names}


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the server's prefix cache (usage.prompt_tokens_details)
    # a request's `prediction` (OpenAI's predicted outputs): its tokens accepted and rejected as drafts
    # (usage.completion_tokens_details)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @classmethod
    def parse(cls, data: dict | None) -> Usage | None:
        if not data:
            return None
        details = data.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        completion = data.get("completion_tokens_details")
        completion = completion if isinstance(completion, dict) else {}
        nested = ("cached_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens")
        known = {k: v for k, v in _known(cls, data)[0].items() if k not in nested}
        return cls(
            **known,
            cached_tokens=cached or 0,
            accepted_prediction_tokens=completion.get("accepted_prediction_tokens") or 0,
            rejected_prediction_tokens=completion.get("rejected_prediction_tokens") or 0,
        )


@dataclass
class SpeculativeStats:
    """Per-chunk speculation counts that a specstream server sends (None elsewhere)."""

    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    forced: int = 0  # of drafted, the tokens a grammar forced (structured outputs)
    methods: dict[str, int] = field(default_factory=dict)  # rounds by the proposer that drafted them

    @classmethod
    def parse(cls, data: dict | None) -> SpeculativeStats | None:
        return cls(**_known(cls, data)[0]) if data else None


@dataclass
class FunctionCall:
    name: str
    arguments: str  # JSON text, as the model wrote it

    def parsed_arguments(self) -> Any:
        return json.loads(self.arguments)


@dataclass
class ToolCall:
    id: str
    function: FunctionCall
    type: str = "function"

    @classmethod
    def parse(cls, data: dict) -> ToolCall:
        fn = data.get("function") or {}
        return cls(
            data.get("id", ""), FunctionCall(fn.get("name", ""), fn.get("arguments", "")), data.get("type", "function")
        )


@dataclass
class Message:
    role: str
    content: str | None
    extra: dict = field(default_factory=dict)
    tool_calls: list[ToolCall] | None = None

    def parsed(self) -> Any:
        """The content as JSON (for response_format json_object / json_schema replies)."""
        if self.content is None:
            raise ValueError("the message has no content")
        return json.loads(self.content)


@dataclass
class Choice:
    index: int
    message: Message
    finish_reason: str | None
    logprobs: Any = None


@dataclass
class ChatCompletion:
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None
    extra: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, data: dict) -> ChatCompletion:
        choices = []
        for c in data.get("choices", []):
            msg = c.get("message") or {}
            choices.append(
                Choice(
                    index=c.get("index", 0),
                    message=Message(
                        msg.get("role", "assistant"),
                        msg.get("content"),
                        _known(Message, msg)[1],
                        [ToolCall.parse(c) for c in msg["tool_calls"]] if msg.get("tool_calls") else None,
                    ),
                    finish_reason=c.get("finish_reason"),
                    logprobs=c.get("logprobs"),
                )
            )
        known, extra = _known(cls, data)
        return cls(
            data.get("id", ""),
            data.get("created", 0),
            data.get("model", ""),
            choices,
            Usage.parse(data.get("usage")),
            extra,
        )

    @property
    def text(self) -> str:
        return self.choices[0].message.content or "" if self.choices else ""


@dataclass
class ToolCallDelta:
    """A piece of a streamed tool call: the first for an index has id and name, the rest
    carry argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    @classmethod
    def parse(cls, data: dict) -> ToolCallDelta:
        fn = data.get("function") or {}
        return cls(data.get("index", 0), data.get("id"), fn.get("name"), fn.get("arguments") or "")


@dataclass
class Delta:
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @classmethod
    def parse(cls, data: dict) -> Delta:
        calls = data.get("tool_calls")
        return cls(data.get("role"), data.get("content"), [ToolCallDelta.parse(c) for c in calls] if calls else None)


class ToolCallAssembler:
    """Joins streamed tool-call deltas of one choice into whole ToolCalls:
    ``for chunk in stream: assembler.add(chunk.choices[0].delta)``, then ``assembler.calls``."""

    def __init__(self) -> None:
        self._calls: dict[int, ToolCall] = {}

    def add(self, delta: Delta) -> None:
        for piece in delta.tool_calls or []:
            call = self._calls.setdefault(piece.index, ToolCall("", FunctionCall("", "")))
            call.id = piece.id or call.id
            call.function.name = piece.name or call.function.name
            call.function.arguments += piece.arguments

    @property
    def calls(self) -> list[ToolCall]:
        return [self._calls[i] for i in sorted(self._calls)]


@dataclass
class ChunkChoice:
    index: int
    delta: Delta
    finish_reason: str | None
    logprobs: Any = None
    speculative: SpeculativeStats | None = None


@dataclass
class ChatCompletionChunk:
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None

    @classmethod
    def parse(cls, data: dict) -> ChatCompletionChunk:
        choices = [
            ChunkChoice(
                index=c.get("index", 0),
                delta=Delta.parse(c.get("delta") or {}),
                finish_reason=c.get("finish_reason"),
                logprobs=c.get("logprobs"),
                speculative=SpeculativeStats.parse(c.get("speculative")),
            )
            for c in data.get("choices", [])
        ]
        return cls(
            data.get("id", ""), data.get("created", 0), data.get("model", ""), choices, Usage.parse(data.get("usage"))
        )


@dataclass
class CompletionChoice:
    index: int
    text: str
    finish_reason: str | None
    logprobs: Any = None
    speculative: SpeculativeStats | None = None


@dataclass
class Completion:
    """A /v1/completions response, or one streamed chunk of it."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None

    @classmethod
    def parse(cls, data: dict) -> Completion:
        choices = [
            CompletionChoice(
                c.get("index", 0),
                c.get("text", ""),
                c.get("finish_reason"),
                c.get("logprobs"),
                SpeculativeStats.parse(c.get("speculative")),
            )
            for c in data.get("choices", [])
        ]
        return cls(
            data.get("id", ""), data.get("created", 0), data.get("model", ""), choices, Usage.parse(data.get("usage"))
        )


@dataclass
class Model:
    id: str
    created: int = 0
    owned_by: str = ""

    @classmethod
    def parse(cls, data: dict) -> Model:
        return cls(data.get("id", ""), data.get("created", 0), data.get("owned_by", ""))


# ------------------------------------------------------------------ the Responses API
@dataclass
class ResponseUsage:
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0  # input tokens served from the server's prefix cache (input_tokens_details)

    @classmethod
    def parse(cls, data: dict | None) -> ResponseUsage | None:
        if not data:
            return None
        details = data.get("input_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        known = {k: v for k, v in _known(cls, data)[0].items() if k != "cached_tokens"}
        return cls(**known, cached_tokens=cached or 0)


@dataclass
class OutputItem:
    """One item of a response's output: a "message" (its text) or a "function_call"."""

    type: str
    id: str = ""
    status: str | None = None
    text: str = ""  # a message's output text
    call_id: str = ""  # a function call's id, for the function_call_output that answers it
    name: str = ""
    arguments: str = ""  # a function call's arguments, JSON text as the model wrote it
    raw: dict = field(default_factory=dict)  # the item as sent (a later request's input may hold it)

    @classmethod
    def parse(cls, data: dict) -> OutputItem:
        parts = data.get("content") or []
        text = "".join(p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == "output_text")
        return cls(
            data.get("type", ""),
            data.get("id", ""),
            data.get("status"),
            text,
            data.get("call_id", ""),
            data.get("name", ""),
            data.get("arguments", ""),
            data,
        )

    def parsed_arguments(self) -> Any:
        return json.loads(self.arguments)


@dataclass
class Response:
    """A /v1/responses result; output_text joins its messages' text."""

    id: str
    status: str | None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None
    previous_response_id: str | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, data: dict) -> Response:
        return cls(
            data.get("id", ""),
            data.get("status"),
            data.get("model", ""),
            [OutputItem.parse(item) for item in data.get("output") or [] if isinstance(item, dict)],
            ResponseUsage.parse(data.get("usage")),
            data.get("previous_response_id"),
            _known(cls, data)[1],
        )

    @property
    def output_text(self) -> str:
        return "".join(item.text for item in self.output if item.type == "message")

    @property
    def function_calls(self) -> list[OutputItem]:
        return [item for item in self.output if item.type == "function_call"]

    def parsed(self) -> Any:
        """The output text as JSON (for text.format json_object / json_schema)."""
        return json.loads(self.output_text)


@dataclass
class ResponseEvent:
    """One typed event of a streamed response (response.output_text.delta, ...); data is the whole event."""

    type: str
    sequence_number: int
    delta: str | None = None  # output_text / function_call_arguments deltas
    response: Response | None = None  # response.created, .in_progress, .completed
    item: OutputItem | None = None  # response.output_item.added / .done
    speculative: SpeculativeStats | None = None
    data: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, data: dict) -> ResponseEvent:
        response, item = data.get("response"), data.get("item")
        return cls(
            data.get("type", ""),
            data.get("sequence_number", 0),
            data.get("delta"),
            Response.parse(response) if isinstance(response, dict) else None,
            OutputItem.parse(item) if isinstance(item, dict) else None,
            SpeculativeStats.parse(data.get("speculative")),
            data,
        )
