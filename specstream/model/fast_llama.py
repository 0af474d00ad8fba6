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

import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from specstream.kernels import cpu as cpu_kernels
from specstream.kernels import quant
from specstream.model import attention, kept_steps
from specstream.model.attention import StepContext, attend, attend_short, explicit_pays
from specstream.kernels.quant import Kernel, Linear, project

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


Projection = Callable[[torch.Tensor], torch.Tensor]
# The longest query run per sequence, and the most rows in a step, that take the compiled layer.
COMPILED_MAX_RUN = 16
COMPILED_MAX_ROWS = 16
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
    # Short steps attend with specstream's CPU kernel (kernels/cpu.py) rather than torch's ops.
    attention_kernel: bool = False

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
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
        return q, k, v.view(n, self.kv_heads, self.head_dim)

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
            keys, values, slot_mapping, q, k, v, kv_index, mask, q_index, out_index, self.scaling, self.attention_kernel
        )
        return self.block_out(layer, x, out.reshape(n, self.q_size), project)


class FastLlama:
    def __init__(
        self, model, linear: Callable[[list[str], torch.Tensor], Projection] = dense_linear, tile: int = 0
    ) -> None:
        cfg = model.config
        self.tile = tile  # 0: each op over the whole step; n: row-wise ops in fixed tiles of n rows
        base = model.model
        self.embed = base.embed_tokens.weight
        self.norm = base.norm.weight
        self.lm_head = linear(["lm_head.weight"], model.lm_head.weight.data)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.math = LayerMath(
            cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, head_dim**-0.5, cfg.intermediate_size
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
                    layer.input_layernorm.weight.detach(),
                    linear([name(f"self_attn.{p}_proj") for p in "qkv"], _fuse(qkv)),
                    linear([name("self_attn.o_proj")], attn.o_proj.weight.data),
                    layer.post_attention_layernorm.weight.detach(),
                    linear([name("mlp.gate_proj"), name("mlp.up_proj")], _fuse(gate_up)),
                    linear([name("mlp.down_proj")], mlp.down_proj.weight.data),
                )
            )
        # The compiled layer (see compile()): None until compiled.
        self._compiled = None
        # The functions compiled ahead of time, by kind of step (KINDS); None where building one failed
        # (those steps take the torch.compile'd calls). kept_dir: where they are kept between starts
        # (set by the runner). _uniform: every layer has the same kernels, so a function whose guards
        # pass for one layer passes for all.
        self.whole_steps = True
        self.kept_dir: Path | None = None
        self._kept: dict[str, Any] = {}
        self._uniform = False
        self.refused: dict[str, int] = {}  # steps per kind whose kept function's guards refused them
        self._kernels: list[tuple[torch.Tensor, Kernel, Kernel, torch.Tensor, Kernel, Kernel]] = []
        self._spans: list[range] = []  # the layers each compiled call runs
        self.compiled_rows = 0
        self._warming = False
        # What a short step does when no traced graph fits it: run eager (tests make it fail instead).
        self.unseen_shape_stance = "eager_on_recompile"

    # ------------------------------------------------------------------ compiled layer
    def compile(self, layers_per_graph: int = 1, whole_steps: bool = True) -> None:
        """Route short steps through the compiled layer (whole_steps: through the kept functions first).

        A decode or verification step of a small model on a CPU is mostly overhead: each layer runs
        about sixty small ops (norms, rotary, residuals, casts, attention's gathers), each dispatched from
        Python. Compiled (inductor), a layer becomes a few fused loops around the projections' kernels.
        The layer is one function of tensors: its weights come in as arguments (each projection as a
        quant.Kernel), so one graph serves all layers (layers_per_graph of them per call); sizes that
        vary (rows, sequences, context) are traced symbolically, and a graph is specialized only where a size is 1 (a lone decode step),
        so a handful of graphs cover every short step. Steps of more than compiled_rows rows (prefill,
        big batches) keep the eager forward, where the matmuls dominate anyway. compiled_rows is also
        at most the smallest row count where a projection's measured route changes kernel (kernels/routes.py),
        so a compiled graph holds exactly the kernels the eager forward would call. The graphs are
        traced on first use; the caller warms them up (runner.py) and inductor keeps the compiled
        code in its on-disk cache. Short steps take functions compiled ahead of time instead (see
        KINDS), built or loaded from kept_dir during the same warm-up; the torch.compile'd layer is
        their fallback."""
        if self.tile:
            raise ValueError("the compiled layer does not tile: invariant mode runs eager")
        linears = [lin for layer in self.layers for lin in (layer[1], layer[2], layer[4], layer[5])]
        limits = [lin.max_packed_rows for lin in linears if lin.packed is not None and lin.dense is not None]
        rows = min([COMPILED_MAX_ROWS, *limits])
        if rows < 1:
            return
        self.compiled_rows = rows
        self._kernels = [
            (w_in, qkv.kernel_for(rows), o.kernel_for(rows), w_post, gate_up.kernel_for(rows), down.kernel_for(rows))
            for w_in, qkv, o, w_post, gate_up, down in self.layers
        ]
        self.whole_steps = whole_steps
        per_call = max(g for g in range(1, layers_per_graph + 1) if len(self.layers) % g == 0)
        self._spans = [range(i, i + per_call) for i in range(0, len(self.layers), per_call)]
        self._uniform = len({kept_steps.signature(k) for k in self._kernels}) == 1
        if self.embed.device.type == "cpu" and cpu_kernels.fits_head(self.math.head_dim) and cpu_kernels.load():
            self.math = replace(self.math, attention_kernel=True)
        self._compiled = torch.compile(self.math.short_layers)

    def kept_kinds(self) -> list[str]:
        """The kinds of short step (KINDS) that a function compiled ahead of time serves."""
        return [kind for kind in KINDS if self._kept.get(kind) is not None]

    def decompile(self) -> None:
        self._compiled, self._kernels, self._spans, self.compiled_rows = None, [], [], 0
        self._kept = {}

    def _takes_compiled(self, ctx: StepContext, rows: int) -> bool:
        if self._compiled is None or rows > self.compiled_rows or len(ctx.groups) != 1:
            return False
        batch, s = ctx.groups[0].kv_index.shape
        run = ctx.groups[0].q_index.shape[1]
        return run <= COMPILED_MAX_RUN and explicit_pays(batch, self.math.heads, run, s)

    def _compiled_layers(self, x, cos, sin, ctx: StepContext, aux_layers, aux: dict) -> torch.Tensor:
        group = ctx.groups[0]
        view = group.key_view(None, False)
        step = (ctx.slot_mapping, view.kv_index, view.mask, group.q_index, group.out_index)
        pool = ctx.pool
        single, run1 = view.kv_index.shape[0] == 1, group.q_index.shape[1] == 1
        kind = ("decode" if run1 else "verify") if single else ("batch-decode" if run1 else "batch-verify")
        spans = [range(len(self.layers))] if self.whole_steps else self._spans
        first = self._layer_args(pool, spans[0])
        kept = self._kept_fn(kind, (self.math, x, cos, sin, *step, first))
        if kept is None:
            spans = self._spans
            if self._warming:
                kept_steps.mark_dynamic(x, cos, sin, *step)
        for n, span in enumerate(spans):
            layers = first if n == 0 and kept is not None else self._layer_args(pool, span)
            if kept is not None and (n == 0 or self._uniform or kept.guard_check(self.math, x, cos, sin, *step, layers)):
                outs = kept(self.math, x, cos, sin, *step, layers)
            else:
                # The stance holds for the torch.compile'd calls alone: around a kept function's call it
                # would put every frame its prologue runs through dynamo's cache lookup.
                with torch.compiler.set_stance("default" if self._warming else self.unseen_shape_stance):
                    outs = self._compiled(x, cos, sin, *step, layers)
            for i in span:
                if i in aux_layers:
                    aux[i] = x if i == span.start else outs[i - span.start - 1]
            x = outs[-1]
        return x

    def _layer_args(self, pool, span: range) -> tuple:
        """What the compiled layer takes for each layer of span: its keys, values and weights."""
        return tuple((pool.keys[i], pool.values[i], self._kernels[i]) for i in span)

    # ------------------------------------------------------------------ functions kept on disk
    def _kept_fn(self, kind: str, args: tuple):
        """The kept function for this kind of step, or None (not built, or this step, args being its
        first call, is not what its guards allow: then the step takes the torch.compile'd calls)."""
        if kind not in self._kept:
            if not self._warming:
                return None
            self._kept[kind] = self._build_kept(kind, args)
        fn = self._kept[kind]
        if fn is None:
            return None
        if not fn.guard_check(*args):
            self.refused[kind] = self.refused.get(kind, 0) + 1
            if self.refused[kind] == 1:
                log.info("a %s step does not fit its kept function (%s); such steps take the torch.compile'd calls", kind, kept_steps.guard_failure(fn, args))
            return None
        return fn

    def _build_kept(self, kind: str, args: tuple):
        """Load the function for this kind of step from kept_dir, or compile it ahead of time (and keep
        it there). args: an example call, from the warm-up step."""
        path = self.kept_dir / f"{kind}-{_kept_key(args)}.bin" if self.kept_dir is not None else None
        if path is not None and path.is_file():
            try:
                with path.open("rb") as f:
                    fn = torch.compiler.load_compiled_function(f, f_globals=globals())
                fn.disable_guard_check()  # checked by _kept_fn, before the call
                if fn.guard_check(*args):
                    os.utime(path)  # in use: see kept_steps.prune
                    return fn
                log.info(
                    "the kept function %s does not fit this forward (%s); compiling it again", path.name, kept_steps.guard_failure(fn, args)
                )
            except Exception as exc:  # noqa: BLE001 - a stale or broken file is rebuilt
                log.warning("could not load %s (%s: %s); compiling it again", path, type(exc).__name__, exc)
        # Sizes are marked only now: a function loaded from disk records none as marked (torch 2.13), so
        # its guards refuse a marked tensor; they take unmarked ones of any size the graph allows.
        kept_steps.mark_dynamic(*args[1:-1])
        for keys, values, _ in args[-1]:
            torch._dynamo.maybe_mark_dynamic(keys, 0)  # any pool size
            torch._dynamo.maybe_mark_dynamic(values, 0)
        start = time.perf_counter()
        try:
            # No size asserts: the wrapper would check every extern kernel's output (hundreds of checks
            # a decode step of the bundled model) for shapes the graph itself computed.
            options = {"guard_filter_fn": kept_steps.saveable_guards, "size_asserts": False}
            compiled = torch.compile(LayerMath.short_layers, fullgraph=True, options=options)
            fn = compiled.aot_compile((args, {}))
        except Exception as exc:  # noqa: BLE001 - the torch.compile'd calls still serve these steps
            log.warning(
                "compiling %s steps ahead of time failed (%s: %s); they take the per-layer torch.compile'd calls",
                kind,
                type(exc).__name__,
                exc,
            )
            return None
        fn.disable_guard_check()
        log.info(
            "compiled %s steps ahead of time (%d layers per call) in %.1f s", kind, len(args[-1]), time.perf_counter() - start
        )
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fn.save_compiled_function(str(path))
                kept_steps.prune(path.parent)
            except Exception as exc:  # noqa: BLE001 - serving goes on; the next start compiles again
                log.warning("could not keep the compiled function in %s: %s", path, exc)
        return fn

    def warm_up(self, forward: Callable[[], object]) -> None:
        """Run forward() (steps chosen by the caller to cover the graphs short steps need) with the
        varying sizes marked dynamic, so each graph is traced once for all sizes; afterwards a step
        that would need another graph runs eager rather than stall the server to compile it."""
        self._warming = True
        try:
            forward()
        finally:
            self._warming = False

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
        cos, sin = self._rope(positions, x.dtype)
        t = input_ids.shape[0]
        aux = {}
        if self._takes_compiled(ctx, t):
            x = self._compiled_layers(x, cos, sin, ctx, aux_layers, aux)
            return self._finish(x, keep, aux_layers, aux)
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux[i] = x
            q, k, v = self._rows(partial(self.math.qkv, layer), x, cos, sin)
            out = attend(ctx, i, q.transpose(0, 1).unsqueeze(0), k, v, self.math.scaling)
            x = self._rows(partial(self.math.block_out, layer), x, out[0].transpose(0, 1).reshape(t, self.math.q_size))
        return self._finish(x, keep, aux_layers, aux)

    def _finish(self, x: torch.Tensor, keep: torch.Tensor, aux_layers: tuple[int, ...], aux: dict):
        logits = self._rows(self._logits, x[keep])
        if not aux_layers:
            return logits
        return logits, torch.cat([aux[i] for i in aux_layers], dim=-1)


def _kept_key(args: tuple) -> str:
    """What a kept function depends on beyond its guards: torch, the code it runs, and
    (so that configurations keep separate files) the layer sizes, dtypes and kernel kinds."""
    h = hashlib.sha256(torch.__version__.encode())
    # kernels/cpu.py holds the kernels' schemas, which the graph calls by name; their C++ is not part of the
    # graph, so an edit to it needs a new library (cpu_kernels' own key), not new kept functions.
    for source in (__file__, kept_steps.__file__, attention.__file__, quant.__file__, cpu_kernels.__file__):
        h.update(Path(source).read_bytes())
    math, x, layers = args[0], args[1], args[-1]
    kernels = [kept_steps.signature(layer[2]) for layer in layers]
    pools = sorted({(str(t.dtype), tuple(t.shape[1:]), t.is_contiguous()) for keys, values, _ in layers for t in (keys, values)})
    h.update(repr((math, x.dtype, x.device.type, pools, kernels)).encode())
    return h.hexdigest()[:20]
