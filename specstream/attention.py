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
    """Where a step's tokens go and what they may see. Attention runs per sequence, padded
    to the step's longest query run (T_max) and longest context (S_max): B x T_max x S_max,
    not (all tokens) x (all contexts)."""

    pool: KVPool
    slot_mapping: torch.Tensor  # [T]: pool slot receiving each new token's key/value
    kv_index: torch.Tensor  # [B, S_max]: pool slots of each sequence's keys (padding: slot 0, masked)
    q_index: torch.Tensor  # [B, T_max]: packed row of each sequence's queries (padding: row 0)
    out_index: torch.Tensor  # [T]: row of each packed token in the flattened [B * T_max] output
    mask: torch.Tensor | None  # [B, 1, T_max, S_max] bool, True where allowed; None: all allowed


_local = threading.local()


@contextmanager
def step_context(ctx: StepContext):
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield
    finally:
        _local.ctx = previous


def attend(ctx: StepContext, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Write the step's keys/values ([T, kv_heads, d]) into the pool, then attend the queries
    ([1, heads, T, d]) to each sequence's cached prefix. Returns [1, heads, T, d]."""
    keys, values = ctx.pool.keys[layer], ctx.pool.values[layer]
    keys.index_copy_(0, ctx.slot_mapping, key)
    values.index_copy_(0, ctx.slot_mapping, value)
    batch, s_max = ctx.kv_index.shape
    t_max = ctx.q_index.shape[1]
    flat = ctx.kv_index.reshape(-1)
    k = keys.index_select(0, flat).view(batch, s_max, *keys.shape[1:]).transpose(1, 2)  # [B, kv_heads, S_max, d]
    v = values.index_select(0, flat).view(batch, s_max, *values.shape[1:]).transpose(1, 2)
    heads, _, d = query.shape[1:]
    q = query[0].index_select(1, ctx.q_index.reshape(-1)).view(heads, batch, t_max, d).transpose(0, 1)  # [B, heads, T_max, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask, scale=scaling, enable_gqa=heads != k.shape[1])
    out = out.transpose(0, 1).reshape(heads, batch * t_max, d).index_select(1, ctx.out_index)
    return out.unsqueeze(0)


def current_context() -> StepContext:
    ctx: StepContext | None = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("a specstream_packed model was called outside the engine's runner")
    return ctx


def packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention hook: [1, heads, T, d] tensors in, [1, T, heads, d] out."""
    # [1, kv_heads, T, d] -> [T, kv_heads, d]
    out = attend(current_context(), module.layer_idx, query, key[0].transpose(0, 1), value[0].transpose(0, 1), scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention)


def model_geometry(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim
