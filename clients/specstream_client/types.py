"""Typed results, built from the server's JSON; unknown fields are kept in `extra`."""

from __future__ import annotations

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

    @classmethod
    def parse(cls, data: dict | None) -> Usage | None:
        if not data:
            return None
        details = data.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        known = {k: v for k, v in _known(cls, data)[0].items() if k != "cached_tokens"}
        return cls(**known, cached_tokens=cached or 0)


@dataclass
class SpeculativeStats:
    """Per-chunk speculation counts that a specstream server sends (None elsewhere)."""

    drafted: int = 0
    accepted: int = 0
    tokens: int = 0

    @classmethod
    def parse(cls, data: dict | None) -> SpeculativeStats | None:
        return cls(**_known(cls, data)[0]) if data else None


@dataclass
class Message:
    role: str
    content: str | None
    extra: dict = field(default_factory=dict)


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
                    message=Message(msg.get("role", "assistant"), msg.get("content"), _known(Message, msg)[1]),
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
class Delta:
    role: str | None = None
    content: str | None = None


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
                delta=Delta(**_known(Delta, c.get("delta") or {})[0]),
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
