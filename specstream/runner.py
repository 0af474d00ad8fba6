"""One packed forward over many sequences.

Each sequence contributes its own number of new tokens (a prefill chunk, or its last token
plus its drafts). The tokens are concatenated into one [1, T] batch, nothing is padded, and
each sequence attends only to its own prefix in the KV pool (see attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specstream.attention import StepContext, step_context
from specstream.kv import KVPool


@dataclass
class ForwardItem:
    table: list[int]  # the sequence's block table (already reserved for start + len(tokens))
    start: int  # positions already in the cache
    tokens: list[int]  # new tokens, fed at positions start, start + 1, ...
    num_logits: int  # logits wanted for the last num_logits new tokens


class ModelRunner:
    def __init__(self, model, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> torch.Tensor:
        """Run the model; return float32 logits [sum(num_logits), vocab] in item order."""
        pool = self.pool
        input_ids: list[int] = []
        positions, slot_maps, kv_slots, tok_seq, kv_seq, keep = [], [], [], [], [], []
        offset = 0
        for i, item in enumerate(items):
            n, end = len(item.tokens), item.start + len(item.tokens)
            input_ids.extend(item.tokens)
            positions.append(torch.arange(item.start, end))
            all_slots = pool.slots(item.table, 0, end)
            slot_maps.append(all_slots[item.start :])
            kv_slots.append(all_slots)
            tok_seq.append(torch.full((n,), i))
            kv_seq.append(torch.full((end,), i))
            if item.num_logits:
                keep.append(torch.arange(offset + n - item.num_logits, offset + n))
            offset += n
        pos = torch.cat(positions)
        kv_pos = torch.cat([torch.arange(len(s)) for s in kv_slots])
        dev = self.device
        if len(input_ids) == 1:
            mask = None  # one query sees every key: no mask lets attention take its fast path
        else:
            mask = (torch.cat(tok_seq)[:, None] == torch.cat(kv_seq)[None, :]) & (kv_pos[None, :] <= pos[:, None])
            mask = mask[None, None].to(dev)
        ctx = StepContext(
            pool=pool,
            slot_mapping=torch.cat(slot_maps).to(dev),
            kv_index=torch.cat(kv_slots).to(dev),
            mask=mask,
        )
        keep_idx = torch.cat(keep).to(dev) if keep else torch.zeros(0, dtype=torch.long, device=dev)
        with step_context(ctx):
            out = self.model(
                input_ids=torch.tensor([input_ids], device=dev),
                position_ids=pos[None].to(dev),
                use_cache=False,
                logits_to_keep=keep_idx,
            )
        return out.logits[0].float()
