"""The one interface every proposer implements, and what they share.

A proposer is asked for up to k_i draft tokens for each decoding sequence and returns them
with, for stochastic proposers, the distribution each was drawn from (verification needs q).
Deterministic proposers return probs=None (q is one-hot). A proposer that reads the target's
hidden states (a trained draft head) names the layers in aux_layers and receives each
sequence's rows through observe(); verification does not change.

The engine reaches a proposer only through this interface: it is built by name
(registry.py), calibrated, constrained by grammars and fed through these hooks, whatever
its kind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from specstream.calibration import CostModel
from specstream.spec_decode.policy import StepBase
from specstream.config import EngineConfig
from specstream.sequence import Sequence
from specstream.sampling import STREAM_DRAFT, probabilities_for, sample_from, uniform

# [structured] (logits, seqs, drafted tokens so far) -> the logits masked by each sequence's grammar
DraftMask = Callable[[torch.Tensor, list[Sequence], list[list[int]]], torch.Tensor]


@dataclass
class Draft:
    """A sequence's drafts for one round: a chain (each token follows the one before), or a tree (parents:
    each token's parent, an earlier index, or -1 for a token that follows the sequence's last token; a
    chain is the tree whose parents are -1, 0, 1, ...). A tree is verified in one forward, each of its
    rows seeing only its own ancestors (attention.py), and the longest path the target agrees with is
    accepted (verify.py). A tree's nodes may carry q (a sampled request's head tree): probs[j] is the
    distribution node j was drawn from (its parent's row), and the children of a node are successive draws
    from it without replacement, in index order, so that verify.py's recursive rejection sampling tries them
    in the order drawn. A node is then only kept after its elder siblings (cut and main_chain keep that)."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V]: q for each token; None = one-hot
    method: str = ""  # which proposer made it (a metrics label)
    num_forced: int = 0  # [structured] leading tokens forced by the sequence's grammar
    # Each token's estimated chance of being reached and accepted, where the proposer has one (suffix; a draft
    # head's judged drafts: the product of its probabilities along the path).
    chances: list[float] | None = None
    parents: list[int] | None = None  # None: a chain

    def __post_init__(self) -> None:
        if self.parents is not None:
            if len(self.parents) != len(self.tokens) or any(not -1 <= p < i for i, p in enumerate(self.parents)):
                raise ValueError("a draft tree's parents must each be -1 or an earlier token's index")
            if self.probs is not None and len(self.probs) != len(self.tokens):
                raise ValueError("a draft tree's q needs one row per token")
            if all(p == i - 1 for i, p in enumerate(self.parents)):
                self.parents = None  # a chain

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def depths(self) -> list[int]:
        """Each token's depth: 1 for those that follow the sequence's last token, a node's parent's + 1."""
        if self.parents is None:
            return list(range(1, len(self.tokens) + 1))
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    def cut(self, k: int) -> Draft:
        """The first k tokens (a tree's first k nodes keep their parents: every node follows its parent)."""
        if k >= len(self.tokens):
            return self
        return Draft(
            self.tokens[:k],
            None if self.probs is None else self.probs[:k],
            self.method,
            self.num_forced,
            None if self.chances is None else self.chances[:k],
            None if self.parents is None else self.parents[:k],
        )

    def main_chain(self) -> Draft:
        """A tree's first path (each node's first child, in the draft's order: its likeliest, for a tree grown
        best first), as a chain; a chain as it is."""
        if self.parents is None:
            return self
        path, node = [], -1
        for i, p in enumerate(self.parents):
            if p == node:
                path.append(i)
                node = i
        chances = None if self.chances is None else [self.chances[i] for i in path]
        # Each node's first child is its first draw: the path is a chain of draws, each from its q.
        probs = None if self.probs is None else self.probs[path]
        return Draft([self.tokens[i] for i in path], probs, self.method, self.num_forced, chances)


@dataclass
class ProposerContext:
    """What a proposer's build() may read of the engine being built."""

    config: EngineConfig
    target: Any  # the target model (transformers' module)
    tokenizer: Any
    vocab_size: int
    dtype: torch.dtype
    device: torch.device
    pool_positions: int  # positions one sequence may take in a proposer's own KV pool (as in the target's)
    trees: bool = False  # whether drafts may be trees (Draft.parents): the target's attention verifies them


# How far one measurement moves a proposer's lookup time per drafting sequence (Proposer.note_lookups).
LOOKUP_RATE = 0.05


class Proposer:
    # Target layers whose input hidden states the proposer reads (empty: none).
    aux_layers: tuple[int, ...] = ()
    # Seconds of lookups (an n-gram match, a suffix tree's walk) a drafting sequence costs the proposer each
    # round, learned from its own rounds (note_lookups); 0 for a proposer whose cost is its passes (pass_cost).
    lookup_seconds: float = 0.0
    # [structured] lookup(tokens, k): continue a token list as this proposer would (n-gram lookup), so
    # that its drafts can follow tokens a grammar forces; None where drafts cannot follow them.
    lookup: Callable[[list[int], int], list[int]] | None = None

    @classmethod
    def build(cls, ctx: ProposerContext) -> Proposer:
        """The proposer EngineConfig.speculative asks for, built for ctx's target."""
        return cls()

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        raise NotImplementedError

    _step_base: StepBase | None = None  # set by begin_step, taken by the next propose (take_step_base)

    def begin_step(self, base: StepBase) -> None:
        """The step the next propose()'s drafts join (its rows and tokens before any draft): a proposer that
        prices its drafts prices them at this step's margin. Without it, propose() prices them as if its
        sequences were the step's only ones."""
        self._step_base = base

    def take_step_base(self, num_seqs: int) -> StepBase:
        """For propose(): the step begin_step announced, once (a later call without one prices its num_seqs
        sequences as the step's only ones)."""
        base, self._step_base = self._step_base or StepBase.alone(num_seqs), None
        return base

    def prefill(self, chunks: list[tuple[Sequence, int]]) -> None:
        """The target is fed these prefill chunks (sequence, length) this step: a proposer
        with a KV cache of its own feeds them too, so it never catches up a whole prompt at once.
        The engine calls it once every step, before propose and before it reads aux_layers (chunks may be none)."""

    def pass_cost(self, num_seqs: int) -> float:
        """Seconds one drafting pass over num_seqs sequences costs (0 for free proposers)."""
        return 0.0

    def draft_hint(self, seq: Sequence) -> tuple[float, int] | None:
        """Before the k policy grants seq its k: (the acceptance of the draft this proposer has for seq now,
        how many tokens that draft holds), where it knows better than the sequence's own record (auto: a long
        n-gram match, usually a copy); None: no better knowledge, the record decides."""
        return None

    def lookup_cost(self) -> float:
        """Seconds a sequence let draft costs the proposer each round before any pass (its lookups), as
        measured: the k policy charges it to each sequence it lets draft. (Called free, a lookup took a
        third of a verified row's price at 8 streams: 0.5 ms a sequence, where a row adds 1.2 ms.)"""
        return self.lookup_seconds

    @contextmanager
    def timing_lookups(self, ks: list[int], before: float = 0.0) -> Iterator[None]:
        """Time the block as this round's lookups for the sequences of ks that may draft (note_lookups), with
        `before` seconds of this round's lookups done earlier (draft_hint's)."""
        started = time.perf_counter()
        yield
        self.note_lookups(time.perf_counter() - started + before, sum(k > 0 for k in ks))

    def note_lookups(self, seconds: float, num_seqs: int) -> None:
        """num_seqs sequences' lookups took `seconds` this round. A round counts for at most 3x the estimate
        so far (one descheduled round says little about the next, and an estimate raised high would stop
        the drafting that measures it)."""
        if num_seqs > 0:
            each = seconds / num_seqs
            if self.lookup_seconds > 0:
                each = min(each, 3.0 * self.lookup_seconds)
            self.lookup_seconds += LOOKUP_RATE * (each - self.lookup_seconds)

    def on_commit(self, seq: Sequence) -> None:
        """The target accepted some tokens of seq: drop state past them."""

    def release(self, seq: Sequence) -> None:
        """seq finished or was preempted: free what the proposer holds for it."""

    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        """The target's aux hidden states [n, len(aux_layers) * hidden] of seq's positions
        start .. start + n - 1, now final (prompt rows, or the accepted rows of a round). Only in steps whose
        aux_layers were not empty: a proposer whose aux_layers go empty for a while sees a gap in positions."""

    def calibrate(self, target_cost: CostModel, max_pass_tokens: int) -> None:
        """Measure what drafting costs here (pass_cost), given the target's forward-time curve."""

    def constrain(self, mask: DraftMask) -> None:
        """[structured] Mask the proposer's own logits by each sequence's grammar while drafting (a
        proposer that samples from logits must, so that its q is the constrained q)."""


class NoProposer(Proposer):
    def propose(self, seqs, ks):
        return [Draft([]) for _ in seqs]


def choose_drafts(
    logits: torch.Tensor, seqs: list[Sequence], step: int, greedy_ids: list[int] | None = None
) -> tuple[list[int], list]:
    """Draft token `step` of each sequence from its proposer's logits [len(seqs), V]: the
    argmax for greedy requests (or greedy_ids when the caller has them), else a sample from
    the request's own sampling distribution q, returned with it for verification."""
    sampled = [j for j, s in enumerate(seqs) if not s.params.greedy]
    tokens = list(greedy_ids) if greedy_ids is not None else logits.argmax(-1).tolist()
    probs: list = [None] * len(seqs)
    if not sampled:
        return tokens, probs
    rows = probabilities_for(logits[sampled], [seqs[j].params for j in sampled])
    us = torch.tensor(
        [uniform(seqs[j].seed, seqs[j].num_output_tokens + step, STREAM_DRAFT) for j in sampled],
        dtype=torch.float64,
        device=logits.device,
    )
    for row, (j, tok) in enumerate(zip(sampled, sample_from(rows, us).tolist())):
        tokens[j], probs[j] = tok, rows[row]
    return tokens, probs
