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
- auto.AutoProposer: the draft head, a suffix draft, an n-gram match or no draft, per sequence and round,
  by the rate of the step the drafts join (StepPrice) at each method's best length (best_length, and
  best_cut over a suffix draft's own chances).
- ChainJudge: where an EAGLE head's chain stops, draft by draft, from the head's confidence (taken at what
  such confidence was accepted lately: ChanceTrust).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
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
    """What the k policy reads of a sequence (engine.sequence.Sequence is one). draft_room: the most drafts its
    round may carry that could all be kept (None: no limit)."""

    acceptance: Acceptance
    params: SamplingParams
    draft_room: int | None


def acceptance_estimate(seq: Drafting, prior: float = PRIOR_ACCEPT) -> float:
    return seq.acceptance.estimate(prior, PRIOR_WEIGHT)


def record_round(seq: Drafting, drafted: int, accepted: int) -> None:
    seq.acceptance.record(drafted, accepted, DECAY_DRAFTING if drafted else DECAY_IDLE)


# The shared record (SharedAcceptance): its pull toward the fixed prior, in drafts, and how fast it fades,
# per decoding round recorded (about the last thousand rounds count).
SHARED_WEIGHT = 4.0
SHARED_DECAY = 0.999


def sampling_bucket(params: SamplingParams) -> str:
    """Requests whose drafts are accepted alike: greedy, or sampled at about the same temperature (a one-hot
    draft is accepted with the target's probability of it, which falls as the temperature rises)."""
    if params.greedy:
        return "greedy"
    return f"T{min(round(params.temperature * 4) / 4, 2.0):g}"


class SharedAcceptance:
    """What drafts of each kind were accepted lately across all sequences, by sampling bucket: the prior of a
    sequence with little history of its own. Without it each new request starts from a fixed prior, and at a
    high temperature (drafts accepted a fifth of the time, not half) every request pays for a few losing
    rounds before its own history says so. The counts fade with every round recorded, drafting or not, so a
    kind found poor drifts back to the fixed prior and is tried again, once the fixed prior says it pays."""

    def __init__(self, weight: float = SHARED_WEIGHT, decay: float = SHARED_DECAY) -> None:
        self.weight = weight
        self.decay = decay
        self.rounds = 0
        self._by: dict[tuple[str, str], tuple[Acceptance, int]] = {}

    def tick(self) -> None:
        """One decoding round passed."""
        self.rounds += 1

    def _record(self, key: tuple[str, str]) -> Acceptance | None:
        entry = self._by.get(key)
        if entry is None:
            return None
        record, last = entry
        if last != self.rounds:
            fade = self.decay ** (self.rounds - last)
            record.accepted *= fade
            record.rejected *= fade
            self._by[key] = (record, self.rounds)
        return record

    def prior(self, kind: str, bucket: str, default: float) -> float:
        """The estimate for drafts of `kind` in `bucket`: the shared record, pulled toward `default`."""
        record = self._record((kind, bucket))
        return default if record is None else record.estimate(default, self.weight)

    def evidence(self, kind: str, bucket: str) -> float:
        """How much the shared record of `kind` in `bucket` holds now: its faded counts, in drafts and rounds."""
        record = self._record((kind, bucket))
        return 0.0 if record is None else record.accepted + record.rejected

    def record(self, kind: str, bucket: str, accepted: float, rejected: float) -> None:
        """A round's drafts of `kind`: `accepted` of them, and `rejected` (1 where the round ended in a rejection;
        for a proposer's own chances, their sum less the accepted drafts)."""
        record = self._record((kind, bucket))
        if record is None:
            record = Acceptance()
            self._by[(kind, bucket)] = (record, self.rounds)
        record.accepted += accepted
        record.rejected += rejected


class ChanceTrust:
    """How well a draft head's chances (a draft's: the product of the head's probabilities along its path) have
    predicted acceptance lately, by depth and sampling bucket: what ChainJudge multiplies them by.

    A round's drafts at depth d are accepted at most once between them (one path is accepted, and it holds at
    most one node of each depth), so the chances of a round's depth-d drafts add up to the expected number of
    depth-d drafts accepted, 0 or 1, for a chain as for a tree. Per depth, the shared record (SharedAcceptance)
    keeps the accepted depth-d drafts and the rest of those sums; its estimate pulled toward 1 (the head's
    chances taken as they are) is the factor. A head trained to agree with the target can still be far more
    sure of itself than it is right on text unlike its training data: where its chances overstate acceptance,
    ChainJudge verifies fewer of its drafts, and the deeper ones, whose chances compound the error, first. The
    record fades with every round, so a depth whose drafts stopped being kept is tried again in time."""

    def __init__(self) -> None:
        self.shared = SharedAcceptance()
        # By request: its tokens and accepted drafts when it drafted, and its drafts' chances summed by depth.
        self._pending: dict[str, tuple[int, int, list[float]]] = {}

    def factor(self, bucket: str, depth: int) -> float:
        """What a depth-`depth` draft's chance is multiplied by in `bucket` (sampling_bucket)."""
        return self.shared.prior(f"depth{depth}", bucket, 1.0)

    def drafted(self, seq, chances: list[float], depths: list[int]) -> None:
        """seq (a Sequence) drafts this round: its drafts' own chances and depths (1: the first draft)."""
        by_depth = [0.0] * max(depths, default=0)
        for chance, depth in zip(chances, depths):
            by_depth[depth - 1] += chance
        self._pending[seq.request_id] = (len(seq.token_ids), seq.stats.accepted, by_depth)

    def committed(self, seq) -> None:
        """seq's round was verified (Proposer.on_commit): record the drafts it announced for it."""
        self.shared.tick()
        pending = self._pending.pop(seq.request_id, None)
        if pending is None:
            return
        length, before, by_depth = pending
        accepted = seq.stats.accepted - before
        if len(seq.token_ids) - length != accepted + 1:  # not the round those drafts were verified in
            return
        bucket = sampling_bucket(seq.params)
        for depth, expected in enumerate(by_depth, 1):
            got = float(accepted >= depth)
            self.shared.record(f"depth{depth}", bucket, got, expected - got)

    def release(self, seq) -> None:
        self._pending.pop(seq.request_id, None)


def trusted(chance: float, factor: float) -> float:
    """A draft head's chance taken at its trust (ChanceTrust.factor), at most certain."""
    return min(chance * factor, 1.0)


def expected_tokens(a: float, m: int) -> float:
    """Tokens a round emits when m drafts are each accepted with probability a (bonus included)."""
    return float(m + 1) if a >= 1.0 else (1.0 - a ** (m + 1)) / (1.0 - a)


def best_length(
    a: float, most: int, price: StepPrice, step_cost: float = 0.0, fixed: float = 0.0, trust: float = 1.0
) -> tuple[float, int]:
    """The best step rate (StepPrice.rate) over draft lengths 1..most of drafts each accepted with probability
    a, each also costing a drafter step of step_cost seconds, all of them `fixed` seconds more, and that length;
    the expected gain scaled by trust (what such drafts kept lately of their price)."""
    return max(
        (price.rate(trust * (expected_tokens(a, m) - 1.0), m, m * step_cost + fixed), m) for m in range(1, most + 1)
    )


def best_cut(chances: list[float], factor: float, price: StepPrice) -> tuple[float, int]:
    """The best step rate of a draft whose tokens are reached and accepted with factor * chances[j] (a
    proposer's own estimates, as suffix decoding's, scaled by how well they have predicted), over its first
    m tokens (m >= 1), and that m."""
    best, best_m, gain = 0.0, 0, 0.0
    for m, c in enumerate(chances, 1):
        gain += factor * c
        rate = price.rate(gain, m)
        if rate > best:
            best, best_m = rate, m
    return best, best_m


@dataclass(frozen=True)
class StepBase:
    """The step a round's drafts join, before any draft: the rows its forward feeds (each decoding sequence's
    next token and every prefill chunk) and the tokens it emits (one per decoding sequence). The engine hands
    it to the proposer each step (Proposer.begin_step): a draft's price is what it adds to this step.

    prefill_rows: how many of the rows are prefill chunks. A draft's row is priced at the margin of the whole step,
    but the rate it must beat is the decoding rows' alone (their tokens over their forward time): the chunks'
    time buys no token this step, and counted in, it would make the step's tokens per second so low that a draft
    of any acceptance looked worth its row beside a long prompt."""

    rows: int
    expected: float
    prefill_rows: int = 0

    @property
    def decoding_rows(self) -> int:
        """The rows whose forward time the step's tokens are set against (every row but the prefill chunks')."""
        return self.rows - self.prefill_rows

    @classmethod
    def alone(cls, num_seqs: int) -> StepBase:
        """A step of num_seqs decoding sequences and nothing else (a proposer called outside a step)."""
        return cls(num_seqs, float(num_seqs))


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


class StepPrice:
    """A step being built from its StepBase: drafts are priced at its margin, the rows they add to the forward
    (on the target's forward-time curve, at the step's size: a row costs more on top of 8 sequences than on top
    of 1) plus any drafter time, against the tokens they are expected to add. Without a curve a forward costs
    one unit whatever its rows."""

    def __init__(self, verify: CostModel | None, base: StepBase) -> None:
        self.verify = verify
        self.rows = base.rows
        self.prefill_rows = base.prefill_rows
        # The curve by row count, as read while this step is built (it moves only between steps): every
        # sequence's every method and length is priced from a few dozen sizes, read once each.
        self._curve: dict[int, float] = {}
        # the rows added cost what they add to the whole step; the rate to beat is the decoding rows' (StepBase)
        self.step = StepYield(base.expected, self._seconds(base.decoding_rows))

    def _seconds(self, rows: int) -> float:
        if self.verify is None:
            return 1.0
        seconds = self._curve.get(rows)
        if seconds is None:
            seconds = self._curve[rows] = self.verify(rows)
        return seconds

    def added(self, rows: int, extra: float = 0.0) -> float:
        """Seconds that `rows` more rows and `extra` seconds of drafting add to the step."""
        return self._seconds(self.rows + rows) - self._seconds(self.rows) + extra

    def rate(self, gain: float = 0.0, rows: int = 0, extra: float = 0.0) -> float:
        """The step's expected tokens per second with `gain` more expected tokens from `rows` more rows and
        `extra` seconds of drafting (all zero: the step as it is)."""
        return (self.step.expected + gain) / (self.step.seconds + self.added(rows, extra))

    def add(self, gain: float, rows: int, extra: float = 0.0) -> None:
        self.step.add(gain, self.added(rows, extra))
        self.rows += rows


# How far one step moves DraftingSurcharge's measures, and how much of its charge each plain step forgets.
SURCHARGE_RATE = 0.05
SURCHARGE_FORGET = 0.001
SURCHARGE_FIRST = 8  # plain steps of a batch size averaged whole before any is capped or a drafting step is measured


class DraftingSurcharge:
    """What a step of decoding sequences costs once any of them drafts, over a plain step of as many sequences,
    beyond what the forward-time curve prices its rows at: measured per batch size from the steps the engine runs.
    Two things make it. The host work besides the forward, the verification and the proposer's call (scheduling,
    packing, each round's bookkeeping). And the forward's shape, which the curve (by rows) does not see: a step
    where one of 8 sequences drafts runs every sequence as a verification, each padded to the longest run and
    masked, so its first draft row can cost several times what the next ones add. Neither grows much with the
    sequences drafting, so it is the step's, not each draft's: the k policy charges it to a step's first drafting
    sequence. Each plain step forgets a little of it, so that a charge measured on a busy machine does not stop
    drafting at that batch size for good."""

    def __init__(self) -> None:
        self.plain: dict[int, float] = {}  # batch size -> a plain step's seconds beyond the curve's price
        self.extra: dict[int, float] = {}  # batch size -> what drafting adds to them
        self.seen: dict[int, int] = {}  # batch size -> plain steps measured

    def __call__(self, num_seqs: int) -> float:
        return self.extra.get(num_seqs, 0.0)

    def observe(self, num_seqs: int, num_drafting: int, seconds: float, priced: float) -> None:
        """A step of num_seqs decoding sequences alone, num_drafting of them with drafts, took `seconds` beyond
        `priced`, the curve's price of its forward's rows (its host work, and what the curve misses of its
        forward; negative where the curve prices it high). A plain step's figure is its size's running mean at
        first (one slow first step does not set it), then fades; past that, neither a plain step nor a drafting
        step's excess over it counts for more than `priced` (one descheduled step says little)."""
        if num_seqs <= 0 or not math.isfinite(seconds) or not 0.0 < priced < math.inf:
            return
        plain = self.plain.get(num_seqs, 0.0)
        if not num_drafting:
            seen = self.seen[num_seqs] = self.seen.get(num_seqs, 0) + 1
            if seen > SURCHARGE_FIRST:
                seconds = min(seconds, plain + priced)
            self.plain[num_seqs] = plain + max(SURCHARGE_RATE, 1.0 / seen) * (seconds - plain)
            if num_seqs in self.extra:
                self.extra[num_seqs] *= 1.0 - SURCHARGE_FORGET
        elif self.seen.get(num_seqs, 0) >= SURCHARGE_FIRST:  # measured against a plain step of its size, once there is one
            extra = self.extra.get(num_seqs, 0.0)
            self.extra[num_seqs] = extra + SURCHARGE_RATE * (min(max(seconds - plain, 0.0), priced) - extra)


class KPolicy:
    """k for each decoding sequence of a step. Without a cost curve (or adaptive=False) every sequence
    drafts its cap, within the step's budget."""

    def __init__(
        self,
        k_max: int,
        adaptive: bool,
        target_cost: CostModel | None,
        draft_pass_cost: Callable[[int], float],
        lookup_cost: Callable[[], float] = lambda: 0.0,
        draft_hint: Callable[[Drafting], tuple[float, int] | None] = lambda seq: None,
        longest_run: int | None = None,
    ) -> None:
        """draft_pass_cost(n): a drafter's pass over n sequences; lookup_cost(): what each sequence let draft
        costs the proposer besides (Proposer.lookup_cost); draft_hint(seq): the proposer's own knowledge of
        the draft it has for seq now (Proposer.draft_hint): where its acceptance is above the sequence's
        record, seq's drafts are granted at that acceptance, up to the draft's length. longest_run: the most
        rows one sequence's round may feed while adaptive (None: no limit besides k_max), where a longer run
        sends the whole step down a slower path (the eager forward) that the curve, timed by rows on the
        shapes steps of that many rows usually have, does not price."""
        self.k_max = k_max
        self.longest_run = longest_run
        self.adaptive = adaptive and target_cost is not None
        self.target_cost = target_cost
        self.draft_pass_cost = draft_pass_cost
        self.lookup_cost = lookup_cost
        self.draft_hint = draft_hint
        self.shared = SharedAcceptance()  # every sequence's rounds: a new sequence's prior
        self.surcharge = DraftingSurcharge()  # what a step's drafting adds beyond its rows' price: the engine reports every step

    def estimate(self, seq: Drafting) -> float:
        """seq's acceptance: its own record, pulled toward what drafts like its were accepted lately."""
        return acceptance_estimate(seq, self.shared.prior("any", sampling_bucket(seq.params), PRIOR_ACCEPT))

    def record(self, seq: Drafting, drafted: int, accepted: int) -> None:
        """A decoding round of seq drafted `drafted` tokens along one path, `accepted` of them accepted."""
        record_round(seq, drafted, accepted)
        self.shared.tick()
        if drafted:
            self.shared.record("any", sampling_bucket(seq.params), accepted, float(accepted < drafted))

    def cap(self, seq: Drafting) -> int:
        """The most drafts seq's round may get: k_max, the request's own num_speculative_tokens, and what its
        completion may still hold (draft_room: a row past it is verified and thrown away)."""
        cap = self.k_max if seq.params.num_speculative_tokens is None else min(self.k_max, seq.params.num_speculative_tokens)
        return cap if seq.draft_room is None else min(cap, seq.draft_room)

    def choose(self, seqs: list[Drafting], base_tokens: int, budget: int) -> list[int]:
        """k for each sequence; base_tokens are the step's tokens without drafts, budget the
        most draft tokens the step may add."""
        if not seqs or budget <= 0 or self.k_max == 0:
            return [0] * len(seqs)
        caps = [self.cap(s) for s in seqs]
        if not self.adaptive:
            ks, left = [], budget
            for cap in caps:
                ks.append(min(cap, left))
                left -= ks[-1]
            return ks
        if self.longest_run is not None:
            caps = [min(cap, max(self.longest_run - 1, 0)) for cap in caps]
        alphas = [self.estimate(s) for s in seqs]
        for i, seq in enumerate(seqs):
            hint = self.draft_hint(seq) if caps[i] > 0 else None
            if hint is not None and hint[0] > alphas[i]:
                alphas[i], caps[i] = hint[0], min(caps[i], hint[1])
        lookup = self.lookup_cost()
        surcharge = self.surcharge(len(seqs))  # once, with the first sequence let draft
        ks = [0] * len(seqs)
        # Drafts cost what they add to the whole step, prefill chunks included, and must beat the decoding
        # rows' own rate (StepBase): the chunks' time is taken out of the step's seconds.
        chunks = self.target_cost(base_tokens) - self.target_cost(len(seqs))
        step = StepYield(float(len(seqs)), self.target_cost(len(seqs)))
        tokens, drafting, max_k = base_tokens, 0, 0
        # Max-heap of each sequence's gain from one more draft.
        heap = [(-a, i) for i, a in enumerate(alphas) if a > 0 and caps[i] > 0]
        heapq.heapify(heap)
        while heap and budget > 0:
            neg_gain, i = heapq.heappop(heap)
            new_drafting = drafting + (ks[i] == 0)
            new_max_k = max(max_k, ks[i] + 1)
            passes = new_max_k * self.draft_pass_cost(new_drafting)
            new_cost = self.target_cost(tokens + 1) - chunks + passes + new_drafting * lookup + surcharge
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

    def __init__(self, verify: CostModel, head_pass: CostModel | None, num_seqs: int, base: StepBase | None = None) -> None:
        """num_seqs: the sequences drafting; base: the step their drafts join (by default, theirs alone: each
        verifies its own next token)."""
        base = base or StepBase.alone(num_seqs)
        self.verify = verify
        self.head_pass = head_pass
        self.rows = base.rows
        self.step = StepYield(base.expected, verify(base.decoding_rows))  # the rate to beat: StepBase
        self.chance = [1.0] * num_seqs
        self.step_share = 0.0

    def head_step(self, num_seqs: int) -> None:
        """A head pass over num_seqs chains drafted the tokens judged next."""
        self.step_share = self.head_pass(num_seqs) / num_seqs if self.head_pass is not None else 0.0

    def keep(self, i: int, confidence: float, trust: float = 1.0) -> bool:
        """Sequence i's next draft, whose head probability is `confidence`: kept or not, its chance (the
        product of its chain's confidences) taken at `trust` times (ChanceTrust.factor)."""
        chance = self.chance[i] * confidence
        if not self.take(trusted(chance, trust), self.step_share):
            return False
        self.chance[i] = chance
        return True

    def _row(self, extra: float) -> float:
        return self.verify(self.rows + 1) - self.verify(self.rows) + extra

    def worth(self, chance: float, extra: float = 0.0) -> bool:
        """Whether a draft reached and accepted with `chance` would pay for its row and `extra` seconds
        (a head pass's share) now; nothing is kept."""
        return self.step.pays(chance, self._row(extra))

    def take(self, chance: float, extra: float = 0.0) -> bool:
        """Keep a draft (a chain's next, or a tree's node: in a tree too a node is accepted exactly when its
        path is, so its chance is its path's product) that is reached and accepted with `chance`, if it
        pays for its row and `extra` seconds."""
        added = self._row(extra)
        if not self.step.pays(chance, added):
            return False
        self.rows += 1
        self.step.add(chance, added)
        return True
