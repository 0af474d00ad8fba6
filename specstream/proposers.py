"""Draft proposers behind one interface.

A proposer is asked for up to k_i draft tokens for each decoding sequence and returns them
with, for stochastic proposers, the distribution each was drawn from (verification needs q).
Deterministic proposers return probs=None (q is one-hot). A proposer that reads the target's
hidden states (a trained draft head) names the layers in aux_layers and receives each
sequence's rows through observe(); verification does not change.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specstream.kv import KVPool
from specstream.runner import ForwardItem, ModelRunner
from specstream.sampling import STREAM_DRAFT, probabilities_for, sample_from, uniform
from specstream.sequence import Sequence


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V]: q for each token; None = one-hot
    method: str = ""  # which proposer made it (a metrics label)


class Proposer:
    # Target layers whose input hidden states the proposer reads (empty: none).
    aux_layers: tuple[int, ...] = ()

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        raise NotImplementedError

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


class DraftModelProposer(Proposer):
    """A small causal LM sharing the target's vocabulary, run batched: one packed pass per
    draft position over all drafting sequences, with its own KV pool and rollback."""

    def __init__(self, model, pool: KVPool, cost=None) -> None:
        self.runner = ModelRunner(model, pool)
        self.pool = pool
        self.cost = cost  # CostModel of one packed draft pass, set after calibration
        self._state: dict[str, list] = {}  # request_id -> [block_table, num_cached]

    def pass_cost(self, num_seqs: int) -> float:
        return self.cost(num_seqs) if self.cost is not None else 0.0

    def propose(self, seqs, ks):
        drafts = [Draft([], None, "draft") for _ in seqs]
        active = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k <= 0:
                continue
            table, _ = self._state.setdefault(seq.request_id, [[], 0])
            # Positions up to len + k - 2 are fed (the last draft is never fed).
            if self.pool.reserve(table, len(seq.token_ids) + k - 1):
                active.append(i)
        step = 0
        while active:
            items = []
            for i in active:
                seq, state = seqs[i], self._state[seqs[i].request_id]
                if step == 0:
                    new = seq.token_ids[state[1] :]
                else:
                    new = [drafts[i].tokens[-1]]
                items.append(ForwardItem(state[0], state[1], new, 1))
                state[1] += len(new)
            logits = self.runner.forward(items)
            self._choose(logits, [seqs[i] for i in active], [drafts[i] for i in active], step)
            step += 1
            active = [i for i in active if ks[i] > step]
        for d in drafts:
            if d.probs:
                d.probs = torch.stack(d.probs)
        return drafts

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[Draft], step: int) -> None:
        tokens, probs = choose_drafts(logits, seqs, step)
        for j, d in enumerate(drafts):
            d.tokens.append(tokens[j])
            if probs[j] is not None:
                d.probs = (d.probs or []) + [probs[j]]

    def on_commit(self, seq):
        state = self._state.get(seq.request_id)
        if state is not None:
            # Everything fed before the first position where the accepted tokens differ from
            # what was fed stays valid; that is at most len - 1 positions.
            state[1] = min(state[1], len(seq.token_ids) - 1)
            self.pool.trim(state[0], state[1])

    def release(self, seq):
        state = self._state.pop(seq.request_id, None)
        if state is not None:
            self.pool.free(state[0])


def choose_drafts(logits: torch.Tensor, seqs: list[Sequence], step: int, greedy_ids: list[int] | None = None) -> tuple[list[int], list]:
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
