"""Prompt lookup (n-gram): drafts copied from where the sequence's latest tokens occurred before.

As a chain (the default where trees are not verified, and auto's n-gram draft): what followed the latest
earlier occurrence of the longest suffix that matched. As a tree (where the target verifies trees,
ProposerContext.trees): the continuations of the matched suffix's most recent occurrences (up to
MAX_OCCURRENCES), merged where they agree, each node carrying its estimated chance (the share of the
occurrences that went on that way). The tree is grown best first: by chance, then the shallower node,
then the one seen most recently; so with one occurrence, or where they all agree, it is the chain.
"""

from __future__ import annotations

import heapq

import numpy as np

from specstream.sequence import Sequence
from specstream.spec_decode.proposer import Draft, Proposer, ProposerContext

MAX_OCCURRENCES = 32  # the most recent occurrences of the matched suffix a tree is grown from


class NgramProposer(Proposer):
    """Prompt lookup: find the earlier occurrences of the sequence's last n tokens (n from max_n down to
    min_n) and propose the tokens that followed them: the latest one's as a chain, or all of theirs as a
    tree where trees are verified."""

    def __init__(self, min_n: int, max_n: int, trees: bool = False) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.trees = trees
        self._arrays: dict[str, TokenArray] = {}  # by request: its tokens as the tree lookups read them
        self._indexes: dict[str, MatchIndex] = {}  # by request: its windows as the chain lookups find them

    @classmethod
    def build(cls, ctx: ProposerContext) -> NgramProposer:
        return cls(ctx.config.speculative.ngram_min, ctx.config.speculative.ngram_max, ctx.trees)

    def propose(self, seqs, ks):
        with self.timing_lookups(ks):
            return [self._draft(s, k) if k > 0 else Draft([]) for s, k in zip(seqs, ks)]

    def _draft(self, seq: Sequence, k: int) -> Draft:
        if self.trees:
            return self.draft_tree(self.tokens_of(seq), k)
        return Draft(self.match_seq(seq, k)[0], method="ngram")

    def match_seq(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """seq's match as match() finds it, from the index of its windows kept as its tokens grow (MatchIndex)."""
        index = self._indexes.get(seq.request_id)
        if index is None:
            index = self._indexes[seq.request_id] = MatchIndex(self.min_n, self.max_n)
        return index.match(seq.token_ids, k)

    def tokens_of(self, seq: Sequence) -> np.ndarray:
        """seq's tokens as an array, converted a new token at a time (TokenArray)."""
        held = self._arrays.get(seq.request_id)
        if held is None:
            held = self._arrays[seq.request_id] = TokenArray()
        return held.view(seq.token_ids)

    def release(self, seq: Sequence) -> None:
        self._arrays.pop(seq.request_id, None)
        self._indexes.pop(seq.request_id, None)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        return self.match(tokens, k)[0]

    def match(self, tokens: list[int] | np.ndarray, k: int) -> tuple[list[int], int]:
        """(up to k proposed tokens, length of the suffix that matched; 0 when none did)."""
        arr, hits, n = self._occurrences(tokens)
        if not n:
            return [], 0
        start = int(hits[-1]) + n
        return arr[start : start + k].tolist(), n

    def draft_tree(self, tokens: list[int], k: int) -> Draft:
        """Up to k nodes grown best first from the continuations of the matched suffix's most recent
        occurrences (a chain where they agree)."""
        arr, hits, n = self._occurrences(tokens)
        if not n:
            return Draft([])
        hits = hits[-MAX_OCCURRENCES:]
        # A trie of the continuations: node -> [token, parent node, count, most recent occurrence, depth].
        nodes: list[list[int]] = []
        children: dict[tuple[int, int], int] = {}
        by_parent: dict[int, list[int]] = {}
        for occurrence, hit in enumerate(hits.tolist()):
            parent = -1
            for depth, tok in enumerate(arr[hit + n : hit + n + k].tolist(), 1):
                node = children.get((parent, tok))
                if node is None:
                    node = children[(parent, tok)] = len(nodes)
                    nodes.append([tok, parent, 0, 0, depth])
                    by_parent.setdefault(parent, []).append(node)
                nodes[node][2] += 1
                nodes[node][3] = occurrence
                parent = node
        total = len(hits)

        def entry(node: int) -> tuple[float, int, int, int]:
            _, _, count, recent, depth = nodes[node]
            return (-count / total, depth, -recent, node)

        heap = [entry(c) for c in by_parent.get(-1, [])]
        heapq.heapify(heap)
        out_tokens: list[int] = []
        parents: list[int] = []
        chances: list[float] = []
        index: dict[int, int] = {}  # trie node -> its index in the draft
        while heap and len(out_tokens) < k:
            neg_chance, _, _, node = heapq.heappop(heap)
            tok, parent = nodes[node][0], nodes[node][1]
            index[node] = len(out_tokens)
            out_tokens.append(tok)
            parents.append(-1 if parent < 0 else index[parent])
            chances.append(-neg_chance)
            for child in by_parent.get(node, []):
                heapq.heappush(heap, entry(child))
        return Draft(out_tokens, None, "ngram", chances=chances, parents=parents)

    def _occurrences(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """(the tokens, the start of every earlier occurrence of the longest suffix of n tokens that occurred
        before, oldest first; n, or 0 where none did).

        One pass over the sequence finds where its last token occurred before (an occurrence of any suffix
        ends at one of those); each of them is then extended backwards, up to max_n tokens, only as far as
        it keeps matching. (Comparing every window for each n cost a quarter of a millisecond a round at a
        few hundred tokens: lookups run for every drafting sequence of every step.)"""
        arr = np.asarray(tokens, dtype=np.int64)
        length = len(arr)
        longest = min(self.max_n, length - 1)
        if longest < self.min_n:
            return arr, np.empty(0, dtype=np.int64), 0
        ends = np.flatnonzero(arr[: length - 1] == arr[length - 1])  # where an earlier occurrence could end
        matched = np.ones(len(ends), dtype=np.int64)  # how many tokens back from each end match the suffix's
        for j in range(1, longest):
            alive = np.flatnonzero((matched == j) & (ends >= j))
            if not len(alive):
                break
            matched[alive[arr[ends[alive] - j] == arr[length - 1 - j]]] += 1
        for n in range(longest, self.min_n - 1, -1):
            hits = ends[matched >= n] - (n - 1)
            if len(hits):
                return arr, hits, n
        return arr, np.empty(0, dtype=np.int64), 0


class TokenArray:
    """A growing sequence's tokens as an int64 array, its new tokens copied in at each view: a lookup's pass over
    the whole sequence starts from the array rather than from the list converted whole (about half of an n-gram
    lookup's time at a few hundred tokens). A list shorter than the last one seen is read again."""

    def __init__(self) -> None:
        self._buffer = np.empty(256, dtype=np.int64)
        self._held = 0

    def view(self, tokens: list[int]) -> np.ndarray:
        n = len(tokens)
        if n < self._held:
            self._held = 0
        if n > len(self._buffer):
            grown = np.empty(max(2 * len(self._buffer), n), dtype=np.int64)
            grown[: self._held] = self._buffer[: self._held]
            self._buffer = grown
        if n > self._held:
            self._buffer[self._held : n] = tokens[self._held : n]
            self._held = n
        return self._buffer[:n]


class MatchIndex:
    """A growing sequence's windows of min_n..max_n tokens, each kept (by its tokens: a tuple, or the token for
    one) to where it last ended, so that a lookup costs a dictionary get per window length rather than
    NgramProposer._occurrences' pass over the whole sequence, for every drafting sequence of every step (a
    multi-turn conversation's thousands of tokens). New tokens' windows go in at each match: a
    prompt's all at once (zip and dict.update over the list, in C), then a token or a round's few at a time.
    match() finds what NgramProposer.match finds: the latest earlier occurrence of the longest suffix that
    occurred before. `tokens` only grows between calls (a list shorter than the last is read again)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)
        self.end = 0  # the windows of tokens[:end] are in `ends`
        self.ends: dict[int, dict] = {n: {} for n in self.sizes}  # n -> window -> where it last ended
        self.before: dict[int, int | None] = {}  # n -> where the last window of n ended before, if it occurred

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the latest earlier occurrence of the longest suffix of max_n..min_n
        tokens that occurred before, its length), or ([], 0)."""
        length = len(tokens)
        if length < self.end:
            self.end, self.before = 0, {}
            for ends in self.ends.values():
                ends.clear()
        if length > self.end:
            self._add(tokens, length)
        for n in self.sizes:
            last = self.before.get(n)
            if last is not None:
                return tokens[last : last + k], n
        return [], 0

    def _add(self, tokens: list[int], length: int) -> None:
        """The windows ending at self.end + 1 .. length; the last one's earlier end noted (before) ahead of it."""
        for n in self.sizes:
            ends = self.ends[n]
            first = max(self.end + 1, n)  # the first new window's end
            if first > length:
                self.before[n] = None
                continue
            if first < length:  # the windows before the last (a decode step adds none)
                if n == 1:
                    ends.update(zip(tokens[first - 1 : length - 1], range(first, length)))
                else:
                    ends.update(zip(zip(*(tokens[first - n + i : length - n + i] for i in range(n))), range(first, length)))
            last = tokens[length - 1] if n == 1 else tuple(tokens[length - n : length])
            self.before[n] = ends.get(last)
            ends[last] = length
        self.end = length
