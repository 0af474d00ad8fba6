"""AutoProposer: per sequence and per round, the draft head's chain or an n-gram match.

The head is picked where it is expected to emit more tokens per second of the round's cost than
both the n-gram match and plain decoding: a round drafting m tokens accepted independently with
probability a emits (1 - a^(m+1)) / (1 - a) tokens; it costs the target's verification of 1 + m
tokens, plus m head steps for the head (n-gram lookup is free). Each method is judged at its best
length m (at most the round's k, and for n-gram the match's length): where verifying costs much
more than decoding (the int4 kernel on a CPU grows with the rows it multiplies), a weak head's long
chain loses to a short one, and to no draft at all. Each method's a is the sequence's own decayed
history for that method, starting from a prior: the head's held-out acceptance from its training
report, and for n-gram a prior that grows with the length of the matched suffix (a long match in
the prompt is usually a copy, and copying is where n-gram wins). Once the head is picked, its
chain's length is the head's own call, draft by draft (eagle.py's ChainJudge: a draft is verified
only while the head's confidence in it pays for its row).

Where the head is not picked, an n-gram match drafts exactly as under method "ngram": the k
policy (adaptive_k.py) has already weighed drafting against plain decoding from the sequence's
own acceptance, and charges auto's drafts no head step (the head's steps are priced here). So
auto drafts at least what "ngram" does, and differs only where the head is expected to do better.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specstream.adaptive_k import CostModel
from specstream.eagle import EagleProposer
from specstream.proposers import Draft, NgramProposer, Proposer
from specstream.sequence import Sequence

# Prior acceptance of an n-gram draft by the length of the matched suffix.
NGRAM_PRIOR = {1: 0.15, 2: 0.35, 3: 0.55}
NGRAM_PRIOR_LONG = 0.7
HEAD_PRIOR = 0.6
PRIOR_WEIGHT = 2.0
DECAY = 0.9


@dataclass
class _History:
    accepted: float = 0.0
    rejected: float = 0.0

    def estimate(self, prior: float) -> float:
        return (self.accepted + prior * PRIOR_WEIGHT) / (self.accepted + self.rejected + PRIOR_WEIGHT)

    def record(self, drafted: int, accepted: int) -> None:
        self.accepted = self.accepted * DECAY + accepted
        self.rejected = self.rejected * DECAY + (1.0 if accepted < drafted else 0.0)


@dataclass
class _SeqChoice:
    head: _History
    ngram: _History
    last_method: str = ""
    last_drafted: int = 0  # seq.stats totals when the last draft was handed out
    last_accepted: int = 0


def expected_tokens(a: float, m: int) -> float:
    """Tokens a round emits when m drafts are each accepted with probability a (bonus included)."""
    return float(m + 1) if a >= 1.0 else (1.0 - a ** (m + 1)) / (1.0 - a)


class AutoProposer(Proposer):
    def __init__(self, head: EagleProposer | None, ngram: NgramProposer, head_prior: float = HEAD_PRIOR) -> None:
        self.head = head
        self.ngram = ngram
        self.head_prior = head_prior
        self.aux_layers = head.aux_layers if head is not None else ()
        self.target_cost: CostModel | None = None  # set by the engine after calibration
        self._seqs: dict[str, _SeqChoice] = {}

    def pass_cost(self, num_seqs: int) -> float:
        """A draft's proposal cost as the k policy (adaptive_k.KPolicy) sees it before auto picks a
        method: nothing. An n-gram lookup is free, and the head's steps are priced here, per sequence
        and round, where the head is weighed against the n-gram match and plain decoding (_rate).
        Charging every draft a head step there made the policy grant n-gram matches shorter drafts,
        or none, than plain `ngram` gets: 0.88x its speed on open chat."""
        return 0.0

    def _head_step_cost(self) -> float:
        return self.head.pass_cost(1) if self.head is not None else 0.0

    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        if self.head is not None:
            self.head.observe(seq, start, features)

    def release(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        if self.head is not None:
            self.head.release(seq)

    def on_commit(self, seq: Sequence) -> None:
        choice = self._seqs.get(seq.request_id)
        if choice is None or not choice.last_method:
            return
        drafted = seq.stats.drafted - choice.last_drafted
        accepted = seq.stats.accepted - choice.last_accepted
        getattr(choice, choice.last_method).record(drafted, accepted)
        choice.last_method = ""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        head_ks = [0] * len(seqs)
        fallback: dict[int, Draft] = {}  # the n-gram draft of a sequence the head's chain may decline
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k <= 0:
                continue
            choice = self._seqs.setdefault(seq.request_id, _SeqChoice(_History(), _History()))
            tokens, n = self.ngram.match(seq.token_ids, k)
            plain = self._rate(0.0, 0, head=False)
            ngram_rate, ngram_m = (
                self._best(choice.ngram.estimate(NGRAM_PRIOR.get(n, NGRAM_PRIOR_LONG)), len(tokens), head=False)
                if tokens
                else (0.0, 0)
            )
            head_rate, head_m = (
                self._best(choice.head.estimate(self.head_prior), k, head=True) if self.head is not None else (0.0, 0)
            )
            if head_m and head_rate > plain and head_rate > ngram_rate:
                # With the target's cost curve the head's chain stops by its own confidence (ChainJudge),
                # up to k; without it, at the length best for the sequence's acceptance so far.
                head_ks[i] = k if self.head.target_cost is not None else head_m
                choice.last_method = "head"
                if tokens:
                    fallback[i] = Draft(tokens, None, "ngram")
            elif tokens:
                # Not the head: the match drafts as under method "ngram", all of it up to the k that the
                # policy granted from the sequence's own acceptance (which weighs drafting against plain
                # decoding). Judged again here by a prior per match length, short matches were declined
                # that pay (47% of n-gram drafts accepted on open chat), and auto ran at 0.88x ngram.
                drafts[i] = Draft(tokens, None, "ngram")
                choice.last_method = "ngram"
            choice.last_drafted, choice.last_accepted = seq.stats.drafted, seq.stats.accepted
        if any(head_ks):
            idx = [i for i, k in enumerate(head_ks) if k]
            for i, d in zip(idx, self.head.propose([seqs[i] for i in idx], [head_ks[i] for i in idx])):
                if d.tokens:
                    drafts[i] = d
                    continue
                # The head found none of its drafts worth a row: for auto's choice that is a head round that
                # yielded nothing (so a head that keeps declining stops being picked), and the n-gram
                # match, where there is one worth verifying, drafts instead.
                choice = self._seqs[seqs[i].request_id]
                choice.head.record(1, 0)
                choice.last_method = ""
                if i in fallback:
                    drafts[i] = fallback[i]
                    choice.last_method = "ngram"
        return drafts

    def _rate(self, a: float, drafts: int, head: bool) -> float:
        """Expected tokens per second of one sequence's round drafting `drafts` tokens."""
        verify = self.target_cost(1 + drafts) if self.target_cost is not None else 1.0
        return expected_tokens(a, drafts) / (verify + (drafts * self._head_step_cost() if head else 0.0))

    def _best(self, a: float, most: int, head: bool) -> tuple[float, int]:
        """The best expected rate over draft lengths 1..most, and that length."""
        return max((self._rate(a, m, head), m) for m in range(1, most + 1))
