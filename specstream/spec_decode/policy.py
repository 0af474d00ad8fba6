"""How much to draft: one judgement of tokens per second behind every drafting decision.

Vocabulary:
- *acceptance* a: the chance that a draft is accepted, given the drafts before it were. It is
  estimated from an Acceptance (sequence.py, a sequence's state): decayed counts of accepted and
  rejected drafts, pulled toward a prior while they are few. The priors, weights and decay rates
  are this module's (and auto's, for its per-method histories).
- *expected tokens*: a round drafting m tokens, each accepted with probability a, emits
  E(m) = 1 + a + ... + a^m tokens (the target's own next token included).
- *yield*: expected tokens per second of a step's cost. A draft (a verified row, a head step)
  *pays* when adding it raises the yield: its expected tokens g and its cost s satisfy
  g * seconds > expected * s, where (expected, seconds) is the step so far (StepYield).

Costs come from calibration.CostModel: the target's forward time by step size, and a drafter's
step time by batch size. The clients of this one judgement:
- KPolicy: each sequence's k for a round (the scheduler asks it). Drafts are added one at a time
  where they gain the most expected tokens (a_i^(k_i + 1)) while they pay: verification that is
  nearly free gets long drafts, a big batch on a saturated device short ones or none.
- auto.AutoProposer: the draft head, an n-gram match or no draft, per sequence and round, by
  round_rate at each method's best length, and a suffix draft by best_cut over its own chances.
- ChainJudge: where an EAGLE head's chain stops, draft by draft, from the head's confidence.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Protocol

from specstream.calibration import CostModel
from specstream.sampling import SamplingParams
from specstream.sequence import Acceptance

# A sequence's acceptance for the k policy: prior and its weight, in drafts.
PRIOR_ACCEPT = 0.5
PRIOR_WEIGHT = 1.0
# History fades fast while drafting (acceptance changes with the text) and slowly while not,
# so a sequence whose drafts stopped paying probes again only every few dozen rounds.
DECAY_DRAFTING = 0.9
DECAY_IDLE = 0.97


class Drafting(Protocol):
    """What the k policy reads of a sequence (engine.sequence.Sequence is one)."""

    acceptance: Acceptance
    params: SamplingParams


def acceptance_estimate(seq: Drafting) -> float:
    return seq.acceptance.estimate(PRIOR_ACCEPT, PRIOR_WEIGHT)


def record_round(seq: Drafting, drafted: int, accepted: int) -> None:
    seq.acceptance.record(drafted, accepted, DECAY_DRAFTING if drafted else DECAY_IDLE)


def expected_tokens(a: float, m: int) -> float:
    """Tokens a round emits when m drafts are each accepted with probability a (bonus included)."""
    return float(m + 1) if a >= 1.0 else (1.0 - a ** (m + 1)) / (1.0 - a)


def round_rate(a: float, drafts: int, verify: CostModel | None, step_cost: float = 0.0) -> float:
    """Expected tokens per second of one sequence's round drafting `drafts` tokens: the target verifies
    1 + drafts tokens, and the drafter takes `drafts` steps of step_cost seconds. Without a cost curve
    every verification costs one unit."""
    seconds = verify(1 + drafts) if verify is not None else 1.0
    return expected_tokens(a, drafts) / (seconds + drafts * step_cost)


def best_length(a: float, most: int, verify: CostModel | None, step_cost: float = 0.0) -> tuple[float, int]:
    """The best round_rate over draft lengths 1..most, and that length."""
    return max((round_rate(a, m, verify, step_cost), m) for m in range(1, most + 1))


def best_cut(chances: list[float], factor: float, verify: CostModel | None) -> tuple[float, int]:
    """The best expected rate of a draft whose tokens are reached and accepted with factor * chances[j]
    (a proposer's own estimates, as suffix decoding's, scaled by how well they have predicted), over its
    first m tokens (m >= 1), and that m."""
    best, best_m, expected = 0.0, 0, 1.0
    for m, c in enumerate(chances, 1):
        expected += factor * c
        rate = round_rate_expected(expected, m, verify)
        if rate > best:
            best, best_m = rate, m
    return best, best_m


def round_rate_expected(expected: float, drafts: int, verify: CostModel | None) -> float:
    """Tokens per second of a round expected to emit `expected` tokens from verifying 1 + drafts tokens."""
    return expected / (verify(1 + drafts) if verify is not None else 1.0)


class StepYield:
    """A step's expected tokens and cost so far; what is added to it is kept while it pays."""

    def __init__(self, expected: float, seconds: float) -> None:
        self.expected = expected
        self.seconds = seconds

    def pays(self, gain: float, seconds: float) -> bool:
        """Whether gain more expected tokens for seconds more time raise the step's tokens per second."""
        return gain * self.seconds > self.expected * seconds

    def add(self, gain: float, seconds: float) -> None:
        self.expected += gain
        self.seconds += seconds


class KPolicy:
    """k for each decoding sequence of a step. Without a cost curve (or adaptive=False) every sequence
    drafts its cap, within the step's budget."""

    def __init__(self, k_max: int, adaptive: bool, target_cost: CostModel | None, draft_pass_cost: Callable[[int], float]) -> None:
        self.k_max = k_max
        self.adaptive = adaptive and target_cost is not None
        self.target_cost = target_cost
        self.draft_pass_cost = draft_pass_cost

    def choose(self, seqs: list[Drafting], base_tokens: int, budget: int) -> list[int]:
        """k for each sequence; base_tokens are the step's tokens without drafts, budget the
        most draft tokens the step may add."""
        if not seqs or budget <= 0 or self.k_max == 0:
            return [0] * len(seqs)
        caps = [self.k_max if s.params.num_speculative_tokens is None else min(self.k_max, s.params.num_speculative_tokens) for s in seqs]
        if not self.adaptive:
            ks, left = [], budget
            for cap in caps:
                ks.append(min(cap, left))
                left -= ks[-1]
            return ks
        alphas = [acceptance_estimate(s) for s in seqs]
        ks = [0] * len(seqs)
        step = StepYield(float(len(seqs)), self.target_cost(base_tokens))
        tokens, drafting, max_k = base_tokens, 0, 0
        # Max-heap of each sequence's gain from one more draft.
        heap = [(-a, i) for i, a in enumerate(alphas) if a > 0 and caps[i] > 0]
        heapq.heapify(heap)
        while heap and budget > 0:
            neg_gain, i = heapq.heappop(heap)
            new_drafting = drafting + (ks[i] == 0)
            new_max_k = max(max_k, ks[i] + 1)
            new_cost = self.target_cost(tokens + 1) + new_max_k * self.draft_pass_cost(new_drafting)
            if not step.pays(-neg_gain, new_cost - step.seconds):
                break
            step.add(-neg_gain, new_cost - step.seconds)
            ks[i] += 1
            tokens += 1
            budget -= 1
            drafting, max_k = new_drafting, new_max_k
            if ks[i] < caps[i]:
                heapq.heappush(heap, (neg_gain * alphas[i], i))
        return ks


class ChainJudge:
    """Which of a step's head drafts are worth verifying (EAGLE-2's observation: a head's own
    probability of its draft tracks whether the target accepts it).

    A draft at chain position j is reached and accepted with about c_j, the product of the head's
    probabilities of drafts 1..j. Kept, it adds c_j expected tokens to the step, and costs one
    row of the target's verification plus its share of the head step that drafted it. It is
    kept while it pays (StepYield). A chain stops at its first draft not kept (later ones are
    less likely still); a first draft not kept leaves the sequence decoding plainly this round.
    """

    def __init__(self, verify: CostModel, head_pass: CostModel | None, num_seqs: int) -> None:
        self.verify = verify
        self.head_pass = head_pass
        self.rows = num_seqs  # each sequence verifies at least its own next token
        self.step = StepYield(float(num_seqs), verify(num_seqs))
        self.chance = [1.0] * num_seqs
        self.step_share = 0.0

    def head_step(self, num_seqs: int) -> None:
        """A head pass over num_seqs chains drafted the tokens judged next."""
        self.step_share = self.head_pass(num_seqs) / num_seqs if self.head_pass is not None else 0.0

    def keep(self, i: int, confidence: float) -> bool:
        """Sequence i's next draft, whose head probability is `confidence`: kept or not."""
        chance = self.chance[i] * confidence
        added = self.verify(self.rows + 1) - self.verify(self.rows) + self.step_share
        if not self.step.pays(chance, added):
            return False
        self.chance[i] = chance
        self.rows += 1
        self.step.add(chance, added)
        return True
