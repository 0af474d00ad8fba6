"""Preallocated KV pool.

Slots are handed out in blocks of block_size positions; a sequence owns a block table and a
length. Its cache for position p lives in slot table[p // block_size] * block_size +
p % block_size, so dropping rejected drafts is moving the length back, and nothing is ever
copied. Blocks are reference counted (blocks.BlockAllocator): several sequences may
share the cached blocks of a common prefix, and a freed block keeps its content until a new
allocation needs it.

Layer groups (sliding windows). A layer that attends only to the last `window` keys never
needs the KV of older positions, so its memory can be handed back as the window moves. The
pool splits the model's layers into groups of equal size `width`, each group's layers sharing
one window (None: the whole context); full-attention layers come first, so group 0 is a
full-attention group whenever the model has one. Every block holds `width` layers' KV, one
per layer slot, and blocks come from one allocator; a group's layer i writes to layer slot i
of the blocks in that group's table. A sequence has one table per group (BlockTable: the
list itself is group 0's, `groups` the others'). A windowed group's table drops (to NO_BLOCK)
the blocks that lie wholly before the window of the next position to be fed, so a sequence
holds at most about (window + step) / block_size blocks there, whatever its length. Gemma 3
(5 windowed layers to 1 full) keeps about a sixth of the KV a whole-context pool would at
long contexts. A model without windows has one group of all its layers: the pool is then
exactly a plain one, and a plain list serves as its block table.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from specstream.memory.blocks import NO_BLOCK, BlockAllocator

UNBOUNDED = 2**40  # the capacity of a pool whose every layer is windowed


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros that take memory as they are first written. On CPU the bytes are an anonymous mapping of their
    own, fresh pages the kernel zero-fills on first touch: a pool sized for many long sequences holds
    resident only the blocks that sequences have used. (Not calloc: it may reuse a freed heap chunk whose
    pages were handed back, memory/heap.py, and must then write zeros over all of it.) Elsewhere, plain
    zeros."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    raw = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)  # the array keeps the mapping alive
    return torch.from_numpy(raw).view(dtype).view(shape)


@dataclass(frozen=True)
class LayerGroup:
    window: int | None  # keys a query sees (None: all of them)
    layers: tuple[int, ...]  # model layers; layers[i] uses the blocks' layer slot i


def plan_groups(windows: list[int | None]) -> tuple[list[LayerGroup], int]:
    """Split layers by window into groups of one size (the fewest layers any window has; a
    window's last group may be short, its missing slots unused): (groups, width). Full-attention
    groups first."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    width = min(len(layers) for layers in by_window.values())
    groups = []
    for window in sorted(by_window, key=lambda w: (w is not None, w or 0)):
        layers = by_window[window]
        groups += [LayerGroup(window, tuple(layers[i : i + width])) for i in range(0, len(layers), width)]
    return groups, width


class BlockTable(list):
    """A sequence's blocks: the list itself is layer group 0's table; `groups` holds the other
    groups' tables (filled in by the pool on first use)."""

    __slots__ = ("groups",)

    def __init__(self, blocks=()) -> None:
        super().__init__(blocks)
        self.groups: list[list[int]] = []


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_tokens: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        windows: list[int | None] | None = None,
    ) -> None:
        """num_tokens: the memory, in positions of all num_layers layers. windows: each layer's
        sliding window (None, or no list: the whole context)."""
        self.block_size = block_size
        self.groups, self.width = plan_groups(windows or [None] * num_layers)
        self.num_blocks = num_tokens * num_layers // (self.width * block_size)
        if self.num_blocks < 1:
            raise ValueError("the KV pool must hold at least one block")
        shape = (self.num_blocks * block_size, num_kv_heads, head_dim)
        slot_keys = [untouched_zeros(shape, dtype, device) for _ in range(self.width)]
        slot_values = [untouched_zeros(shape, dtype, device) for _ in range(self.width)]
        self.keys: list[torch.Tensor] = [slot_keys[0]] * num_layers  # by model layer
        self.values: list[torch.Tensor] = [slot_values[0]] * num_layers
        self.group_of = [0] * num_layers
        for g, group in enumerate(self.groups):
            for i, layer in enumerate(group.layers):
                self.keys[layer], self.values[layer] = slot_keys[i], slot_values[i]
                self.group_of[layer] = g
        self.device = torch.device(device)
        self.blocks = BlockAllocator(self.num_blocks)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def windowed(self) -> bool:
        return any(g.window is not None for g in self.groups)

    def window_blocks(self, window: int) -> int:
        """The fewest blocks a sequence needs in a group of this window to go on: one position's
        window at any alignment (a longer step needs more; the scheduler's chunks and drafts shrink
        to the room there is)."""
        return self.blocks_for(window) + 1

    @property
    def capacity(self) -> int:
        """The longest sequence that fits alone (with a windowed group only: no bound but the
        allocator's size)."""
        full = sum(g.window is None for g in self.groups)
        spare = self.num_blocks - sum(self.window_blocks(g.window) for g in self.groups if g.window is not None)
        if spare < 0:
            return 0
        return UNBOUNDED if not full else spare // full * self.block_size

    def describe(self) -> str:
        """The pool's layout, for the start-up log."""
        if not self.windowed:
            return f"{self.capacity} tokens"
        kinds: dict[int | None, int] = {}
        for g in self.groups:
            kinds[g.window] = kinds.get(g.window, 0) + len(g.layers)
        layers = ", ".join(f"{n} {'full' if w is None else f'{w}-window'}" for w, n in kinds.items())
        longest = "any length" if self.capacity >= UNBOUNDED else f"{self.capacity} tokens"
        return f"{self.num_blocks} blocks of {self.block_size} positions x {self.width} layers ({layers} layers); one sequence: {longest}"

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.blocks.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def tables(self, table: list[int]) -> list[list[int]]:
        """The per-group tables of a sequence (group 0's is table itself)."""
        if len(self.groups) == 1:
            return [table]
        if not isinstance(table, BlockTable):
            raise TypeError("a KV pool with several layer groups needs a BlockTable (pool.new_table())")
        if not table.groups:
            table.groups = [[] for _ in self.groups[1:]]
        return [table, *table.groups]

    def new_table(self) -> BlockTable:
        return BlockTable()

    def first_kept(self, group: int, start: int) -> int:
        """The first block of `group` that queries from position `start` on may read."""
        window = self.groups[group].window
        return 0 if window is None else max(start - window + 1, 0) // self.block_size

    def _drop_behind(self, group: int, blocks: list[int], start: int) -> None:
        """Hand back a windowed group's blocks that no query from `start` on reads. The dropped
        entries are a leading run, so the scan stops at the first one already dropped."""
        i = min(self.first_kept(group, start), len(blocks)) - 1
        while i >= 0 and blocks[i] != NO_BLOCK:
            self.blocks.release(blocks[i])
            blocks[i] = NO_BLOCK
            i -= 1

    def _reach(self, group: int, blocks: list[int], start: int) -> int:
        """Blocks of a group's table that need no allocation (held, or behind the window)."""
        return max(len(blocks), self.first_kept(group, start))

    def reserve(self, table: list[int], num_tokens: int, start: int = 0) -> bool:
        """Grow table to hold num_tokens positions for a step that feeds positions from `start`
        on; all or nothing. A windowed group first hands back what no query from `start` on reads
        (start = 0: nothing)."""
        tables = self.tables(table)
        want = self.blocks_for(num_tokens)
        for g, blocks in enumerate(tables):
            self._drop_behind(g, blocks, start)
        need = sum(max(want - self._reach(g, b, start), 0) for g, b in enumerate(tables))
        if need > self.blocks.num_free:
            return False
        for g, blocks in enumerate(tables):
            reach = self._reach(g, blocks, start)
            blocks.extend([NO_BLOCK] * (min(reach, want) - len(blocks)))
            blocks.extend(self.blocks.allocate() for _ in range(want - len(blocks)))
        return True

    def room(self, table: list[int], start: int, keep_free: int = 0) -> int:
        """The most positions reserve(table, n, start) can hold now, leaving keep_free blocks free
        (never less than the table holds already)."""
        tables = self.tables(table)
        behind = 0
        for g, blocks in enumerate(tables):
            kept = min(self.first_kept(g, start), len(blocks))
            behind += sum(b != NO_BLOCK for b in blocks[:kept])
        free = max(self.blocks.num_free + behind - keep_free, 0)
        reach = [self._reach(g, b, start) for g, b in enumerate(tables)]
        lo, hi = len(table), max(reach) + free + 1
        while hi - lo > 1:  # the most blocks n with sum(max(n - reach, 0)) <= free
            mid = (lo + hi) // 2
            if sum(max(mid - r, 0) for r in reach) <= free:
                lo = mid
            else:
                hi = mid
        return lo * self.block_size

    def trim(self, table: list[int], num_tokens: int) -> None:
        """Give back the blocks past num_tokens (rejected drafts' space: never a cached block,
        since cached blocks lie wholly below the committed length)."""
        keep = self.blocks_for(num_tokens)
        for blocks in self.tables(table):
            while len(blocks) > keep:
                block = blocks.pop()
                if block != NO_BLOCK:
                    self.blocks.release(block)

    def free(self, table: list[int]) -> None:
        # Tail first: a prefix's last blocks are the least likely to be shared, so they are
        # the first evicted.
        for blocks in self.tables(table):
            while blocks:
                block = blocks.pop()
                if block != NO_BLOCK:
                    self.blocks.release(block)

    def move(self, table: list[int], src: list[int], dst: list[int]) -> None:
        """Copy the KV of positions src to positions dst of the sequence owning table, in every layer (an
        accepted path of a draft tree into the positions that follow the prefix). All sources are read
        before any destination is written."""
        if not src:
            return
        end = max(max(src), max(dst)) + 1
        for g, group in enumerate(self.groups):
            slots = self.slots(table, 0, end, g)
            s, d = slots[src].to(self.device), slots[dst].to(self.device)
            for layer in group.layers:
                for cache in (self.keys[layer], self.values[layer]):
                    cache.index_copy_(0, d, cache.index_select(0, s))

    def slots(self, table: list[int], start: int, end: int, group: int = 0) -> torch.Tensor:
        """Slot indices of positions [start, end) of the sequence owning table, in `group`'s
        blocks. Positions a windowed group dropped map to slot 0: no query reads them."""
        return torch.from_numpy(self.slot_array(table, start, end, group))

    def slot_array(self, table: list[int], start: int, end: int, group: int = 0) -> np.ndarray:
        """slots() as a NumPy int64 array: a step packs every sequence's slots (runner.pack), and a handful of
        small torch ops a sequence cost more than the NumPy ones."""
        blocks = self.tables(table)[group] if group else table
        size = self.block_size
        first, last = start // size, -(-end // size)  # the blocks holding [start, end)
        if last > len(blocks):
            raise IndexError(f"positions up to {end} need {last} blocks; the table holds {len(blocks)}")
        ids = np.maximum(np.asarray(blocks[first:last], dtype=np.int64), 0)
        return (ids[:, None] * size + np.arange(size, dtype=np.int64)).ravel()[start - first * size : end - first * size]
