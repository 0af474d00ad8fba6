"""Preallocated KV pool.

One key and one value tensor per layer, [num_slots, kv_heads, head_dim], allocated once.
Slots are handed out in blocks; a sequence owns a block table and a length. Its cache for
position p lives in slot table[p // block_size] * block_size + p % block_size, so dropping
rejected drafts is moving the length back, and nothing is ever copied. Blocks are reference
counted (prefix_cache.BlockAllocator): several sequences may share the cached blocks of a
common prefix, and a freed block keeps its content until a new allocation needs it.
"""

from __future__ import annotations

import torch

from specstream.prefix_cache import BlockAllocator


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
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_tokens // block_size
        if self.num_blocks < 1:
            raise ValueError("the KV pool must hold at least one block")
        shape = (self.num_blocks * block_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.device = torch.device(device)
        self.blocks = BlockAllocator(self.num_blocks)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.blocks.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reserve(self, table: list[int], num_tokens: int) -> bool:
        """Grow table to hold num_tokens; all or nothing."""
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.blocks.num_free:
            return False
        for _ in range(need):
            table.append(self.blocks.allocate())
        return True

    def trim(self, table: list[int], num_tokens: int) -> None:
        """Give back the blocks past num_tokens (rejected drafts' space: never a cached block,
        since cached blocks lie wholly below the committed length)."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self.blocks.release(table.pop())

    def free(self, table: list[int]) -> None:
        # Tail first: a prefix's last blocks are the least likely to be shared, so they are
        # the first evicted.
        while table:
            self.blocks.release(table.pop())

    def slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot indices of positions [start, end) of the sequence owning table."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size
