"""What the engine hands back: per-step deltas and finished requests."""

from __future__ import annotations

from dataclasses import dataclass

from specstream.sequence import SpecStats


@dataclass
class StepOutput:
    """One sequence's tokens accepted in one engine step (one round), as one chunk."""

    request_id: str
    token_ids: list[int]
    text: str
    num_drafted: int
    num_accepted: int
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: SpecStats
