"""Choosing each sequence's k for a round.

A sequence whose drafts are accepted independently with probability a emits
E(k) = 1 + a + ... + a^k tokens per round when drafting k. The step's time is the target's
forward over all the step's tokens plus, for a draft model, one drafting pass per draft
position. The policy adds drafts one at a time where they gain the most expected tokens
(a_i^(k_i + 1)) while the batch's tokens per second still improve, using the forward-time
curve measured at start-up: verification that is nearly free gets long drafts, a big batch
on a saturated device gets short ones or none (k = 0 is plain decoding).

Each sequence's a is estimated from its own history with exponential forgetting, so a
sequence whose drafts stop paying stops drafting, and probes again later as its history
fades toward the prior.
"""

from __future__ import annotations

import bisect
import heapq
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from specstream.sequence import Sequence

PRIOR_ACCEPT = 0.5
PRIOR_WEIGHT = 1.0
# History fades fast while drafting (acceptance changes with the text) and slowly while not,
# so a sequence whose drafts stopped paying probes again only every few dozen rounds.
DECAY_DRAFTING = 0.9
DECAY_IDLE = 0.97


class CostModel:
    """Piecewise-linear forward time (seconds) as a function of the step's token count,
    measured at start-up."""

    def __init__(self, tokens: list[int], seconds: list[float]) -> None:
        self.tokens = list(tokens)
        # A forward over more tokens never costs less; smooth out timing noise.
        self.seconds = []
        for s in seconds:
            self.seconds.append(max(s, self.seconds[-1]) if self.seconds else s)

    def __call__(self, n: float) -> float:
        t, s = self.tokens, self.seconds
        if len(t) == 1:
            return s[0] * max(n, 1) / t[0]
        i = min(max(bisect.bisect_left(t, n), 1), len(t) - 1)
        slope = (s[i] - s[i - 1]) / (t[i] - t[i - 1])
        return max(s[i - 1] + slope * (n - t[i - 1]), 1e-9)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"tokens": self.tokens, "seconds": self.seconds}))
        os.replace(tmp, path)  # atomic: a concurrent start reads the old file or the new one

    @classmethod
    def load(cls, path: Path) -> CostModel | None:
        """A saved curve, or None when there is none or it is not one."""
        try:
            data = json.loads(path.read_text())
            tokens, seconds = [int(t) for t in data["tokens"]], [float(x) for x in data["seconds"]]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not tokens or len(tokens) != len(seconds) or min(seconds) <= 0 or tokens != sorted(tokens):
            return None
        return cls(tokens, seconds)

    @classmethod
    def measure(cls, run: Callable[[int], None], sizes: list[int], repeats: int = 3) -> CostModel:
        """Time run(n) (one forward over n tokens) for each n; the fastest of repeats, since
        timing noise (other processes, page faults) only ever adds time."""
        run(sizes[0])  # warm-up
        seconds = []
        for n in sizes:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run(n)
                times.append(time.perf_counter() - start)
            seconds.append(min(times))
        return cls(sizes, seconds)


def acceptance_estimate(seq: Sequence) -> float:
    return (seq.accept_mass + PRIOR_ACCEPT * PRIOR_WEIGHT) / (seq.accept_mass + seq.reject_mass + PRIOR_WEIGHT)


def record_round(seq: Sequence, drafted: int, accepted: int) -> None:
    """A round is a geometric observation: `accepted` successes, then one failure unless all
    drafts were accepted."""
    decay = DECAY_DRAFTING if drafted else DECAY_IDLE
    seq.accept_mass = seq.accept_mass * decay + accepted
    seq.reject_mass = seq.reject_mass * decay + (1.0 if accepted < drafted else 0.0)


class KPolicy:
    def __init__(self, k_max: int, adaptive: bool, target_cost: CostModel | None, draft_pass_cost: Callable[[int], float]) -> None:
        self.k_max = k_max
        self.adaptive = adaptive and target_cost is not None
        self.target_cost = target_cost
        self.draft_pass_cost = draft_pass_cost

    def choose(self, seqs: list[Sequence], base_tokens: int, budget: int) -> list[int]:
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
        expected = float(len(seqs))
        tokens = base_tokens
        drafting = 0
        max_k = 0
        cost = self.target_cost(tokens)
        # Max-heap of each sequence's gain from one more draft.
        heap = [(-a, i) for i, a in enumerate(alphas) if a > 0 and caps[i] > 0]
        heapq.heapify(heap)
        while heap and budget > 0:
            neg_gain, i = heapq.heappop(heap)
            new_drafting = drafting + (ks[i] == 0)
            new_max_k = max(max_k, ks[i] + 1)
            new_cost = self.target_cost(tokens + 1) + new_max_k * self.draft_pass_cost(new_drafting)
            if (expected - neg_gain) / new_cost <= expected / cost:
                break
            ks[i] += 1
            expected -= neg_gain
            tokens += 1
            budget -= 1
            drafting, max_k, cost = new_drafting, new_max_k, new_cost
            if ks[i] < caps[i]:
                heapq.heappush(heap, (neg_gain * alphas[i], i))
        return ks
