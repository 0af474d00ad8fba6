"""Draft proposers behind one interface.

A proposer is asked for up to k_i draft tokens for each decoding sequence and returns them
with, for stochastic proposers, the distribution each was drawn from (verification needs q).
Deterministic proposers return probs=None (q is one-hot). A proposer that reads the target's
hidden states (a trained draft head) names the layers in aux_layers and receives each
sequence's rows through observe(); verification does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from specstream.kv import KVPool
from specstream.prefix_cache import PrefixCache
from specstream.runner import ForwardItem, ModelRunner
from specstream.sampling import STREAM_DRAFT, probabilities_for, sample_from, uniform
from specstream.sequence import Sequence


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V]: q for each token; None = one-hot
    method: str = ""  # which proposer made it (a metrics label)
    num_forced: int = 0  # [structured] leading tokens forced by the sequence's grammar


class Proposer:
    # Target layers whose input hidden states the proposer reads (empty: none).
    aux_layers: tuple[int, ...] = ()

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        raise NotImplementedError

    def prefill(self, chunks: list[tuple[Sequence, int]]) -> None:
        """The target is fed these prefill chunks (sequence, length) this step: a proposer
        with a KV cache of its own feeds them too, so it never catches up a whole prompt at once."""

    def pass_cost(self, num_seqs: int) -> float:
        """Seconds one drafting pass over num_seqs sequences costs (0 for free proposers)."""
        return 0.0

    def on_commit(self, seq: Sequence) -> None:
        """The target accepted some tokens of seq: drop state past them."""

    def release(self, seq: Sequence) -> None:
        """seq finished or was preempted: free what the proposer holds for it."""

    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        """The target's aux hidden states [n, len(aux_layers) * hidden] of seq's positions
        start .. start + n - 1, now final (prompt rows, or the accepted rows of a round)."""


class NoProposer(Proposer):
    def propose(self, seqs, ks):
        return [Draft([]) for _ in seqs]


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from max_n down to min_n) and propose the tokens that followed it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs, ks):
        return [Draft(self.lookup(s.token_ids, k), method="ngram") if k > 0 else Draft([]) for s, k in zip(seqs, ks)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        return self.match(tokens, k)[0]

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(up to k proposed tokens, length of the suffix that matched; 0 when none did)."""
        arr = np.asarray(tokens, dtype=np.int64)
        length = len(arr)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = arr[length - n :]
            # Windows starting at 0 .. length-n-1 (the suffix itself excluded).
            windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return arr[start : start + k].tolist(), n
        return [], 0


@dataclass
class _DraftKV:
    """One sequence's KV in the draft pool."""

    table: list[int] = field(default_factory=list)  # its block table
    fed: int = 0  # positions fed (their KV is in the pool)
    published: int = 0  # leading blocks of table already in the draft's prefix cache


class DraftModelProposer(Proposer):
    """A small causal LM sharing the target's vocabulary, run batched: one packed pass per
    draft position over all drafting sequences, with its own KV pool and rollback.

    Its cache follows the target's: prompts are fed in the target's prefill chunks, and a
    sequence that did not draft for a while (k = 0 rounds feed nothing) catches up by at most
    max_pass_tokens per step, drafting only once it is level, so no pass is longer than a
    target step may be.

    With prefix caching its pool has a prefix cache of its own, keyed by the same block
    digests as the target's: a sequence starts past the draft KV cached for its prefix, and
    the draft publishes only positions fed with tokens the target committed."""

    def __init__(self, model, pool: KVPool, max_pass_tokens: int, cost=None, prefix_caching: bool = True) -> None:
        self.runner = ModelRunner(model, pool)
        self.pool = pool
        self.max_pass_tokens = max_pass_tokens
        self.cost = cost  # CostModel of one packed draft pass, set after calibration
        self.prefix_cache = PrefixCache(pool) if prefix_caching else None
        self._state: dict[str, _DraftKV] = {}  # by request_id
        # [structured] (logits, seqs, drafted tokens) -> logits masked by each sequence's grammar
        self.constrain = None

    def pass_cost(self, num_seqs: int) -> float:
        return self.cost(num_seqs) if self.cost is not None else 0.0

    def prefill(self, chunks):
        items = []
        for seq, n in chunks:
            kv = self._kv(seq)
            end = seq.num_cached + n
            # A cache level with the target's (or ahead of it, when the draft pool held more of
            # the prefix) follows its chunks; one behind catches up in propose().
            if seq.num_cached <= kv.fed < end and self.pool.reserve(kv.table, end):
                items.append(ForwardItem(kv.table, kv.fed, seq.token_ids[kv.fed : end], 0))
                kv.fed = end
        if items:
            self.runner.forward(items)

    def propose(self, seqs, ks):
        drafts = [Draft([], None, "draft") for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active, items = self._first_pass(seqs, ks)
        step = 0
        while active or items:
            for i, new in active.items():
                kv = self._state[seqs[i].request_id]
                items.append(ForwardItem(kv.table, kv.fed, new, 1))
                kv.fed += len(new)
            logits = self.runner.forward(items)
            rows = list(active)
            if self.constrain is not None:  # [structured]
                logits = self.constrain(logits, [seqs[i] for i in rows], [drafts[i].tokens for i in rows])
            self._choose(logits, [seqs[i] for i in rows], [drafts[i] for i in rows], [probs[i] for i in rows], step)
            step += 1
            active = {i: [drafts[i].tokens[-1]] for i in active if ks[i] > step}
            items = []
        for d, p in zip(drafts, probs):
            if p:
                d.probs = torch.stack(p)
        return drafts

    def _first_pass(self, seqs: list[Sequence], ks: list[int]) -> tuple[dict[int, list[int]], list[ForwardItem]]:
        """What each drafting sequence feeds first: everything not yet fed, within
        max_pass_tokens. A sequence that does not fit catches up by what room is left (an
        item without logits, returned to ride along in the first pass) and drafts nothing
        this round."""
        active: dict[int, list[int]] = {}
        catch_up: list[ForwardItem] = []
        room = self.max_pass_tokens
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k <= 0 or room <= 0:
                continue
            kv = self._kv(seq)
            # Positions up to len + k - 2 are fed (the last draft is never fed).
            if not self.pool.reserve(kv.table, len(seq.token_ids) + k - 1):
                continue
            new = seq.token_ids[kv.fed :]
            if len(new) <= room:
                active[i] = new
            else:
                catch_up.append(ForwardItem(kv.table, kv.fed, new[:room], 0))
                kv.fed += room
            room -= len(new)
        return active, catch_up

    def _kv(self, seq: Sequence) -> _DraftKV:
        """seq's draft KV; a new one starts past the longest run of its blocks cached in the pool."""
        kv = self._state.get(seq.request_id)
        if kv is None:
            kv = self._state[seq.request_id] = _DraftKV()
            if self.prefix_cache is not None:
                kv.fed = self.prefix_cache.acquire(kv.table, seq)
                kv.published = len(kv.table)
        return kv

    def _publish(self, seq: Sequence, kv: _DraftKV) -> None:
        # Fed positions below the first one whose token the target did not accept hold
        # committed tokens: at least min(fed, len - 1) of them (see on_commit).
        if self.prefix_cache is not None:
            committed = min(kv.fed, len(seq.token_ids) - 1)
            kv.published = self.prefix_cache.publish(kv.table, seq, committed, kv.published)

    def _choose(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[Draft], probs: list[list], step: int
    ) -> None:
        """Append each sequence's next draft (argmax, or a sample from q) and, when sampled, its q."""
        tokens, qs = choose_drafts(logits, seqs, step)
        for j, d in enumerate(drafts):
            d.tokens.append(tokens[j])
            if qs[j] is not None:
                probs[j].append(qs[j])

    def on_commit(self, seq):
        kv = self._state.get(seq.request_id)
        if kv is not None:
            # Everything fed before the first position where the accepted tokens differ from
            # what was fed stays valid; that is at most len - 1 positions.
            kv.fed = min(kv.fed, len(seq.token_ids) - 1)
            self.pool.trim(kv.table, kv.fed)
            self._publish(seq, kv)

    def release(self, seq):
        kv = self._state.pop(seq.request_id, None)
        if kv is not None:
            self._publish(seq, kv)
            self.pool.free(kv.table)


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
