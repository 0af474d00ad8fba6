"""Prompt lookup (n-gram): drafts copied from where the sequence's latest tokens occurred before."""

from __future__ import annotations

import numpy as np

from specstream.spec_decode.proposer import Draft, Proposer, ProposerContext


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from max_n down to min_n) and propose the tokens that followed it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    @classmethod
    def build(cls, ctx: ProposerContext) -> NgramProposer:
        return cls(ctx.config.speculative.ngram_min, ctx.config.speculative.ngram_max)

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
