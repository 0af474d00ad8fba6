"""Suffix decoding (Oliaro et al., NeurIPS 2025; vLLM's method "suffix"): drafts from how text that ends
like this one went on before, in this request and in earlier ones.

Two kinds of suffix tree (kernels/suffix_tree.py, C++):
- one per running request, over its prompt's last `prompt_tokens` (1024; n-gram lookup, which auto runs
  beside, searches the whole prompt) and its output so far;
- a global cache over the first `cached_tokens` (512) of the outputs of earlier requests, bounded to
  `suffix_max_cached_requests` requests, one tree per cache_salt as in the prefix cache, so that requests of
  one salt never draft from another's outputs. The request with the least credit is dropped first: each
  joins with a credit of 1 and gains 1 whenever a draft the cache offers continues text it wrote last
  (SuffixTree.source), and every credit fades by CREDIT_FADE with each request that joins (least recently and
  least frequently used: LRFU). Dropping the oldest instead, a burst of requests unlike the rest (open chat
  between an agent's loops) pushed out the outputs the agent's drafts came from; a request whose text keeps
  being drafted from now outlasts a burst of others, and once it stops being drafted from it fades out.

Memory: a tree of depth 24 holds about 17 nodes per token of real text, about 1.3 KB per token (73 bytes
a node, measured), so the default cache (256 requests) takes at most about 170 MB and typically a third of
that, and a running request's own tree at most about 2 MB plus its output's share.

Each round, both trees are matched against the sequence's last tokens and continued along the most
frequent path; the draft with the larger sum of estimated chances is proposed. The request's own tree holds
those tokens itself, so its matches are its sequence's own nodes (SuffixTree.speculate_held), not walks
from the root (every suffix matches there). A draft is at most
`suffix_max_spec_factor` times its match length long, and stops at the first token whose estimated chance
(child count over parent count, multiplied along the path) falls under `suffix_min_token_prob`.

The drafts are deterministic (q one-hot), so verification is the same as for n-gram drafts, greedy or
sampled. Each draft carries its tokens' estimated chances (Draft.chances), which auto (auto.py) prices.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from specstream.kernels.suffix_tree import SuffixTree, available, unavailable_reason
from specstream.sequence import Sequence
from specstream.spec_decode.proposer import Draft, Proposer, ProposerContext

logger = logging.getLogger(__name__)


ID_MASK = 0x7FFFFFFF
# How much of its credit a cached request keeps each time another request joins the cache.
CREDIT_FADE = 0.99


class SuffixUnavailable(RuntimeError):
    """The suffix tree could not be built here (no C++ compiler)."""


class GlobalSuffixCache:
    """The outputs of earlier requests, one suffix tree per cache_salt, at most max_requests in all."""

    def __init__(self, max_depth: int, max_requests: int, max_tokens: int) -> None:
        self.max_depth = max_depth
        self.max_requests = max_requests
        self.max_tokens = max_tokens  # of one request's output kept
        self._trees: dict[str | None, SuffixTree] = {}
        self._held: dict[str | None, int] = {}  # requests held per salt
        self._salt: dict[int, str | None] = {}  # cached id -> its cache_salt
        self._credit: dict[int, float] = {}  # cached id -> its credit (the one with the least is dropped first)
        self._ids = itertools.count()
        self._offered: int | None = None  # the request the latest speculate's draft continues

    def __len__(self) -> int:
        return len(self._salt)

    def add(self, salt: str | None, tokens: list[int]) -> None:
        if self.max_requests <= 0 or not tokens:
            return
        tree = self._trees.get(salt)
        if tree is None:
            tree = self._trees[salt] = SuffixTree(self.max_depth)
        seq_id = next(self._ids) & ID_MASK  # the tree names a node's writer by an id's low 31 bits
        while seq_id in self._salt:  # (after 2^31 requests, one still held)
            seq_id = next(self._ids) & ID_MASK
        tree.extend(seq_id, tokens[: self.max_tokens])
        for held in self._credit:
            self._credit[held] *= CREDIT_FADE
        self._salt[seq_id] = salt
        self._credit[seq_id] = 1.0
        self._held[salt] = self._held.get(salt, 0) + 1
        while len(self._salt) > self.max_requests:
            self._evict()

    def _evict(self) -> None:
        seq_id = min(self._credit, key=self._credit.__getitem__)  # the oldest of equal credits (insertion order)
        salt = self._salt.pop(seq_id)
        del self._credit[seq_id]
        self._trees[salt].remove(seq_id)
        self._held[salt] -= 1
        if not self._held[salt]:
            del self._trees[salt], self._held[salt]

    def speculate(self, salt: str | None, context: list[int], k: int, factor: float, min_prob: float, tree: bool = False):
        """The cache's best draft for salt's requests: as SuffixTree.speculate, or speculate_tree with tree."""
        held = self._trees.get(salt)
        self._offered = None
        if held is None:
            return ([], [], [], 0) if tree else ([], [], 0)
        draft = held.speculate_tree(context, k, factor, min_prob) if tree else held.speculate(context, k, factor, min_prob)
        self._offered = held.source() if draft[0] else None
        return draft

    def used(self) -> None:
        """The latest speculate's draft was taken: the request whose text it continues gains a credit of 1.
        Nothing where that request has been dropped since it wrote the text."""
        if self._offered is not None and self._offered in self._credit:
            self._credit[self._offered] += 1.0

    @property
    def num_nodes(self) -> int:
        return sum(t.num_nodes for t in self._trees.values())


@dataclass
class _Local:
    tree: SuffixTree
    start: int  # index in seq.token_ids where the tree's tokens begin
    held: int = 0  # tokens the tree holds


class SuffixProposer(Proposer):
    def __init__(
        self,
        max_depth: int = 24,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_cached_requests: int = 256,
        prompt_tokens: int = 1024,
        cached_tokens: int = 512,
        trees: bool = False,
    ) -> None:
        if not available():
            raise SuffixUnavailable(f"suffix decoding needs its C++ suffix tree, which could not be built: {unavailable_reason()}")
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.prompt_tokens = prompt_tokens
        self.trees = trees
        self.cache = GlobalSuffixCache(max_depth, max_cached_requests, cached_tokens)
        self._local: dict[str, _Local] = {}

    @classmethod
    def build(cls, ctx: ProposerContext) -> SuffixProposer:
        spec = ctx.config.speculative
        return cls(
            spec.suffix_max_depth,
            spec.suffix_max_spec_factor,
            spec.suffix_min_token_prob,
            spec.suffix_max_cached_requests,
            trees=ctx.trees,
        )

    # [structured] lookup stays None: a token list alone names no request, so no cache_salt to draft under;
    # a grammar's forced tokens are drafted without a suffix continuation after them.

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        with self.timing_lookups(ks):
            return [self.draft(s, k) if k > 0 else Draft([]) for s, k in zip(seqs, ks)]

    def draft(self, seq: Sequence, k: int) -> Draft:
        """The better of the request's own tree's draft and the global cache's (by the sum of chances: the
        expected accepted tokens), up to k tokens; a tree where trees are verified here."""
        local = self._sync(seq)
        # The request's own tree holds its text up to the last token: its matches are that text's suffixes.
        mine = local.tree.speculate_held(0, k, self.max_spec_factor, self.min_token_prob, self.trees)
        if not self.trees:
            mine = (mine[0], mine[2], mine[3])
        context = seq.token_ids[-self.max_depth :]
        earlier = self.cache.speculate(seq.cache_salt, context, k, self.max_spec_factor, self.min_token_prob, tree=self.trees)
        best = max(mine, earlier, key=lambda d: sum(d[-2]))
        if not best[0]:
            return Draft([])
        if best is earlier:
            self.cache.used()
        if self.trees:
            tokens, parents, chances, _ = best
            return Draft(tokens, None, "suffix", chances=chances, parents=parents)
        tokens, chances, _ = best
        return Draft(tokens, None, "suffix", chances=chances)

    def _sync(self, seq: Sequence) -> _Local:
        """The request's tree, holding its prompt's last tokens and everything after them."""
        local = self._local.get(seq.request_id)
        if local is None:
            start = max(0, seq.num_prompt_tokens - self.prompt_tokens)
            local = self._local[seq.request_id] = _Local(SuffixTree(self.max_depth), start)
        new = seq.token_ids[local.start + local.held :]
        if new:
            local.tree.extend(0, new)
            local.held += len(new)
        return local

    def release(self, seq: Sequence) -> None:
        """A finished request's output joins the global cache; a preempted one's tree is rebuilt when it
        runs again."""
        self._local.pop(seq.request_id, None)
        if seq.finish_reason not in (None, "error") and seq.num_output_tokens:
            self.cache.add(seq.cache_salt, seq.output_ids)
