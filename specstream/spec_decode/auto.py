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
chain's length is the head's own call, draft by draft (policy.ChainJudge: a draft is verified
only while the head's confidence in it pays for its row).

Where the head is not picked, an n-gram match drafts exactly as under method "ngram": the k
policy (policy.KPolicy) has already weighed drafting against plain decoding from the sequence's
own acceptance, and charges auto's drafts no head step (the head's steps are priced here). So
auto drafts at least what "ngram" does, and differs only where the head is expected to do better.

Suffix decoding (suffix.py) drafts with an estimated chance for each token (how often the matched text
went on that way before: the chance that the token is reached and accepted). Its round is priced from
those chances, scaled by how well they have predicted this sequence's acceptance so far (a decayed
ratio of accepted drafts to the chances' sum, starting at 1): verifying its first m drafts is expected
to emit 1 + f * (c_1 + ... + c_m) tokens (for a tree too: a node is accepted exactly when the path to
it is, so the expected accepted length is the sum of its nodes' chances), and it is cut at the m with
the best rate: a tree's first m nodes, grown best first, are its likeliest. It is picked where that rate beats the others' (and plain
decoding's); where the suffix tree cannot be built here, auto goes on without it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specstream.calibration import CostModel
from specstream.sequence import Acceptance
from specstream.spec_decode.policy import best_cut, best_length, round_rate
from specstream.spec_decode.draft_head import HeadError
from specstream.spec_decode.eagle import EagleProposer, resolve_head_dir
from specstream.spec_decode.ngram import NgramProposer
from specstream.spec_decode.proposer import Draft, DraftMask, Proposer, ProposerContext
from specstream.spec_decode.suffix import SuffixProposer, SuffixUnavailable
from specstream.sequence import Sequence

logger = logging.getLogger(__name__)

# Prior acceptance of an n-gram draft by the length of the matched suffix.
NGRAM_PRIOR = {1: 0.15, 2: 0.35, 3: 0.55}
NGRAM_PRIOR_LONG = 0.7
HEAD_PRIOR = 0.6
# A method's acceptance: the prior's weight in drafts, and how fast its history fades.
PRIOR_WEIGHT = 2.0
DECAY = 0.9


@dataclass
class Calibration:
    """How well a proposer's own chances predict acceptance: decayed sums of accepted drafts and of
    the chances of the drafts verified, their ratio pulled toward 1 while they are few."""

    accepted: float = 0.0
    expected: float = 0.0

    def factor(self, weight: float = PRIOR_WEIGHT) -> float:
        return (self.accepted + weight) / (self.expected + weight)

    def record(self, expected: float, accepted: int, decay: float = DECAY) -> None:
        self.accepted = self.accepted * decay + accepted
        self.expected = self.expected * decay + expected


@dataclass
class _SeqChoice:
    head: Acceptance
    ngram: Acceptance
    suffix: Calibration = field(default_factory=Calibration)
    last_method: str = ""
    last_expected: float = 0.0  # the suffix draft's sum of chances
    last_drafted: int = 0  # seq.stats totals when the last draft was handed out
    last_accepted: int = 0


class AutoProposer(Proposer):
    def __init__(
        self,
        head: EagleProposer | None,
        ngram: NgramProposer,
        head_prior: float = HEAD_PRIOR,
        suffix: SuffixProposer | None = None,
    ) -> None:
        self.head = head
        self.ngram = ngram
        self.suffix = suffix
        self.head_prior = head_prior
        self.aux_layers = head.aux_layers if head is not None else ()
        self.target_cost: CostModel | None = None  # set by calibrate()
        self.lookup = ngram.lookup
        self._seqs: dict[str, _SeqChoice] = {}

    @classmethod
    def build(cls, ctx: ProposerContext) -> AutoProposer:
        """The head bundled for the model (or config.speculative.draft_model) beside n-gram lookup; n-gram
        alone where the model has no head."""
        ngram = NgramProposer.build(ctx)
        try:
            suffix = SuffixProposer.build(ctx)
        except SuffixUnavailable as exc:
            logger.warning("speculation auto: without suffix decoding (%s)", exc)
            suffix = None
        try:
            resolve_head_dir(ctx.config.speculative.draft_model, ctx.config.model)
        except HeadError as exc:
            logger.info("speculation auto: no draft head (%s)", exc)
            return cls(None, ngram, suffix=suffix)
        head = EagleProposer.build(ctx)
        # The head's held-out first-position acceptance is the best prior for its drafts.
        report = head.head.cfg.target.get("report") or {}
        accept = (report.get("acceptance_per_position") or [None])[0]
        return cls(head, ngram, head_prior=accept or HEAD_PRIOR, suffix=suffix)

    def calibrate(self, target_cost: CostModel, max_pass_tokens: int) -> None:
        if self.head is not None:
            self.head.calibrate(target_cost, max_pass_tokens)
        self.target_cost = target_cost

    def constrain(self, mask: DraftMask) -> None:
        if self.head is not None:
            self.head.constrain(mask)

    def pass_cost(self, num_seqs: int) -> float:
        """A draft's proposal cost as the k policy (policy.KPolicy) sees it before auto picks a
        method: nothing. An n-gram lookup is free, and the head's steps are priced here, per sequence
        and round, where the head is weighed against the n-gram match and plain decoding (_rate).
        Charging every draft a head step there would grant n-gram matches shorter drafts, or none,
        than plain `ngram` gets."""
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
        if self.suffix is not None:
            self.suffix.release(seq)

    def on_commit(self, seq: Sequence) -> None:
        choice = self._seqs.get(seq.request_id)
        if choice is None or not choice.last_method:
            return
        drafted = seq.stats.drafted - choice.last_drafted
        accepted = seq.stats.accepted - choice.last_accepted
        if choice.last_method == "suffix":
            choice.suffix.record(choice.last_expected, accepted)
        else:
            getattr(choice, choice.last_method).record(drafted, accepted, DECAY)
        choice.last_method = ""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        head_ks = [0] * len(seqs)
        fallback: dict[int, Draft] = {}  # the n-gram draft of a sequence the head's chain may decline
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k <= 0:
                continue
            choice = self._seqs.setdefault(seq.request_id, _SeqChoice(Acceptance(), Acceptance()))
            tokens, n = self.ngram.match(seq.token_ids, k)
            plain = self._rate(0.0, 0, head=False)
            ngram_rate, ngram_m = (
                self._best(choice.ngram.estimate(NGRAM_PRIOR.get(n, NGRAM_PRIOR_LONG), PRIOR_WEIGHT), len(tokens), head=False)
                if tokens
                else (0.0, 0)
            )
            head_rate, head_m = (
                self._best(choice.head.estimate(self.head_prior, PRIOR_WEIGHT), k, head=True) if self.head is not None else (0.0, 0)
            )
            suffix_draft = self.suffix.draft(seq, k) if self.suffix is not None else Draft([])
            suffix_rate, suffix_m = (
                best_cut(suffix_draft.chances, choice.suffix.factor(), self.target_cost) if suffix_draft.tokens else (0.0, 0)
            )
            if suffix_m and suffix_rate > max(plain, ngram_rate, head_rate):
                drafts[i] = suffix_draft.cut(suffix_m)  # a tree's first m nodes: the likeliest m, grown best first
                choice.last_method, choice.last_expected = "suffix", sum(drafts[i].chances)
            elif head_m and head_rate > plain and head_rate > ngram_rate:
                # With the target's cost curve the head's chain stops by its own confidence (ChainJudge),
                # up to k; without it, at the length best for the sequence's acceptance so far.
                head_ks[i] = k if self.head.target_cost is not None else head_m
                choice.last_method = "head"
                if tokens:
                    fallback[i] = Draft(tokens, None, "ngram")
            elif tokens:
                # Not the head: the match drafts as under method "ngram", all of it up to the k that the
                # policy granted from the sequence's own acceptance (which weighs drafting against plain
                # decoding). Judged again here by a prior per match length, short matches that pay would
                # be declined.
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
                choice.head.record(1, 0, DECAY)
                choice.last_method = ""
                if i in fallback:
                    drafts[i] = fallback[i]
                    choice.last_method = "ngram"
        return drafts

    def _rate(self, a: float, drafts: int, head: bool) -> float:
        """Expected tokens per second of one sequence's round drafting `drafts` tokens."""
        return round_rate(a, drafts, self.target_cost, self._head_step_cost() if head else 0.0)

    def _best(self, a: float, most: int, head: bool) -> tuple[float, int]:
        """The best expected rate over draft lengths 1..most, and that length."""
        return best_length(a, most, self.target_cost, self._head_step_cost() if head else 0.0)
