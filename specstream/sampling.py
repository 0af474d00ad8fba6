"""Sampling parameters and logits processing.

Randomness is counter-based: the uniform that decides output position j of a request is a
hash of (seed, j, stream). A request's samples therefore do not depend on how many drafts
each round carried or which requests shared its batch, so a seeded request is reproducible
with speculation on or off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specstream.errors import InvalidRequestError
from specstream.structured import StructuredOutput, check_logit_bias

_MASK64 = (1 << 64) - 1
# Independent uniform streams per output position.
STREAM_SAMPLE, STREAM_ACCEPT, STREAM_DRAFT = 0, 1, 2
GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the model's context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: no logprobs; n >= 0: the chosen token's plus the n most likely
    num_speculative_tokens: int | None = None  # this request's k_max: None = engine's, 0 = no speculation
    structured: StructuredOutput | None = None  # [structured] the grammar the output must match
    logit_bias: dict[int, float] | None = None  # [structured] added to the logits of these token ids

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidRequestError(f"{name} must be a finite number")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidRequestError("max_tokens must be a positive integer", param="max_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError("logprobs must be between 0 and 20", param="logprobs")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise InvalidRequestError("num_speculative_tokens must be >= 0", param="num_speculative_tokens")
        if self.temperature < 0:
            raise InvalidRequestError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise InvalidRequestError("top_k must be >= 0 (0 disables it)")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise InvalidRequestError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):  # [structured]
            raise InvalidRequestError("structured must be a StructuredOutput", param="structured")
        self.logit_bias = check_logit_bias(self.logit_bias)  # [structured]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int, stream: int) -> float:
    """A uniform in [0, 1) fixed by (seed, output position, stream)."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ position) ^ stream)
    return (h >> 11) * (1.0 / (1 << 53))


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI-style penalties over the counts of tokens generated so far: [R, V] each."""
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def probabilities(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per-row temperature, top-k and top-p, then softmax. logits [R, V] float32; params [R]."""
    logits = logits / temperature[:, None]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, vocab)
        drop = ranks >= k[:, None]
        sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop |= (before >= top_p[:, None]) & (top_p[:, None] < 1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits.softmax(-1)


def probabilities_for(logits: torch.Tensor, row_params: list[SamplingParams]) -> torch.Tensor:
    """probabilities() with each row's temperature/top-k/top-p taken from its SamplingParams."""

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in row_params], device=logits.device)

    return probabilities(logits, column("temperature"), column("top_k"), column("top_p"))


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling, one uniform per row: [R, V] probabilities (unnormalized ok), [R]."""
    cdf = probs.double().cumsum(-1)
    target = uniforms.double() * cdf[:, -1]
    # right=True skips zero-probability tokens when the target lands on a boundary.
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)
