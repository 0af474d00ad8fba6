"""The one place that depends on transformers' internals.

specstream registers an attention function with transformers' AttentionInterface. Models
are loaded with ``attn_implementation="specstream_packed"`` and called on a packed batch
([1, total_new_tokens]) with per-token position_ids and no cache object. For each layer the
function writes the new keys/values into the KV pool, gathers every sequence's cached
prefix, and attends under a block-diagonal causal mask that the runner built once for the
step and published in a thread-local StepContext.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from specstream.kv import KVPool

ATTN_IMPLEMENTATION = "specstream_packed"


@dataclass
class StepContext:
    pool: KVPool
    slot_mapping: torch.Tensor  # [T]: pool slot receiving each new token's key/value
    kv_index: torch.Tensor  # [S]: pool slots of every key a query of this step may see
    mask: torch.Tensor | None  # [1, 1, T, S] bool: True where query t may attend key s; None: all


_local = threading.local()


@contextmanager
def step_context(ctx: StepContext):
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield
    finally:
        _local.ctx = previous


def packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    ctx: StepContext | None = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("a specstream_packed model was called outside the engine's runner")
    layer = module.layer_idx
    keys, values = ctx.pool.keys[layer], ctx.pool.values[layer]
    # [1, kv_heads, T, d] -> [T, kv_heads, d]
    keys.index_copy_(0, ctx.slot_mapping, key[0].transpose(0, 1))
    values.index_copy_(0, ctx.slot_mapping, value[0].transpose(0, 1))
    k = keys.index_select(0, ctx.kv_index).transpose(0, 1).unsqueeze(0)
    v = values.index_select(0, ctx.kv_index).transpose(0, 1).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        query, k, v, attn_mask=ctx.mask, scale=scaling, enable_gqa=query.shape[1] != k.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention)


def model_geometry(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim
