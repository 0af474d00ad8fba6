"""Sampling parameters and logits processing.

Randomness is counter-based: the uniform that decides output position j of a request is a
hash of (seed, j, stream). A request's samples therefore do not depend on how many drafts
each round carried or which requests shared its batch, so a seeded request is reproducible
with speculation on or off.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from specstream.errors import InvalidRequestError
from specstream.kernels import cpu as cpu_kernels

_MASK64 = (1 << 64) - 1
# Independent uniform streams per output position.
STREAM_SAMPLE, STREAM_ACCEPT, STREAM_DRAFT = 0, 1, 2
# A sampled draft tree's further uniforms at an output position: its i-th sibling's acceptance test
# (STREAM_TREE_ACCEPT + i), and the i-th child drawn from node n's q (STREAM_TREE_DRAW + (n + 1) * 64 + i).
STREAM_TREE_ACCEPT = 1 << 20
STREAM_TREE_DRAW = 1 << 21
GREEDY_EPS = 1e-5
# Caps on what one request may ask for: each bounds work done per request per round.
MAX_LOGPROBS = 20
MAX_SPECULATIVE_TOKENS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256  # a stop string's length is held back from the stream
MAX_STOP_TOKEN_IDS = 256
MAX_CACHE_SALT_CHARS = 256  # the salt is hashed into every prefix-cache digest chain's root
MAX_LOGIT_BIAS = 300
_STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match: exactly one of the five kinds.

    json_schema: a JSON Schema (dict); json_object: any JSON object; regex: a regular
    expression (Rust regex syntax) for the whole output; grammar: a Lark grammar in
    llguidance's dialect (it may embed ``%json {...}`` schemas); choice: one of these strings.
    param names the request field this came from, for error messages.
    """

    json_schema: dict | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    param: str = "structured"

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(f"give exactly one of {', '.join(_STRUCTURED_KINDS)} (got {given or 'none'})", param=self.param)
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json_schema" and not isinstance(value, dict):
            raise InvalidRequestError("a JSON schema must be an object", param=self.param)
        if kind == "json_object" and value is not True:
            raise InvalidRequestError("json_object must be true", param=self.param)
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise InvalidRequestError(f"{kind} must be a non-empty string", param=self.param)
        if kind == "choice" and (not value or not all(isinstance(c, str) and c for c in value)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings", param=self.param)

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """Identifies the compiled grammar (the cache key)."""
        value = getattr(self, self.kind)
        return self.kind, json.dumps(value, sort_keys=True) if not isinstance(value, str) else value


def check_logit_bias(bias: dict | None) -> dict[int, float] | None:
    """OpenAI's bounds: at most 300 entries, token ids >= 0, values in [-100, 100]."""
    if not bias:
        return None
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to values", param="logit_bias")
    out = {}
    for tok, value in bias.items():
        try:
            tok_id = int(tok)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {tok!r}", param="logit_bias") from None
        if isinstance(tok, bool) or tok_id < 0 or str(tok_id) != str(tok).strip():
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {tok!r}", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise InvalidRequestError(f"logit_bias values must be numbers in [-100, 100], got {value!r}", param="logit_bias")
        out[tok_id] = float(value)
    return out


@dataclass
class SamplingParams:
    """How one request samples. Every field is checked on creation (InvalidRequestError
    naming the field); the limits that depend on the model (top_k and stop_token_ids within
    its vocabulary, max_tokens within its context) are checked by the engine's input
    processor before admission."""

    max_tokens: int | None = 16  # None: up to the model's context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables it
    seed: int | None = None  # any integer; requests without one get a seed from the engine
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: no logprobs; n >= 0: the chosen token's plus the n most likely
    num_speculative_tokens: int | None = None  # this request's k_max: None = engine's, 0 = no speculation
    cache_salt: str | None = None  # prefix-cache blocks are shared only between requests with the same salt
    structured: StructuredOutput | None = None  # [structured] the grammar the output must match
    logit_bias: dict[int, float] | None = None  # [structured] added to the logits of these token ids
    # vLLM's extras, last so that positional arguments keep their meaning
    min_p: float = 0.0  # keep the tokens at least this share of the likeliest one's probability; 0 disables it
    repetition_penalty: float = 1.0  # vLLM's: a prompt or output token's logit / it (positive) or * it (negative)
    min_tokens: int = 0  # vLLM's: no EOS, stop token or stop string ends the output before this many tokens
    # OpenAI's predicted outputs: text (or token ids) the answer is expected to contain, drafted where the output
    # follows it (spec_decode/prediction.py); it changes the speed, never the output
    prediction: str | list[int] | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            _integer(self.max_tokens, "max_tokens", low=1)
        self.temperature = _real(self.temperature, "temperature", low=0.0)
        self.top_p = _real(self.top_p, "top_p", low=0.0, high=1.0)
        if self.top_p == 0.0:
            raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
        _integer(self.top_k, "top_k", low=0)
        self.min_p = _real(self.min_p, "min_p", low=0.0, high=1.0)
        if self.seed is not None:
            _integer(self.seed, "seed")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _stop_token_ids(self.stop_token_ids)
        self.presence_penalty = _real(self.presence_penalty, "presence_penalty", low=-2.0, high=2.0)
        self.frequency_penalty = _real(self.frequency_penalty, "frequency_penalty", low=-2.0, high=2.0)
        self.repetition_penalty = _real(self.repetition_penalty, "repetition_penalty", low=0.0, high=2.0)
        if self.repetition_penalty == 0.0:
            raise InvalidRequestError("repetition_penalty must be in (0, 2]", param="repetition_penalty")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be true or false", param=name)
        if self.logprobs is not None:
            _integer(self.logprobs, "logprobs", low=0, high=MAX_LOGPROBS)
        if self.num_speculative_tokens is not None:
            _integer(self.num_speculative_tokens, "num_speculative_tokens", low=0, high=MAX_SPECULATIVE_TOKENS)
        if self.cache_salt is not None:
            _cache_salt(self.cache_salt)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):  # [structured]
            raise InvalidRequestError("structured must be a StructuredOutput", param="structured")
        self.logit_bias = check_logit_bias(self.logit_bias)  # [structured]
        _integer(self.min_tokens, "min_tokens", low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens must be at most max_tokens", param="min_tokens")
        _prediction(self.prediction)
        if self.min_tokens and self.structured is not None:
            # a grammar may be complete (and allow only its end) before min_tokens
            raise InvalidRequestError("min_tokens cannot be combined with a structured output", param="min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _prediction(value) -> None:
    """A prediction's type (its size is bounded against the model's context by the input processor)."""
    if value is None or isinstance(value, str):
        return
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequestError("prediction must be a string or a list of token ids", param="prediction")


def _integer(value, name: str, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer", param=name)
    if low is not None and value < low:
        raise InvalidRequestError(f"{name} must be >= {low}", param=name)
    if high is not None and value > high:
        raise InvalidRequestError(f"{name} must be <= {high}", param=name)
    return value


def _real(value, name: str, low: float, high: float | None = None) -> float:
    """A finite number within [low, high], as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{name} must be a number", param=name)
    try:
        value = float(value)
    except OverflowError:  # an integer beyond float range
        value = math.inf
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        bounds = f"in [{low:g}, {high:g}]" if high is not None else f"a finite number >= {low:g}"
        raise InvalidRequestError(f"{name} must be {bounds}", param=name)
    return value


def _stop_strings(stop) -> list[str]:
    stop = [stop] if isinstance(stop, str) else stop
    if stop is None:
        return []
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings are allowed", param="stop")
    if any(not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in stop):
        raise InvalidRequestError(f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters", param="stop")
    return list(stop)


def _stop_token_ids(ids) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError("stop_token_ids must be a list of integers", param="stop_token_ids")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed", param="stop_token_ids")
    if any(t < 0 for t in ids):
        raise InvalidRequestError("stop_token_ids must be >= 0", param="stop_token_ids")
    return list(ids)


def _cache_salt(salt) -> None:
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        message = f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters"
        raise InvalidRequestError(message, param="cache_salt")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def reduce_seed(seed: int) -> int:
    """Any integer seed (negative or beyond 64 bits) as the 64 bits that uniform() reads."""
    return seed & _MASK64


def uniform(seed: int, position: int, stream: int) -> float:
    """A uniform in [0, 1) fixed by (seed, output position, stream)."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ position) ^ stream)
    return (h >> 11) * (1.0 / (1 << 53))


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI-style penalties over the counts of tokens generated so far: [R, V] each."""
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """vLLM's (and CTRL's) repetition penalty: the logit of each token in seen ([R, V] bool: in the prompt or the
    output so far) divided by penalty where positive, multiplied by it where not, so penalty > 1 makes a repeat
    less likely either way."""
    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def probabilities(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row temperature, min-p, top-k and top-p, then softmax. logits [R, V] float32; params [R]. min-p (vLLM's
    order: after temperature, before top-k and top-p) drops the tokens whose probability is below min_p times the
    likeliest token's, which is a ratio of probabilities and so a difference of logits: log(min_p) below the top."""
    logits = logits / temperature[:, None]
    if min_p is not None and bool((min_p > 0).any()):
        floor = logits.max(-1, keepdim=True).values + torch.log(min_p)[:, None]  # min_p 0: -inf, nothing dropped
        logits = logits.masked_fill(logits < floor, float("-inf"))
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
    """probabilities() with each row's temperature/min-p/top-k/top-p taken from its SamplingParams: the distribution a
    sampled draft is drawn from (its q) and the rows verifying it (p). float32 rows on CPU take specstream's kernel
    where it is loaded (kernels/csrc/sample_rows.cpp's probability_rows: the distribution sampling.draw's kernel
    draws from, cut by a selection of the best tokens instead of a sort of the vocabulary, which for a row with
    top-k or top-p cost more than the step's forward); others torch_probabilities_for. The two round differently
    (min-p's cut alike: the same float32 comparison), and order tied logits differently for top-k."""
    if not _kernel_serves(logits):
        return torch_probabilities_for(logits, row_params)
    return torch.ops.specstream.probability_rows(_unit_rows(logits), *_kernel_columns(row_params))


def torch_probabilities_for(logits: torch.Tensor, row_params: list[SamplingParams]) -> torch.Tensor:
    """probabilities_for in torch's ops (probabilities())."""

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in row_params], device=logits.device)

    if not any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in row_params):
        # probabilities() without a filter, the same ops: its checks of the filters read two tensors back
        return (logits / column("temperature")[:, None]).softmax(-1)
    min_p = column("min_p") if any(p.min_p > 0 for p in row_params) else None
    return probabilities(logits, column("temperature"), column("top_k"), column("top_p"), min_p)


def _kernel_serves(logits: torch.Tensor) -> bool:
    """Whether the sampling kernels take these logits: float32 rows on CPU, the kernels loaded."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[0] > 0 and cpu_kernels.loaded()


def _unit_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits as the kernels read them: rows with a unit last stride, any step between rows (a view of another
    layout is copied)."""
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def _kernel_columns(row_params: list[SamplingParams]) -> tuple[torch.Tensor, ...]:
    """The rows' temperature (float32), top_k (int64), top_p and min_p (float32), as the sampling kernels take them."""
    temperature = torch.tensor([p.temperature for p in row_params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in row_params], dtype=torch.long)
    top_p = torch.tensor([p.top_p for p in row_params], dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in row_params], dtype=torch.float32)
    return temperature, top_k, top_p, min_p


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling, one uniform per row: [R, V] probabilities (unnormalized ok), [R]."""
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)  # each value widened as it is added: no float64 copy
    target = uniforms.double() * cdf[:, -1]
    # right=True skips zero-probability tokens when the target lands on a boundary.
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over logits [R, V] (the first of equal largest logits, as torch.argmax gives it): what
    greedy decoding and greedy verification take. float32 rows on CPU take specstream's kernel where it is loaded
    (kernels/csrc/sample_rows.cpp: two vector passes a row, where torch's reduction walks the row scalar by
    scalar); others torch.argmax."""
    if _kernel_serves(logits):
        return torch.ops.specstream.argmax_rows(_unit_rows(logits))
    return logits.argmax(-1)


def draw(logits: torch.Tensor, row_params: list[SamplingParams], uniforms: torch.Tensor) -> torch.Tensor:
    """A token per row of logits [R, V] from its distribution (probabilities_for) by its uniform [R]: what plain
    decoding and every one-hot verification draw, so that both draw the same token. float32 rows on CPU take
    specstream's kernel where it is loaded (kernels/csrc/sample_rows.cpp: a few passes over the logits, a selection
    of the best tokens for top-k and top-p instead of a sort of the vocabulary, and no [R, V] tensor made); others
    torch_probabilities_for and sample_from. The kernel and the torch ops round differently (and order tied logits
    differently for top-k), so where both serve they draw the same token except where the uniform, or the mass
    before a token against top_p, falls within rounding of a boundary."""
    if not _kernel_serves(logits):
        return sample_from(torch_probabilities_for(logits, row_params), uniforms)
    columns = _kernel_columns(row_params)
    return torch.ops.specstream.sample_rows(_unit_rows(logits), *columns, uniforms.to(torch.float64))
