"""Automatic prefix caching: KV blocks of committed tokens, found again by content.

Vocabulary:
- a *full block* holds block_size consecutive positions of one sequence;
- its *digest* is sha256(parent digest | its token ids | ...): chained, so equal digests mean
  equal token prefixes up to the block's end. The chain's root mixes in the request's
  cache_salt, so tenants with different salts never share a block;
- a block is *committed* when every position in it holds the KV of a token the target has
  accepted (never a draft awaiting verification, never a partly filled block).

BlockAllocator (blocks.py) hands out block ids with reference counts. A block whose count drops
to zero keeps its KV and digest on an LRU list until a fresh allocation needs it, so a later
request with the same prefix finds it. PrefixCache ties a sequence to the allocator: on admission it
takes the longest run of cached blocks matching the sequence's tokens (always leaving at
least one token to compute, whose logits the step needs); after each round it publishes the
sequence's newly committed full blocks. Every writer starts past the blocks it shares (the
shared ones are full and lie below its first uncomputed position), so no block is ever
written while cached and nothing needs copy-on-write.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Protocol

from specstream.memory.blocks import NO_BLOCK
from specstream.memory.kv import KVPool


def root_digest(salt: str | None) -> bytes:
    """The parent of a sequence's first block."""
    return hashlib.sha256(b"specstream-prefix-v1\0" + (salt or "").encode()).digest()


def extend_digests(digests: list[bytes], tokens: list[int], block_size: int, salt: str | None, num_blocks: int) -> None:
    """Append the chained digests of blocks len(digests) .. num_blocks-1 of tokens."""
    parent = digests[-1] if digests else root_digest(salt)
    for i in range(len(digests), num_blocks):
        block = array("i", tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(parent + block.tobytes()).digest()
        digests.append(parent)


@dataclass
class PrefixState:
    """A sequence's prefix-cache bookkeeping."""

    digests: list[bytes] = field(default_factory=list)  # chained digests of its full token blocks
    num_published: int = 0  # leading blocks of its target block table already published
    hit_tokens: int | None = None  # prompt tokens found cached at its first admission


class CachedTokens(Protocol):
    """What the prefix cache reads of a sequence (engine.sequence.Sequence is one)."""

    token_ids: list[int]
    num_prompt_tokens: int
    prefix: PrefixState

    @property
    def cache_salt(self) -> str | None: ...


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at first admission
    hits: int = 0  # of those, tokens whose KV was found cached


class PrefixCache:
    """The prefix cache of one KV pool (the target's, or a draft model's). Digests depend only
    on tokens and salt, so both pools use the one list a sequence carries.

    With several layer groups (kv.py), each group's blocks are cached under the digest and the
    group's index. A hit of n blocks needs every full-attention group's blocks 0..n-1 and every
    windowed group's blocks from the first one the position n * block_size reads (earlier ones
    the window has left behind are not needed)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.blocks = pool.blocks
        self.block_size = pool.block_size
        self.stats = PrefixCacheStats()

    def _digests(self, seq: CachedTokens, num_blocks: int) -> list[bytes]:
        digests = seq.prefix.digests
        extend_digests(digests, seq.token_ids, self.block_size, seq.cache_salt, num_blocks)
        return digests

    @staticmethod
    def _key(group: int, digest: bytes):
        return digest if group == 0 else (group, digest)

    def acquire(self, table: list[int], seq: CachedTokens) -> int:
        """Seed an empty block table with the longest cached run of seq's full blocks, leaving
        at least its last token uncomputed. Returns the number of positions found cached."""
        tables = self.pool.tables(table)
        if any(tables):
            raise ValueError("only an empty block table takes cached blocks")
        digests = self._digests(seq, (len(seq.token_ids) - 1) // self.block_size)
        found = [[self.blocks.lookup(self._key(g, d)) for d in digests] for g in range(len(tables))]
        n = self._longest_hit(found)
        for g, blocks in enumerate(tables):
            first = min(self.pool.first_kept(g, n * self.block_size), n)
            blocks.extend([NO_BLOCK] * first)
            for block in found[g][first:n]:
                self.blocks.share(block)
                blocks.append(block)
        return n * self.block_size

    def _longest_hit(self, found: list[list[int | None]]) -> int:
        """The most leading blocks n that every group holds cached as a hit of n needs."""
        n = len(found[0])
        for g, group in enumerate(found):
            if self.pool.groups[g].window is None:
                n = min(n, next((i for i, b in enumerate(group) if b is None), n))
        while n > 0 and not all(
            None not in group[self.pool.first_kept(g, n * self.block_size) : n] for g, group in enumerate(found)
        ):
            n -= 1
        return n

    def publish(self, table: list[int], seq: CachedTokens, num_committed: int, start: int) -> int:
        """Publish blocks start.. of table that lie wholly below num_committed positions, whose
        KV holds seq.token_ids[:num_committed]. Returns how many leading blocks are published."""
        end = min(num_committed, len(seq.token_ids)) // self.block_size
        digests = self._digests(seq, end)
        for g, blocks in enumerate(self.pool.tables(table)):
            for i in range(start, min(end, len(blocks))):
                if blocks[i] != NO_BLOCK:
                    self.blocks.publish(blocks[i], self._key(g, digests[i]))
        return max(start, end)

    def record_admission(self, seq: CachedTokens, hit: int) -> None:
        """Count seq's first admission; a re-admission after preemption is no new query."""
        if seq.prefix.hit_tokens is None:
            seq.prefix.hit_tokens = hit
            self.stats.queries += seq.num_prompt_tokens
            self.stats.hits += hit
