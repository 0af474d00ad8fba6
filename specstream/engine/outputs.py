"""What the engine hands back: one chunk per sequence per round, and finished requests."""

from __future__ import annotations

from dataclasses import dataclass

from specstream.sequence import SpecStats


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # OpenAI's predicted outputs (SamplingParams.prediction): its tokens drafted and accepted, drafted and rejected
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenLogprob:
    """log p of an emitted token under the target model's raw distribution (before
    penalties, temperature, top-k and top-p), with the most likely alternatives there."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class StreamChunk:
    """The tokens one sequence gained in one round (several when drafts were accepted), with
    that round's drafted/accepted counts. The last chunk of a request carries finish_reason
    ("stop", "length", "abort" or "error"), usage and, when a stop string ended it, that string;
    error is set when this request failed."""

    request_id: str
    text: str
    token_ids: list[int]
    num_drafted: int
    num_accepted: int
    finish_reason: str | None = None
    usage: Usage | None = None
    error: str | None = None
    prompt_token_ids: list[int] | None = None  # on a request's first chunk only
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked
    num_forced: int = 0  # [structured] of num_drafted, the tokens a grammar forced
    stop_string: str | None = None  # on the last chunk: the stop string that ended the request, if one did
    method: str = ""  # what drafted this round ("suffix", "ngram", "head", "prediction", ...; "" when none did)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: SpecStats
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def usage(self) -> Usage:
        return Usage(len(self.prompt_token_ids), len(self.token_ids), self.num_cached_tokens)
