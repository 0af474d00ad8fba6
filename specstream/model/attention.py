"""The one place that depends on transformers' internals.

specstream registers an attention function with transformers' AttentionInterface. Models
are loaded with ``attn_implementation="specstream_packed"`` and called on a packed batch
([1, total_new_tokens]) with per-token position_ids and no cache object. For each layer the
function writes the new keys/values into the KV pool, gathers every sequence's cached
prefix, and attends under a block-diagonal causal mask built once per step (and once per
sliding-window size) and published in a thread-local StepContext. A pool with several
layer groups (kv.py: sliding-window layers keep only their window) has a slot mapping and
key slots per group; a layer reads its own group's.

Everything transformers' attention call carries is honoured: ``scaling``, a per-layer
``sliding_window`` (a query at position p sees keys in (p - window, p], and only those are
gathered), ``softcap`` (tanh soft-capping of the logits, Gemma 2) and ``s_aux`` (per-head
attention sinks, gpt-oss). Soft-capping and sinks cannot go through SDPA, so those layers
compute attention explicitly. Any other argument that could change the result is refused
with UnsupportedAttentionError, which the runner's load-time probe turns into a refusal to
load the model.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specstream.cache import point_inductor_here

# Before transformers' modeling code loads: it asks inductor for its cache directory, which then sticks.
point_inductor_here()

from transformers import AttentionInterface  # noqa: E402

from specstream.memory.kv import KVPool  # noqa: E402
from specstream.model.loader import ModelError  # noqa: E402

ATTN_IMPLEMENTATION = "specstream_packed"
# Arguments transformers passes that do not change what attention computes here.
_INERT_KWARGS = frozenset(
    {"position_ids", "use_cache", "output_router_logits", "output_attentions", "output_hidden_states", "cache_position"}
)


class UnsupportedAttentionError(ModelError):
    """The model asks its attention for something specstream does not implement."""


@dataclass
class KeyView:
    """The keys one kind of layer attends to in this step: all of each sequence's cache, or
    for a sliding-window layer only the last window of it."""

    kv_index: torch.Tensor  # [B, S]: pool slots (columns past a sequence's keys are masked)
    mask: torch.Tensor | None  # [B, 1, T_max, S] bool, True where allowed; None: all allowed


@dataclass
class AttentionGroup:
    """Sequences of a step that attend together, padded to the group's longest query run
    (T_max) and longest context (S_max): B x T_max x S_max, not (all tokens) x (all contexts).
    A step puts its decode and verification runs in one group and its prefill chunks in
    another, so a long chunk never pads every decoding sequence to its length."""

    # [B, S_max] per KV layer group (kv.py): pool slots of each sequence's keys (padding: slot 0, masked)
    kv_indexes: list[torch.Tensor]
    q_index: torch.Tensor  # [B, T_max]: packed row of each sequence's queries (padding: row 0)
    out_index: torch.Tensor  # [n]: row of each of the group's tokens in the flattened [B * T_max] output
    rows: torch.Tensor  # [n]: the packed rows of the group's tokens, in out_index's order
    q_pos: torch.Tensor  # [B, T_max]: position of each query row (padding rows continue past the end)
    # [trees] [B, 1, T_max, S_max]: what each query row sees of a full-context layer's keys, where a
    # sequence's new tokens are a draft tree (each row sees the cached prefix and its own ancestors)
    tree_mask: torch.Tensor | None = None
    views: dict[tuple, KeyView] = field(default_factory=dict)  # by (layer group, window), built on first use

    @property
    def kv_index(self) -> torch.Tensor:
        return self.kv_indexes[0]

    def key_view(self, window: int | None, always_mask: bool, kv_group: int = 0) -> KeyView:
        view = self.views.get((kv_group, window))
        if view is None and self.tree_mask is not None:
            if window is not None:
                raise UnsupportedAttentionError("draft trees need full-context attention (this layer attends a window)")
            view = KeyView(self.kv_indexes[kv_group], self.tree_mask)
            self.views[kv_group, window] = view
        if view is None:
            view = build_key_view(self.kv_indexes[kv_group], self.q_pos, window, always_mask)
            self.views[kv_group, window] = view
        return view


@dataclass
class StepContext:
    """Where a step's tokens go and what they may see."""

    pool: KVPool
    slot_mappings: list[torch.Tensor]  # per KV layer group, [T]: pool slot receiving each new token's key/value
    groups: list[AttentionGroup]
    # 0: one attention call per group over [B, T_max]. n (invariant mode): T_max is a multiple of
    # n and attention runs once per tile of n query rows, always masked, so each query row is
    # computed by the same kernel with the same shape wherever it sits (see runner.py).
    q_tile: int = 0
    windows: dict[int, int | None] | None = None  # when a dict: each layer's window is recorded in it (layer_windows)

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.slot_mappings[0]


def build_key_view(kv_index: torch.Tensor, q_pos: torch.Tensor, window: int | None, always_mask: bool = False) -> KeyView:
    """Causal (and, with a window, sliding-window) key selection for a step.

    Key s is visible to the query at position p when s <= p (and s > p - window). Padding
    keys lie past every real query of their row; padding query rows (output dropped) still
    see at least one key, so no row is empty and none yields NaN."""
    batch, s_max = kv_index.shape
    t_max = q_pos.shape[1]
    if window is None or window >= s_max:
        first = torch.zeros(batch, dtype=torch.long, device=kv_index.device)
        width, index = s_max, kv_index
    else:
        # Only keys from the first query's window on: at most window - 1 + T_max per sequence.
        first = (q_pos[:, 0] - window + 1).clamp(min=0)
        width = min(s_max, window - 1 + t_max)
        cols = first[:, None] + torch.arange(width, device=kv_index.device)
        index = kv_index.gather(1, cols.clamp(max=s_max - 1))
    if batch == 1 and t_max == 1 and not always_mask:
        return KeyView(index, None)  # one query sees every selected key: SDPA takes its fast path
    key_pos = (first[:, None] + torch.arange(width, device=kv_index.device))[:, None, :]  # [B, 1, S]
    mask = key_pos <= q_pos[:, :, None]
    if window is not None:
        mask &= key_pos > q_pos[:, :, None] - window
    return KeyView(index, mask[:, None])


# Steps with at most this many query rows per sequence attend with explicit_attention (two
# matmuls) when the float32 scores stay under _EXPLICIT_MAX_SCORES elements: on CPU, SDPA's
# kernel costs several times more for decode and verification shapes, and no less up to 64 rows;
# long prefill chunks keep SDPA, which never holds all scores at once.
_EXPLICIT_MAX_ROWS = 64
_EXPLICIT_MAX_SCORES = 2**24
# Query runs up to this long (decode, verification) attend in one group, longer ones (prefill chunks) in
# another (runner.py).
SHORT_RUN = 16
# With specstream's CPU kernel, every group of short runs attends through it, eager or compiled, whatever the
# step's batch. Prefill groups attend through it over at most the forward's prefill_keys keys (FastLlama.prefill_keys):
# - where the projections are row-invariant too (a8), over at most KERNEL_MAX_KEYS: a token then attends through the
#   same kernel whether it was decoded, verified, or prefilled in any chunk (a prompt's tail after a prefix-cache
#   hit, a preempted sequence computed again), and the kernel computes a row alone, so its numbers do not depend on
#   the step (kernels/csrc/short_attention.cpp). Longer prefill groups take SDPA, several times faster there than
#   the kernel's paths that score each query alone;
# - over any number of keys where the kernel multiplies bfloat16 pairs from each sequence's keys laid out once for
#   all its queries (cpu.attention_pairs): there it is faster than SDPA for prefill chunks too.
KERNEL_MAX_KEYS = 512

_local = threading.local()


@contextmanager
def step_context(ctx: StepContext):
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield
    finally:
        _local.ctx = previous


def attend(
    ctx: StepContext,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    kernel: bool = False,
    prefill_keys: int = 0,
    kernel_path: int = -1,
) -> torch.Tensor:
    """Write the step's keys/values ([T, kv_heads, d]) into the pool, then attend the queries
    ([1, heads, T, d]) to each sequence's cached prefix (its last `window` keys for a
    sliding-window layer). Returns [1, heads, T, d]. kernel: groups of short query runs attend with
    specstream's CPU kernel (loaded by the caller), as the compiled steps do; so do prefill groups over at most
    prefill_keys keys. kernel_path: the kernel's path argument (cpu.ATTENTION_TREES_ALONE where a tree row must
    round as its path verified as a chain)."""
    pool = ctx.pool
    if ctx.windows is not None:
        ctx.windows[layer] = window
    kv_group = pool.group_of[layer]
    kept = pool.groups[kv_group].window
    if kept is not None and (window is None or window > kept):
        raise UnsupportedAttentionError(
            f"layer {layer} attends {'the whole context' if window is None else f'a {window}-token window'}, "
            f"but the KV pool keeps only the last {kept} positions for it"
        )
    keys, values = pool.keys[layer], pool.values[layer]
    slot_mapping = ctx.slot_mappings[kv_group]
    keys.index_copy_(0, slot_mapping, key)
    values.index_copy_(0, slot_mapping, value)
    args = (query[0], keys, values, scaling, window, softcap, sinks, kv_group, kernel, prefill_keys, kernel_path)
    if len(ctx.groups) == 1:
        return _attend_group(ctx, ctx.groups[0], *args).unsqueeze(0)
    out = query.new_empty(query.shape[1:])
    for group in ctx.groups:
        part = _attend_group(ctx, group, *args)
        out.index_copy_(1, group.rows, part)
    return out.unsqueeze(0)


def _attend_group(
    ctx: StepContext,
    group: AttentionGroup,
    query, keys, values, scaling, window, softcap, sinks, kv_group, kernel, prefill_keys, kernel_path,
):
    """One group's attention: query [heads, T, d] (the whole step's rows); returns [heads, n, d]
    for the group's n tokens, in group.rows order."""
    view = group.key_view(window, bool(ctx.q_tile), kv_group)
    if kernel and softcap is None and sinks is None and not ctx.q_tile and (
        group.q_index.shape[1] <= SHORT_RUN or view.kv_index.shape[1] <= prefill_keys
    ):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = torch.ops.specstream.short_attention(
            query.transpose(0, 1), keys, values, view.kv_index, view.mask, group.q_index, group.out_index, scale, kernel_path
        )
        return out.transpose(0, 1)
    batch, s = view.kv_index.shape
    k, v = gather_keys(keys, values, view.kv_index)
    q = gather_queries(query, group.q_index)
    heads, t_max = q.shape[1], q.shape[2]
    tile = ctx.q_tile or t_max
    parts = []
    for s0 in range(0, t_max, tile):
        mask = None if view.mask is None else view.mask[:, :, s0 : s0 + tile]
        q_part = q[:, :, s0 : s0 + tile]
        rows = q_part.shape[2]
        if softcap is None and sinks is None and not ctx.q_tile and not explicit_pays(batch, heads, rows, s):
            gqa = heads != k.shape[1]
            parts.append(F.scaled_dot_product_attention(q_part, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa))
        else:
            parts.append(explicit_attention(q_part, k, v, mask, scaling, softcap, sinks))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return scatter_rows(out, group.out_index)


def explicit_pays(batch: int, heads: int, rows: int, keys: int) -> bool:
    """Whether explicit_attention beats SDPA for this many query rows per sequence (see above)."""
    return rows <= _EXPLICIT_MAX_ROWS and batch * heads * rows * keys <= _EXPLICIT_MAX_SCORES


def gather_keys(keys: torch.Tensor, values: torch.Tensor, kv_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's cached keys and values from the pool: [B, kv_heads, S, d] each."""
    batch, s = kv_index.shape
    flat = kv_index.reshape(-1)
    k = keys.index_select(0, flat).view(batch, s, *keys.shape[1:]).transpose(1, 2)
    v = values.index_select(0, flat).view(batch, s, *values.shape[1:]).transpose(1, 2)
    return k, v


def gather_queries(query: torch.Tensor, q_index: torch.Tensor) -> torch.Tensor:
    """The step's query rows ([heads, T, d]) laid out per sequence: [B, heads, T_max, d]."""
    heads, _, d = query.shape
    batch, t_max = q_index.shape
    return query.index_select(1, q_index.reshape(-1)).view(heads, batch, t_max, d).transpose(0, 1)


def scatter_rows(out: torch.Tensor, out_index: torch.Tensor) -> torch.Tensor:
    """[B, heads, T_max, d] back to the group's packed rows: [heads, n, d]."""
    batch, heads, t_max, d = out.shape
    return out.transpose(0, 1).reshape(heads, batch * t_max, d).index_select(1, out_index)


def attend_short(
    keys: torch.Tensor,
    values: torch.Tensor,
    slot_mapping: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_index: torch.Tensor,
    mask: torch.Tensor | None,
    q_index: torch.Tensor,
    out_index: torch.Tensor,
    scaling: float,
    kernel: bool = False,
    kernel_path: int = -1,
) -> torch.Tensor:
    """attend() for a step of one group of short query runs (decoding, verification) over full-context
    layers, as a function of tensors alone, so torch.compile can fuse it into a layer (fast_llama.py):
    write the step's keys/values ([T, kv_heads, d]) into the pool's layer tensors, attend the query rows
    ([T, heads, d]); returns [n, heads, d]. kernel: with specstream's CPU kernel, read straight from the
    pool (kernels/cpu.py), kernel_path its path argument; else gathered, with explicit_attention."""
    keys.index_copy_(0, slot_mapping, key)
    values.index_copy_(0, slot_mapping, value)
    if kernel:
        return torch.ops.specstream.short_attention(
            query, keys, values, kv_index, mask, q_index, out_index, scaling, kernel_path
        )
    k, v = gather_keys(keys, values, kv_index)
    out = explicit_attention(gather_queries(query.transpose(0, 1), q_index), k, v, mask, scaling, None, None)
    return scatter_rows(out, out_index).transpose(0, 1)


def explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention as two matmuls and a float32 softmax, with what SDPA cannot express: logits
    soft-capped as softcap * tanh(x / softcap) before masking, and a per-head sink logit that
    joins the softmax's denominator but carries no value. q: [B, heads, T, d]; k, v: [B,
    kv_heads, S, d]; returns [B, heads, T, d]. The heads sharing a key/value head are stacked
    as rows of one matmul (no copy of the keys). Scores are float32 (bf16 inputs are widened),
    as inside SDPA. On CPU this is several times faster than SDPA's kernel for decode and
    verification steps (few query rows), which is why attend() takes it for those."""
    batch, heads, t, d = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    qg = q.reshape(batch, kv_heads, groups * t, d)
    # Gathered keys/values arrive as [B, S, kv_heads, d] transposed: matmul is much slower on that.
    k = k.to(torch.float32, memory_format=torch.contiguous_format)
    scores = torch.matmul(qg.float(), k.transpose(-1, -2))
    scores = scores.mul_(d**-0.5 if scaling is None else scaling).view(batch, kv_heads, groups, t, s)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))  # [B, 1, 1, T, S]
    if sinks is not None:
        sink = sinks.float().view(1, kv_heads, groups, 1, 1).expand(batch, -1, -1, t, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = scores.softmax(dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    out = torch.matmul(probs.to(v.dtype).reshape(batch, kv_heads, groups * t, s), v.contiguous())
    return out.view(batch, heads, t, d)


def current_context() -> StepContext:
    ctx: StepContext | None = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError("a specstream_packed model was called outside the engine's runner")
    return ctx


def packed_attention(
    module,
    query,
    key,
    value,
    attention_mask=None,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    softcap=None,
    s_aux=None,
    **kwargs,
):
    """transformers' attention hook: [1, heads, T, d] tensors in, [1, T, heads, d] out."""
    check_attention_arguments(module, dropout, kwargs)
    # [1, kv_heads, T, d] -> [T, kv_heads, d]
    key, value = key[0].transpose(0, 1), value[0].transpose(0, 1)
    out = attend(current_context(), module.layer_idx, query, key, value, scaling, sliding_window, softcap, s_aux)
    return out.transpose(1, 2).contiguous(), None


def check_attention_arguments(module, dropout: float, kwargs: dict) -> None:
    """Refuse what this function does not implement rather than attend wrongly."""
    unknown = sorted(set(kwargs) - _INERT_KWARGS - {"is_causal"})
    if unknown:
        raise UnsupportedAttentionError(
            f"{type(module).__name__} passes attention argument(s) {', '.join(unknown)}, "
            "which specstream's packed attention does not implement"
        )
    if kwargs.get("is_causal", True) is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedAttentionError(f"{type(module).__name__} uses bidirectional (non-causal) attention")
    if dropout:
        raise UnsupportedAttentionError(f"{type(module).__name__} asks for attention dropout {dropout}")


AttentionInterface.register(ATTN_IMPLEMENTATION, packed_attention)


def model_geometry(config) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim
