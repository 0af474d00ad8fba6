"""AutoProposer: per sequence and per round, a suffix draft, the draft head's chain or an n-gram match.

Every choice is priced at the margin of the step the drafts join (policy.StepPrice, from the StepBase the
engine hands over before each propose): the step's expected tokens per second once the draft joins it, a
draft costing the rows it adds to the step's forward plus the head's steps. On top of 8 decoding
sequences a verified row is priced against 8 tokens' share of the step, not one: a draft that pays for a
lone sequence may not pay there. Sequences are priced in turn, each on top of the choices before it.

A round drafting m tokens accepted independently with probability a emits E(m) = (1 - a^(m+1)) / (1 - a)
tokens. Each method is judged at its best length m (at most the round's k, and for n-gram the match's
length): where verifying costs much more than decoding (the int4 kernel on a CPU grows with the rows it
multiplies), a weak head's long chain loses to a short one, and to no draft at all. Each method's a is the
sequence's own decayed history for that method, starting from a prior: the head's held-out acceptance from
its training report, and for n-gram a prior that grows with the length of the matched suffix (a long match
in the prompt is usually a copy, and copying is where n-gram wins). Once the head is picked, its chain's
length is the head's own call, draft by draft (policy.ChainJudge, at the margin of the same step without
the head's own estimates: a draft is verified only while the head's confidence in it pays for its row).

A sequence's history starts from a prior, and the prior is what drafts of that method were accepted lately
across all sequences of the same sampling bucket (policy.SharedAcceptance: greedy, or about the same
temperature), itself pulled toward the fixed priors above while it is thin: at T=1 a one-hot draft is
accepted with the target's probability of it, a fifth of the time rather than half, and a new request learns
that from the requests before it instead of from its own losing rounds. The head's price includes feeding it
the rows it has not seen (EagleProposer.catch_up_cost): a sequence that has not drafted with the head for a
while pays a pass over all of them before its first draft, its prompt's rows included. Spreading that pass
over the head rounds left in the request (it serves all of them) was tried and measured worse: the head's
rounds came back and did not pay (docs/MEASUREMENTS.md, the open-chat trace). The head's features cost every step's forward
(three layers' rows gathered, handed to each sequence): they are computed only while a head round may be picked
(prefill: for TAP_LINGER steps after one was last priced above plain decoding and the other methods' drafts, or
for a prompt of a sampling bucket whose head was when last judged). Where none would be picked (many sampled
streams; where n-gram and suffix drafts price higher), the head sleeps and forgets its rows.

Where neither the suffix draft nor the head is picked, an n-gram match drafts as under method "ngram" (up to
the k that the k policy, policy.KPolicy, granted from the sequence's own acceptance, charging auto's drafts no
head step: the head's steps are priced here) while little is known of matches of its length: the shared
record of its kind (ngram1..ngram4, in the sampling bucket) holds less than its prior's weight. Once it holds
more, the match is judged at its kind's estimate as the other methods are: drafted (all of it, up to k) where
its best length beats plain decoding, and not at all where it does not. Its length stays the k policy's: a
copy's drafts are kept in runs, which the independent acceptance of best_length undervalues. The sequence's
own acceptance mixes every method's rounds, so a kind of match rarely kept (one-token matches in greedy open
chat) was drafted at the acceptance of its suffix drafts and long matches. The shared record fades, so a
declined kind is drafted again, to learn, once its evidence has faded below the prior's weight.
Where the sequence's latest tokens match LONG_MATCH or more tokens earlier on (usually a copy), the k
policy weighs a greedy request's round at what such matches were accepted lately across sequences instead
(draft_hint), up to the match's length: a sequence's own record mixes every method's rounds.

Suffix decoding (suffix.py) drafts with an estimated chance for each token (how often the matched text
went on that way before: the chance that the token is reached and accepted). Its round is priced from
those chances, scaled by how well they have predicted this sequence's acceptance so far (a decayed
ratio of accepted drafts to the chances' sum, starting at 1): verifying its first m drafts is expected
to emit 1 + f * (c_1 + ... + c_m) tokens (for a tree too: a node is accepted exactly when the path to
it is, so the expected accepted length is the sum of its nodes' chances), and it is cut at the m with
the best step rate: a tree's first m nodes, grown best first, are its likeliest. It is picked where that
rate beats the others' (and plain decoding's); where the suffix tree cannot be built here, auto goes on
without it.

The n-gram and suffix drafts' gains are scaled by the gain trust (gain_trust): what the drafts of that kind
(an n-gram match by its length, as the shared record keeps them, or a suffix draft) auto picked lately in the
sampling bucket kept of the tokens they were priced to add. Each method's estimate is fair on its own, but
auto drafts where an estimate is the best of three and beats plain decoding, so the drafts it picks are, more
often than not, those whose estimates erred high: picked drafts keep less than they were priced at, and the
ones that barely beat plain decoding lose. The trust takes that back out of their price.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from specstream.calibration import CostModel
from specstream.sequence import Acceptance
from specstream.spec_decode.policy import (
    SharedAcceptance,
    StepBase,
    StepPrice,
    best_cut,
    best_length,
    expected_tokens,
    sampling_bucket,
)
from specstream.spec_decode.draft_head import HeadError
from specstream.spec_decode.eagle import EagleProposer
from specstream.spec_decode.head_files import resolve_head_dir
from specstream.spec_decode.ngram import NgramProposer
from specstream.spec_decode.proposer import Draft, DraftMask, Proposer, ProposerContext
from specstream.spec_decode.suffix import SuffixProposer, SuffixUnavailable
from specstream.sequence import Sequence

logger = logging.getLogger(__name__)

# Prior acceptance of an n-gram draft by the length of the matched suffix.
NGRAM_PRIOR = {1: 0.15, 2: 0.35, 3: 0.55}
NGRAM_PRIOR_LONG = 0.7
# A matched suffix at least this long is usually a copy: its acceptance, learned across sequences by match
# length, is the k policy's hint (draft_hint) where it is above the sequence's own record.
LONG_MATCH = 3
HEAD_PRIOR = 0.6
# A method's acceptance: the prior's weight in drafts, and how fast its history fades.
PRIOR_WEIGHT = 2.0
DECAY = 0.9
# How auto's picked drafts of a kind kept what they were priced at, across sequences of a sampling bucket
# (the gain trust): the prior's weight (a ratio of 1), in tokens expected; how much of the record each round
# keeps; and the range the trust is held to.
TRUST_WEIGHT = 16.0
TRUST_DECAY = 0.995
TRUST_RANGE = (0.5, 1.25)
# The head's features are tapped from the target's forward (aux_layers) only while the head may be picked: for
# TAP_LINGER steps after a sequence's head round was last priced above plain decoding and the sequence's other drafts,
# its catch-up included (AutoProposer._head_rate).
TAP_LINGER = 64


@dataclass
class Calibration:
    """How well a proposer's own chances predict acceptance: decayed sums of accepted drafts and of
    the chances of the drafts verified, their ratio pulled toward 1 while they are few."""

    accepted: float = 0.0
    expected: float = 0.0

    def factor(self, weight: float = PRIOR_WEIGHT, start: float = 1.0) -> float:
        return (self.accepted + start * weight) / (self.expected + weight)

    def record(self, expected: float, accepted: int, decay: float = DECAY) -> None:
        self.accepted = self.accepted * decay + accepted
        self.expected = self.expected * decay + expected


@dataclass
class _SeqChoice:
    head: Acceptance
    # By match kind (ngram1..ngram4, the matched suffix's length): a sequence whose long matches were kept says
    # little of how often its one-token matches will be.
    ngram: dict[str, Acceptance] = field(default_factory=dict)
    suffix: Calibration = field(default_factory=Calibration)
    last_method: str = ""
    last_kind: str = ""  # last_method's key in the shared record and the gain trust (an n-gram match's by its length)
    last_expected: float = 0.0  # the suffix draft's sum of chances
    last_gain: float = 0.0  # the tokens an n-gram or suffix draft was priced to add, before the gain trust
    last_drafted: int = 0  # seq.stats totals when the last draft was handed out
    last_accepted: int = 0


class AutoProposer(Proposer):
    def __init__(
        self,
        head: EagleProposer | None,
        ngram: NgramProposer,
        head_prior: float = HEAD_PRIOR,
        suffix: SuffixProposer | None = None,
        k_max: int = 16,
    ) -> None:
        self.head = head
        self.k_max = k_max
        self._hint_seconds = 0.0
        self.ngram = ngram
        self.suffix = suffix
        self.head_prior = head_prior
        self._steps = 0  # engine steps (prefill is called once a step)
        self._tap_until = TAP_LINGER if head is not None else 0  # the head's features are tapped up to this step
        self._tapped = head is not None
        # By sampling bucket: the last step a sequence of it was judged, and the last its head round contended.
        self._judged: dict[str, int] = {}
        self._contended: dict[str, int] = {}
        self.target_cost: CostModel | None = None  # set by calibrate()
        self.lookup = ngram.lookup
        self._seqs: dict[str, _SeqChoice] = {}
        # Every sequence's rounds by method and sampling bucket: the prior of a sequence with little history.
        self.shared = SharedAcceptance()
        self.trust: dict[tuple[str, str], Calibration] = {}  # by kind and bucket: picked drafts' kept / priced

    @classmethod
    def build(cls, ctx: ProposerContext) -> AutoProposer:
        """The head bundled for the model (or config.speculative.draft_model) beside n-gram lookup; n-gram
        alone where the model has no head."""
        ngram = NgramProposer.build(ctx)
        k_max = ctx.config.speculative.num_speculative_tokens
        try:
            suffix = SuffixProposer.build(ctx)
        except SuffixUnavailable as exc:
            logger.warning("speculation auto: without suffix decoding (%s)", exc)
            suffix = None
        try:
            resolve_head_dir(ctx.config.speculative.draft_model, ctx.config.model)
        except HeadError as exc:
            logger.info("speculation auto: no draft head (%s)", exc)
            return cls(None, ngram, suffix=suffix, k_max=k_max)
        head = EagleProposer.build(ctx)
        # The head's held-out first-position acceptance is the best prior for its drafts.
        report = head.head.cfg.target.get("report") or {}
        accept = (report.get("acceptance_per_position") or [None])[0]
        return cls(head, ngram, head_prior=accept or HEAD_PRIOR, suffix=suffix, k_max=k_max)

    def calibrate(self, target_cost: CostModel, max_pass_tokens: int) -> None:
        if self.head is not None:
            self.head.calibrate(target_cost, max_pass_tokens)
        self.target_cost = target_cost

    def constrain(self, mask: DraftMask) -> None:
        if self.head is not None:
            self.head.constrain(mask)

    def pass_cost(self, num_seqs: int) -> float:
        """A draft's proposal cost as the k policy (policy.KPolicy) sees it before auto picks a
        method: no pass. The lookups every sequence let draft runs (n-gram, suffix) are its lookup_cost,
        as measured, and the head's steps are priced here, per sequence and round, where the head is
        weighed against the other methods and plain decoding (propose). Charging every draft a head step
        there would grant n-gram matches shorter drafts, or none, than plain `ngram` gets."""
        return 0.0

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The target layers the head reads, while its features are tapped; () while the head is dormant."""
        return self.head.aux_layers if self.head is not None and self._steps <= self._tap_until else ()

    def prefill(self, chunks: list[tuple[Sequence, int]]) -> None:
        """Once a step, before propose: the head's tap. It stays on for TAP_LINGER steps after a head round last
        priced above plain decoding and the sequence's other drafts, its catch-up included (_head_rate), and wakes
        for a prompt of a sampling bucket whose head contended when the bucket was last judged, or that was never
        judged, so that the head has the prompt's features. Once it goes off (no head round would be picked), the
        target's forward no longer computes the features nor hands them over, and the head forgets every sequence's
        rows; a sequence it drafts for after the tap wakes starts its head cache at the first features handed over
        again (less context for those drafts, never a different output)."""
        self._steps += 1
        if self.head is None:
            return
        for seq, _ in chunks:
            bucket = sampling_bucket(seq.params)
            judged = self._judged.get(bucket)
            if judged is None or self._contended.get(bucket, judged - TAP_LINGER) > judged - TAP_LINGER:
                self._tap_until = max(self._tap_until, self._steps + TAP_LINGER)
        tapped = self._steps <= self._tap_until
        if self._tapped and not tapped:
            logger.debug("speculation auto: the draft head goes dormant (no head round paid for %d steps)", TAP_LINGER)
            self.head.drop_states()
        self._tapped = tapped

    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        if self.head is not None:
            self.head.observe(seq, start, features)

    def draft_hint(self, seq: Sequence) -> tuple[float, int] | None:
        """A long n-gram match (LONG_MATCH tokens or more) is usually a copy of the prompt or of earlier
        output: its acceptance is what such matches were accepted lately across sequences (by match length
        and sampling bucket), not the sequence's own record, which mixes every method's rounds and so grants
        a long match fewer drafts than it goes on being accepted for. Greedy requests only: sampled requests'
        longer drafts measured slower (docs/MEASUREMENTS.md). The match is the one propose then finds (the sequence's window
        index, NgramProposer.match_seq: its new tokens go in here, and propose's lookup is a few gets)."""
        if not seq.params.greedy:
            return None
        started = time.perf_counter()
        tokens, n = self.ngram.match_seq(seq, self.k_max)
        self._hint_seconds += time.perf_counter() - started
        if n < LONG_MATCH or len(tokens) < 2:
            return None
        return self._ngram_prior(n, sampling_bucket(seq.params))[1], len(tokens)

    def _ngram_prior(self, n: int, bucket: str) -> tuple[str, float]:
        """The shared record's kind for an n-gram match of n tokens, and what such matches were accepted lately
        in bucket, pulled toward the fixed prior for n."""
        kind = f"ngram{min(n, 4)}"
        return kind, self.shared.prior(kind, bucket, NGRAM_PRIOR.get(n, NGRAM_PRIOR_LONG))

    def _judged_match(self, tokens: list[int], kind: str, bucket: str, pays: bool) -> list[int]:
        """An n-gram match as it drafts: whole (as under method "ngram") while the shared record of its kind holds
        less than its prior's weight, so that the record learns, or where its best length `pays` against plain
        decoding at its kind's estimate; nothing where it does not."""
        if not tokens or pays or self.shared.evidence(kind, bucket) < self.shared.weight:
            return tokens
        return []

    def gain_trust(self, kind: str, bucket: str) -> float:
        """What the drafts of kind (ngram1..ngram4 by match length, or suffix) auto picked lately in bucket kept of the
        tokens they were priced to add, pulled toward 1 while it is little known: their prices are scaled by
        it. Each estimate is fair alone, but a draft is picked where its estimate is the best of several and
        beats plain decoding, so the picked ones are those whose estimates erred high, and their drafts keep
        less than priced."""
        record = self.trust.get((kind, bucket))
        factor = record.factor(TRUST_WEIGHT) if record is not None else 1.0
        return min(max(factor, TRUST_RANGE[0]), TRUST_RANGE[1])

    def release(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        self.ngram.release(seq)
        if self.head is not None:
            self.head.release(seq)
        if self.suffix is not None:
            self.suffix.release(seq)

    def on_commit(self, seq: Sequence) -> None:
        self.shared.tick()
        if self.head is not None:
            self.head.on_commit(seq)  # the head's chances, checked against what its drafts kept (ChanceTrust)
        choice = self._seqs.get(seq.request_id)
        if choice is None or not choice.last_method:
            return
        drafted = seq.stats.drafted - choice.last_drafted
        accepted = seq.stats.accepted - choice.last_accepted
        bucket = sampling_bucket(seq.params)
        if choice.last_method in ("suffix", "ngram"):
            self.trust.setdefault((choice.last_kind, bucket), Calibration()).record(choice.last_gain, accepted, TRUST_DECAY)
        if choice.last_method == "suffix":
            choice.suffix.record(choice.last_expected, accepted)
            self.shared.record("suffix", bucket, accepted, choice.last_expected - accepted)
        else:
            record = choice.head if choice.last_method == "head" else choice.ngram.setdefault(choice.last_kind, Acceptance())
            record.record(drafted, accepted, DECAY)
            self.shared.record(choice.last_kind, bucket, accepted, float(accepted < drafted))
        choice.last_method = ""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in seqs]
        head_ks = [0] * len(seqs)
        # the n-gram draft (its kind, the tokens it was priced to add) of a sequence the head's chain may decline
        fallback: dict[int, tuple[Draft, str, float]] = {}
        # The step the drafts join: each sequence's choice is priced at its margin, after the choices before it.
        price = StepPrice(self.target_cost, self.take_step_base(len(seqs)))
        head_rows, head_gain = 0, 0.0  # what the head's picks are expected to add (its chains are judged later)
        head_step = self._head_step_cost()
        before, self._hint_seconds = self._hint_seconds, 0.0
        with self.timing_lookups(ks, before):  # the lookups and choices (lookup_cost; the head's passes are priced apart)
            for i, (seq, k) in enumerate(zip(seqs, ks)):
                if k <= 0:
                    continue
                choice = self._seqs.setdefault(seq.request_id, _SeqChoice(Acceptance()))
                bucket = sampling_bucket(seq.params)
                tokens, n = self.ngram.match_seq(seq, k)
                plain = price.rate()
                ngram_kind, ngram_prior = self._ngram_prior(n, bucket)
                ngram_a = choice.ngram.get(ngram_kind, Acceptance()).estimate(ngram_prior, PRIOR_WEIGHT)
                trust = self.gain_trust(ngram_kind, bucket)  # what picked matches of its length kept of their price
                ngram_rate = best_length(ngram_a, len(tokens), price, trust=trust)[0] if tokens else 0.0
                tokens = self._judged_match(tokens, ngram_kind, bucket, ngram_rate > plain)
                ngram_gain = expected_tokens(ngram_a, len(tokens)) - 1.0  # as priced, before the trust
                suffix_draft = self.suffix.draft(seq, k) if self.suffix is not None else Draft([])
                factor = choice.suffix.factor(start=self.shared.prior("suffix", bucket, 1.0))
                trusted = factor * self.gain_trust("suffix", bucket)
                suffix_rate, suffix_m = best_cut(suffix_draft.chances, trusted, price) if suffix_draft.tokens else (0.0, 0)
                head_a = choice.head.estimate(self.shared.prior("head", bucket, self.head_prior), PRIOR_WEIGHT)
                best = max(plain, ngram_rate, suffix_rate if suffix_m else 0.0)
                head_rate, head_m, catch_up = self._head_rate(seq, bucket, head_a, k, price, head_step, best)
                if suffix_m and suffix_rate > max(plain, ngram_rate, head_rate):
                    drafts[i] = suffix_draft.cut(suffix_m)  # a tree's first m nodes: the likeliest m, grown best first
                    choice.last_method, choice.last_kind, choice.last_expected = "suffix", "suffix", sum(drafts[i].chances)
                    choice.last_gain = factor * choice.last_expected
                    price.add(trusted * choice.last_expected, suffix_m)
                elif head_m and head_rate > plain and head_rate > ngram_rate:
                    # With the target's cost curve the head's chain stops by its own confidence (ChainJudge),
                    # up to k; without it, at the length best for the sequence's acceptance so far.
                    head_ks[i] = k if self.head.target_cost is not None else head_m
                    choice.last_method = choice.last_kind = "head"
                    gain = expected_tokens(head_a, head_m) - 1.0
                    price.add(gain, head_m, head_m * head_step + catch_up)
                    head_rows, head_gain = head_rows + head_m, head_gain + gain
                    if tokens:
                        fallback[i] = Draft(tokens, None, "ngram"), ngram_kind, ngram_gain
                elif tokens:
                    drafts[i] = Draft(tokens, None, "ngram")
                    choice.last_method, choice.last_kind, choice.last_gain = "ngram", ngram_kind, ngram_gain
                    price.add(trust * ngram_gain, len(tokens))
                choice.last_drafted, choice.last_accepted = seq.stats.drafted, seq.stats.accepted
        if any(head_ks):
            idx = [i for i, k in enumerate(head_ks) if k]
            # The head's chains are judged draft by draft against the step without the head's own estimates.
            self.head.begin_step(StepBase(price.rows - head_rows, price.step.expected - head_gain, price.prefill_rows))
            for i, d in zip(idx, self.head.propose([seqs[i] for i in idx], [head_ks[i] for i in idx])):
                if d.tokens:
                    drafts[i] = d
                    continue
                # The head found none of its drafts worth a row: for auto's choice that is a head round that
                # yielded nothing (so a head that keeps declining stops being picked), and the n-gram
                # match, where there is one worth verifying, drafts instead.
                choice = self._seqs[seqs[i].request_id]
                choice.head.record(1, 0, DECAY)
                self.shared.record("head", sampling_bucket(seqs[i].params), 0.0, 1.0)
                choice.last_method = ""
                if i in fallback:
                    drafts[i], choice.last_kind, choice.last_gain = fallback[i]
                    choice.last_method = "ngram"
        return drafts

    def _head_rate(
        self, seq: Sequence, bucket: str, a: float, k: int, price: StepPrice, step: float, best: float
    ) -> tuple[float, int, float]:
        """The head's best step rate for seq, its length, and the catch-up it is priced with. best is the best
        rate of plain decoding and the other methods' drafts for seq. A head round that would be picked (priced
        above best with its catch-up) keeps the head's features tapped (prefill), and so does one priced above best
        for a sequence the head cannot draft for now (no features since the tap woke: it starts with none to catch
        up), which is not picked. One priced above best only before its catch-up does not: while the tap stays on
        and the head is not picked, the rows it has not fed pile up and price it out for good; once the tap sleeps,
        the head forgets them, and a later round starts from the features handed over after it wakes."""
        if self.head is None:
            return 0.0, 0, 0.0
        self._judged[bucket] = self._steps
        rate, m = best_length(a, k, price, step)
        if rate <= best:
            return 0.0, 0, 0.0
        if not self.head.ready(seq):
            self._contend(bucket)
            return 0.0, 0, 0.0
        catch_up = self.head.catch_up_cost(seq)
        if catch_up > 0:
            rate, m = best_length(a, k, price, step, catch_up)
        if rate > best:
            self._contend(bucket)
        return rate, m, catch_up

    def _contend(self, bucket: str) -> None:
        """A head round of bucket would pay: its features stay tapped for TAP_LINGER steps."""
        self._contended[bucket] = self._steps
        self._tap_until = self._steps + TAP_LINGER

    def _head_step_cost(self) -> float:
        return self.head.pass_cost(1) if self.head is not None else 0.0
