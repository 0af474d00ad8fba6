"""Block ids with reference counts, shared by the KV pool (kv.py) and its prefix cache.

A block whose count drops to zero keeps its content and digest on an LRU list until a fresh
allocation needs it, so the prefix cache (prefix_cache.py) can find it again by digest.
"""

from __future__ import annotations

from collections import OrderedDict, deque

NO_BLOCK = -1  # a table entry for a block a windowed layer group left behind (kv.py)


class BlockAllocator:
    """Block ids with reference counts; free blocks that hold a cached digest are evicted
    least recently used first, and only when no never-cached free block is left."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.digest_of: list[bytes | None] = [None] * num_blocks
        self._by_digest: dict[bytes, int] = {}
        self._plain: deque[int] = deque(range(num_blocks))  # free, holding nothing worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free, cached; oldest first

    @property
    def num_free(self) -> int:
        return len(self._plain) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._by_digest)

    def allocate(self) -> int:
        if self._plain:
            block = self._plain.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._by_digest[self.digest_of[block]]
            self.digest_of[block] = None
        self.refs[block] = 1
        return block

    def lookup(self, digest: bytes) -> int | None:
        return self._by_digest.get(digest)

    def share(self, block: int) -> None:
        """Take one more reference on a cached block (possibly a free one)."""
        if self.refs[block] == 0:
            del self._evictable[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        if self.refs[block] <= 0:
            raise RuntimeError(f"KV block {block} released more often than it was taken")
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.digest_of[block] is None:
                self._plain.append(block)
            else:
                self._evictable[block] = None

    def publish(self, block: int, digest: bytes) -> None:
        """Make a held, fully written block findable by digest. A block already cached, or a
        digest another block already serves (two requests computed the same prefix at once),
        is left as it is."""
        if self.digest_of[block] is None and digest not in self._by_digest:
            self.digest_of[block] = digest
            self._by_digest[digest] = block
