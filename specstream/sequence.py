"""A request inside the engine: its tokens, its place in the KV pool, its speculation stats."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specstream.detok import IncrementalDetokenizer
from specstream.memory.kv import BlockTable
from specstream.memory.prefix_cache import PrefixState
from specstream.sampling import SamplingParams, reduce_seed


@dataclass
class Acceptance:
    """Decayed counts of accepted drafts and of rounds that ended in a rejection."""

    accepted: float = 0.0
    rejected: float = 0.0

    def estimate(self, prior: float, weight: float) -> float:
        return (self.accepted + prior * weight) / (self.accepted + self.rejected + weight)

    def record(self, drafted: int, accepted: int, decay: float) -> None:
        """A round is a geometric observation: `accepted` successes, then one failure unless all
        drafts were accepted."""
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1.0 if accepted < drafted else 0.0)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculation counters of one request (vLLM's vocabulary)."""

    rounds: int = 0  # verification rounds (engine steps that produced tokens)
    drafted: int = 0  # draft tokens proposed and verified
    accepted: int = 0  # draft tokens the target accepted
    forced: int = 0  # [structured] drafted tokens that the grammar forced (counted in drafted too)
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: rounds whose draft i was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: rounds that drafted position i
    prediction_drafted: int = 0  # drafts taken from the request's prediction (spec_decode/prediction.py)
    prediction_accepted: int = 0  # of those, the ones accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prediction_usage(self) -> tuple[int, int]:
        """(accepted, rejected) prediction tokens, as OpenAI's usage counts them."""
        return self.prediction_accepted, self.prediction_drafted - self.prediction_accepted

    def record(self, num_drafted: int, num_accepted: int, num_forced: int = 0, method: str = "") -> None:
        self.rounds += 1
        if method == "prediction":  # forced tokens lead a draft ([structured]): the prediction's follow them
            self.prediction_drafted += num_drafted - num_forced
            self.prediction_accepted += max(num_accepted - num_forced, 0)
        self.forced += num_forced
        self.drafted += num_drafted
        self.accepted += num_accepted
        grow = num_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


class Sequence:
    """Built whole by the engine's InputProcessor. seed is the request's own when it has one,
    else the one the engine drew for it; max_tokens is the completion's limit, resolved
    against the context (default: params.max_tokens)."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival: int,
        *,
        seed: int = 0,
        max_tokens: int | None = None,
        detokenizer: IncrementalDetokenizer | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.seed = reduce_seed(params.seed if params.seed is not None else seed)
        self.arrival = arrival  # admission order; the newest is preempted first
        self.status = SequenceStatus.WAITING
        self.block_table = BlockTable()  # its KV blocks, per layer group (memory/kv.py)
        self.num_cached = 0  # positions whose KV is in the target pool
        self.prefix = PrefixState()  # block digests and cache hits (memory/prefix_cache.py)
        self.finish_reason: str | None = None
        self.stats = SpecStats()
        self.max_tokens = max_tokens if max_tokens is not None else params.max_tokens
        self.detokenizer = detokenizer
        self.constraint = None  # [structured] structured.Constraint (grammar, logit bias), set by the processor
        self.held_ends: list[int] = []  # tokens that may not be drawn before params.min_tokens (EOS, stop tokens)
        self.prediction = None  # spec_decode.prediction.Prediction: params.prediction's tokens, set by the processor
        self.acceptance = Acceptance()  # its drafts' history, for the k policy (spec_decode/policy.py)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def draft_room(self) -> int | None:
        """The most drafts a round may carry that could all be kept: a round emits its accepted drafts and one
        token more, within max_tokens (None: no limit)."""
        if self.max_tokens is None:
            return None
        return max(self.max_tokens - self.num_output_tokens - 1, 0)

    @property
    def cache_salt(self) -> str | None:
        return self.params.cache_salt

    @property
    def num_pending(self) -> int:
        """Tokens not yet fed to the target (1 in steady decoding, more while prefilling)."""
        return len(self.token_ids) - self.num_cached

    @property
    def is_decoding(self) -> bool:
        return self.num_pending == 1 and self.num_output_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
