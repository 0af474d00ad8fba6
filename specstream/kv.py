"""Preallocated KV pool.

One key and one value tensor per layer, [num_slots, kv_heads, head_dim], allocated once.
Slots are handed out in blocks; a sequence owns a block table and a length. Its cache for
position p lives in slot table[p // block_size] * block_size + p % block_size, so dropping
rejected drafts is moving the length back, and nothing is ever copied.
"""

from __future__ import annotations

from collections import deque

import torch


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
        self._free: deque[int] = deque(range(self.num_blocks))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reserve(self, table: list[int], num_tokens: int) -> bool:
        """Grow table to hold num_tokens; all or nothing."""
        need = self.blocks_for(num_tokens) - len(table)
        if need > len(self._free):
            return False
        for _ in range(need):
            table.append(self._free.popleft())
        return True

    def trim(self, table: list[int], num_tokens: int) -> None:
        """Give back the blocks past num_tokens (rejected drafts' space)."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._free.appendleft(table.pop())

    def free(self, table: list[int]) -> None:
        self._free.extend(table)
        table.clear()

    def slots(self, table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot indices of positions [start, end) of the sequence owning table."""
        pos = torch.arange(start, end)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size
