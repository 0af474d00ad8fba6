"""A lean forward for Llama-architecture decoders (Llama, SmolLM2, ... with plain RoPE).

Same weights and the same math as transformers' LlamaModel, without its per-module Python
machinery, and with q/k/v and gate/up each fused into one matmul (the fused weights are
views shared with the model's own parameters, so memory is not duplicated). Each projection
is a callable made by `linear(names, weight)`: F.linear on the weight by default, or
kernels/quant.py's packed low-bit weights. On CPU the step of a small model is dominated by this
overhead, so the packed forward takes it when the model qualifies and falls back to the
transformers modules (through the registered attention function) otherwise. Short steps
(decoding, verification) can run one torch.compile'd layer per layer instead (compile()).
Depends on the layout of transformers' Llama modules; this file and attention.py are the only
ones that do.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

from specstream.model.attention import KERNEL_MAX_KEYS, StepContext, attend, attend_short
from specstream.kernels import cpu as cpu_kernels
from specstream.kernels.quant import Linear, project

log = logging.getLogger("specstream.model.fast_llama")


def supports(model) -> bool:
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    return (
        getattr(cfg, "model_type", None) == "llama"
        and rope.get("rope_type", "default") == "default"
        and getattr(cfg, "hidden_act", "silu") == "silu"
        and not getattr(cfg, "attention_bias", False)
        and not getattr(cfg, "mlp_bias", False)
        and getattr(cfg, "pretraining_tp", 1) == 1
    )


def _fuse(linears: list[torch.nn.Linear]) -> torch.Tensor:
    """One weight for several projections; each module's weight becomes a view of it."""
    fused = torch.cat([lin.weight.data for lin in linears], dim=0)
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start : start + rows]
        start += rows
    return fused


def _widened(weight: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A norm's weight in the residual stream's dtype (a copy where it widens; else the parameter itself)."""
    return weight.detach().to(dtype) if dtype is not None else weight.detach()


Projection = Callable[[torch.Tensor], torch.Tensor]
# The longest query run per sequence, and the most rows in a step, that take the compiled layer (fewer where a
# projection's route sends more rows to its dense copy: CompiledSteps.rows; on AMX tiles the layers' routes run to
# COMPILED_MAX_ROWS at least, EngineBuilder.packed_floors). Steps of 17-64 rows are batches of
# verifications (8 streams with 2 drafts each: 24 rows), which run faster compiled than eager (docs/MEASUREMENTS.md, "Steps of
# more than 16 rows now compiled").
COMPILED_MAX_RUN = 16
COMPILED_MAX_ROWS = 64
# A short step runs every layer in one compiled call (compile's whole_steps): each call of a compiled function
# costs dispatch (guards, wrappers), so one call instead of one per layer saves a share of a decode step
# that grows with the layer count. Such a graph is slow to trace (dynamo) and to build (inductor), so every
# kind of short step (KINDS) runs a function compiled ahead of time (torch's aot_compile) and kept on
# disk (kept_dir): only the first start on a machine builds them, and a restart loads them, tracing
# nothing. Without them (whole_steps off, or where building fails) a step takes torch.compile'd calls
# of compile's layers_per_graph layers each (at most; a divisor of the layer count).
KINDS = ("decode", "verify", "batch-decode", "batch-verify")


def dense_linear(names: list[str], weight: torch.Tensor) -> Linear:
    return Linear(names, weight)


def _call(projection: Projection, x: torch.Tensor) -> torch.Tensor:
    return projection(x)


@dataclass(frozen=True)
class LayerMath:
    """A decoder layer's arithmetic, given its weights: sizes and constants only, no tensors. The
    compiled layer is a function of this object and tensors, so it pickles small (_build_kept)
    and a compiled graph depends on nothing but what its guards check."""

    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    inter: int
    # Short query runs attend with specstream's CPU kernel (kernels/cpu.py) rather than torch's ops, in the
    # compiled steps and the eager forward alike (attention.SHORT_RUN).
    attention_kernel: bool = False
    # The kernel's path argument: -1, or cpu.ATTENTION_TREES_ALONE where a tree row must get the bits of its path
    # verified as a chain (invariant mode untiled, a8): the kernel then lays such a row's keys side by side.
    attention_path: int = -1
    # Norms run specstream's rms_norm kernel (one summation order, eager and compiled alike) rather than
    # torch's ops, whose eager and generated reductions order a row's sum differently.
    norm_kernel: bool = False
    # Where the residual stream is wider than the weights (float32 under bf16: FastLlama's stream_dtype), the
    # dtype q, k and v are cast to for attention and the KV cache; None: the stream's own.
    kv_dtype: torch.dtype | None = None

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.norm_kernel and weight.dtype == x.dtype:
            return torch.ops.specstream.rms_norm(x, weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def qkv(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, proj=_call):
        """Rows in, rotated q [n, heads, d] and k, v [n, kv_heads, d] out: what attention reads.
        proj(layer's projection, x) applies a projection (a Linear, or in the compiled layer a Kernel)."""
        w_in, w_qkv = layer[0], layer[1]
        n = x.shape[0]
        q, k, v = proj(w_qkv, self.rms(x, w_in)).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = self.rotate(q.view(n, self.heads, self.head_dim), cos, sin)
        k = self.rotate(k.view(n, self.kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.kv_heads, self.head_dim)
        if self.kv_dtype is not None:
            q, k, v = q.to(self.kv_dtype), k.to(self.kv_dtype), v.to(self.kv_dtype)
        return q, k, v

    def block_out(self, layer, x: torch.Tensor, attn: torch.Tensor, proj=_call) -> torch.Tensor:
        """The rest of a decoder layer, row by row: output projection, residual, MLP, residual."""
        _, _, w_o, w_post, w_gate_up, w_down = layer
        x = x + proj(w_o, attn)
        gate, up = proj(w_gate_up, self.rms(x, w_post)).split((self.inter, self.inter), dim=-1)
        return x + proj(w_down, F.silu(gate) * up)

    def short_layers(self, x, cos, sin, slot_mapping, kv_index, mask, q_index, out_index, layers: tuple) -> tuple:
        """Consecutive decoder layers of a short step (layers: (keys, values, weights) of each); returns
        the residual stream after each, so a draft head can read the ones it needs."""
        outs = []
        for keys, values, layer in layers:
            x = self.short_layer(x, cos, sin, keys, values, slot_mapping, kv_index, mask, q_index, out_index, layer)
            outs.append(x)
        return tuple(outs)

    def short_layer(
        self, x, cos, sin, keys, values, slot_mapping, kv_index, mask, q_index, out_index, layer: tuple
    ) -> torch.Tensor:
        """One decoder layer of a short step, as a function of tensors (what compile() traces)."""
        n = x.shape[0]
        q, k, v = self.qkv(layer, x, cos, sin, project)
        out = attend_short(
            keys, values, slot_mapping, q, k, v, kv_index, mask, q_index, out_index, self.scaling, self.attention_kernel,
            self.attention_path,
        )
        return self.block_out(layer, x, out.reshape(n, self.q_size), project)


class FastLlama:
    """stream_dtype: the residual stream's dtype where it should be wider than the weights' (float32 under
    bf16 weights: what `a8` runs, see EngineBuilder.stream_dtype); the norms then run in it and feed the projections
    unrounded, and q, k, v are rounded to the weights' dtype for attention and the KV cache. None: the
    weights' dtype throughout."""

    def __init__(
        self,
        model,
        linear: Callable[[list[str], torch.Tensor], Projection] = dense_linear,
        tile: int = 0,
        stream_dtype: torch.dtype | None = None,
    ) -> None:
        cfg = model.config
        self.tile = tile  # 0: each op over the whole step; n: row-wise ops in fixed tiles of n rows
        base = model.model
        self.embed = base.embed_tokens.weight
        self.stream_dtype = stream_dtype if stream_dtype not in (None, self.embed.dtype) else None
        wide = self.stream_dtype
        self.norm = _widened(base.norm.weight, wide)
        self.lm_head = linear(["lm_head.weight"], model.lm_head.weight.data)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kernels = self.embed.device.type == "cpu" and cpu_kernels.load()
        self.math = LayerMath(
            cfg.rms_norm_eps,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            head_dim,
            head_dim**-0.5,
            cfg.intermediate_size,
            # not in invariant mode, whose attention runs in fixed tiles of torch's ops (runner.py)
            attention_kernel=kernels and not tile and cpu_kernels.fits_head(head_dim),
            norm_kernel=kernels,
            kv_dtype=self.embed.dtype if wide else None,
        )
        self.inv_freq = base.rotary_emb.inv_freq.float()
        self.rope_scale = float(getattr(base.rotary_emb, "attention_scaling", 1.0))
        self.layers = []
        for i, layer in enumerate(base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            name = f"model.layers.{i}.{{}}.weight".format
            qkv, gate_up = [attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]
            self.layers.append(
                (
                    _widened(layer.input_layernorm.weight, wide),
                    linear([name(f"self_attn.{p}_proj") for p in "qkv"], _fuse(qkv)),
                    linear([name("self_attn.o_proj")], attn.o_proj.weight.data),
                    _widened(layer.post_attention_layernorm.weight, wide),
                    linear([name("mlp.gate_proj"), name("mlp.up_proj")], _fuse(gate_up)),
                    linear([name("mlp.down_proj")], mlp.down_proj.weight.data),
                )
            )
        # The most keys a prefill chunk attends through the decoding kernel over (see routes_settled).
        self.prefill_keys = 0
        # The compiled short steps (compiled_steps.CompiledSteps), installed whole once built and warmed up;
        # None: every step runs eager. A thread warming up steps not yet installed sees them through
        # _local (warming()), every other thread sees `steps`.
        self.steps = None
        self._local = threading.local()

    def layer_projections(self) -> list[Projection]:
        """Every decoder layer's projections (q/k/v, o, gate/up, down), layer by layer: the ones the compiled steps run."""
        return [lin for layer in self.layers for lin in (layer[1], layer[2], layer[4], layer[5])]

    def untile_rows(self) -> bool:
        """Invariant mode (runner.py) without padding the row-wise work, where it can: when every projection
        computes each row alone at any row count (Linear.rows_alone: specstream's block kernels) and the norms
        run the rms_norm kernel (one summation order per row), the row-wise ops (norms, projections, rotary,
        MLP, LM head) give a row the same bits in any step without tiles, as the remaining ops act per element.
        Attention keeps its tiles (the runner's). A one-row decode step then computes one row, not a tile.
        Returns whether the tiles went; False leaves them (a dense GEMM serves some projection)."""
        projections = [self.lm_head, *self.layer_projections()]
        if not self.tile or not self.math.norm_kernel or not all(isinstance(lin, Linear) for lin in projections):
            return False
        if not all([lin.rows_alone() for lin in projections]):
            return False
        self.tile = 0
        return True

    def attend_alone(self) -> bool:
        """After untile_rows: whether attention can drop its tiles too, and if so attend every group, prefill
        chunks of any length included, through specstream's kernel, which computes a query row alone and sums
        its keys alike whatever the step spans. Only where it multiplies bfloat16 pairs from each sequence's keys
        laid out once (cpu.attention_pairs): elsewhere its prefill paths are too slow to take every chunk."""
        if self.tile or not cpu_kernels.attention_pairs(self.embed.dtype, self.math.head_dim):
            return False
        self.math = replace(self.math, attention_kernel=True, attention_path=cpu_kernels.ATTENTION_TREES_ALONE)
        self.routes_settled()  # where the kernel pairs bfloat16, every prefill chunk takes it
        return True

    def routes_settled(self) -> None:
        """Called once the projections' routes are settled (kernels/routes.py): which prefill chunks attend through
        the decoding kernel (attention.KERNEL_MAX_KEYS has why). Where the kernel multiplies bfloat16 pairs from each
        sequence's keys laid out once (cpu.attention_pairs), every chunk: it is faster than SDPA there. Elsewhere,
        where every projection computes a row alone at every row count (a8's kernel, no dense route), chunks of
        short prompts, so that a token's logits do not depend on how its prompt was chunked (a prefix-cache hit,
        a preemption); elsewhere the routes break that anyway, and SDPA prefills faster."""
        projections = [self.lm_head, *self.layer_projections()]
        invariant = all(
            isinstance(lin, Linear) and lin.packed is not None and lin.packed.kernel[0] == "a8" and lin.dense is None
            for lin in projections
        )
        if invariant:  # a8's rows are exact in any step: a tree row's too, where the kernel can lay its keys side by side
            self.math = replace(self.math, attention_path=cpu_kernels.ATTENTION_TREES_ALONE)
        if not self.math.attention_kernel:
            self.prefill_keys = 0
        elif cpu_kernels.attention_pairs(self.embed.dtype, self.math.head_dim):
            self.prefill_keys = 1 << 62
        else:
            self.prefill_keys = KERNEL_MAX_KEYS if invariant else 0

    # ------------------------------------------------------------------ compiled steps
    @property
    def compiled_rows(self) -> int:
        """The most rows a step may have and run compiled (0: none does)."""
        return self.steps.rows if self.steps is not None else 0

    @contextmanager
    def warming(self, steps):
        """In this thread, run short steps through `steps` (not yet installed) while it warms up."""
        self._local.steps = steps
        try:
            yield
        finally:
            self._local.steps = None

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scale).to(dtype)[:, None, :]  # [T, 1, d]
        sin = (emb.sin() * self.rope_scale).to(dtype)[:, None, :]
        return cos, sin

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.math.rms(x, self.norm)).float()

    def _rows(self, fn, *tensors: torch.Tensor):
        """fn over row-aligned tensors. With a tile, in fixed-shape pieces: each tensor is padded
        to a whole number of tiles and fn runs once per tile of exactly `tile` rows, so every
        kernel sees the same shape whatever the step holds and a row's result depends only on
        the row (see invariant mode in runner.py)."""
        n, tile = tensors[0].shape[0], self.tile
        if not tile or not n:
            return fn(*tensors)
        pad = -n % tile
        if pad:
            tensors = tuple(torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) for t in tensors)
        parts = [fn(*(t[s : s + tile] for t in tensors)) for s in range(0, n + pad, tile)]
        if isinstance(parts[0], tuple):
            return tuple(torch.cat(col)[:n] for col in zip(*parts))
        return torch.cat(parts)[:n]

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: StepContext,
        keep: torch.Tensor,
        aux_layers: tuple[int, ...] = (),
    ):
        """input_ids, positions: [T]; returns float32 logits for the rows in keep. With
        aux_layers, returns (logits, aux): aux [T, len(aux_layers) * hidden] holds the residual
        stream entering each of those layers (what a draft head reads), from the same pass."""
        x = F.embedding(input_ids, self.embed)
        if self.stream_dtype is not None:
            x = x.to(self.stream_dtype)
        cos, sin = self._rope(positions, x.dtype)
        t = input_ids.shape[0]
        aux = {}
        steps = getattr(self._local, "steps", None) or self.steps
        if steps is not None and steps.takes(ctx, t):
            x = steps.layers(x, cos, sin, ctx, aux_layers, aux)
            return self._finish(x, keep, aux_layers, aux)
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux[i] = x
            q, k, v = self._rows(partial(self.math.qkv, layer), x, cos, sin)
            out = attend(
                ctx,
                i,
                q.transpose(0, 1).unsqueeze(0),
                k,
                v,
                self.math.scaling,
                kernel=self.math.attention_kernel,
                prefill_keys=self.prefill_keys,
                kernel_path=self.math.attention_path,
            )
            x = self._rows(partial(self.math.block_out, layer), x, out[0].transpose(0, 1).reshape(t, self.math.q_size))
        return self._finish(x, keep, aux_layers, aux)

    def _finish(self, x: torch.Tensor, keep: torch.Tensor, aux_layers: tuple[int, ...], aux: dict):
        logits = self._rows(self._logits, x[keep])
        if not aux_layers:
            return logits
        return logits, torch.cat([aux[i] for i in aux_layers], dim=-1).to(self.embed.dtype)  # a head's dtype
