"""The lean forward's short steps, compiled: one object that FastLlama takes whole once it is ready.

A decode or verification step of a small model on a CPU is mostly overhead: each layer runs about sixty
small ops (norms, rotary, residuals, casts, attention's gathers), each dispatched from Python. Compiled
(inductor), a layer becomes a few fused loops around the projections' kernels. The layer is one function
of tensors (fast_llama.LayerMath.short_layers): its weights come in as arguments (each projection as a
quant.Kernel), so one graph serves all layers (layers_per_graph of them per call); sizes that vary (rows,
sequences, context) are traced symbolically, and a graph is specialized only where a size is 1 (a lone
decode step), so a handful of graphs cover every short step. Steps of more than `rows` rows (prefill, big
batches) keep the eager forward, where the matmuls dominate anyway. `rows` is also at most the smallest
row count where a projection's measured route changes kernel (kernels/routes.py), so a compiled graph
holds exactly the kernels the eager forward would call.

Short steps take functions compiled ahead of time (torch's aot_compile) for each kind of step (KINDS),
every layer in one call, built or loaded from kept_dir during the warm-up; the torch.compile'd layer is
their fallback.

A CompiledSteps is built and warmed up apart from the FastLlama it serves, and installed by one
assignment (FastLlama.steps), so the warm-up may run in a thread of its own while the eager forward
serves (runner.py's background compile): the warming thread sees its CompiledSteps through a
thread-local, every other thread sees FastLlama.steps.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specstream.kernels import cpu as cpu_kernels
from specstream.kernels import quant
from specstream.model import attention, fast_llama, kept_steps
from specstream.model.attention import StepContext, explicit_pays
from specstream.model.fast_llama import COMPILED_MAX_ROWS, COMPILED_MAX_RUN, KINDS, FastLlama, LayerMath

log = logging.getLogger("specstream.model.compiled_steps")

# Inductor keeps fused bf16/fp16 intermediates in float32 unless told to round them as eager torch does
# after every op. Told to, a compiled layer computes each row as the eager forward does (measured on the
# bundled model: the same bits for decode and verification graphs, and as eager), so a token's logits do not
# depend on whether its step ran compiled, nor which kind of graph served it; the price is a few roundings.
NUMERICS = {"emulate_precision_casts": True}


class CompiledSteps:
    """Short steps of one FastLlama's layers, compiled. rows == 0: nothing to compile (a route sends
    every row count to the dense kernel where the packed one holds the weights too)."""

    def __init__(self, fast: FastLlama, layers_per_graph: int = 1, whole_steps: bool = True, kept_dir: Path | None = None) -> None:
        if fast.tile:
            raise ValueError("the compiled layer does not tile: invariant mode runs eager")
        self.layer_count = len(fast.layers)
        linears = fast.layer_projections()
        limits = [lin.max_packed_rows for lin in linears if lin.packed is not None and lin.dense is not None]
        self.rows = max(min([COMPILED_MAX_ROWS, *limits]), 0)
        self.kernels = [
            (w_in, qkv.kernel_for(self.rows), o.kernel_for(self.rows), w_post, gate_up.kernel_for(self.rows), down.kernel_for(self.rows))
            for w_in, qkv, o, w_post, gate_up, down in fast.layers
        ]
        self.whole_steps = whole_steps
        per_call = max(g for g in range(1, layers_per_graph + 1) if self.layer_count % g == 0)
        self.spans = [range(i, i + per_call) for i in range(0, self.layer_count, per_call)]  # the layers each call runs
        # Every layer has the same kernels: a function whose guards pass for one layer passes for all.
        self.uniform = len({kept_steps.signature(k) for k in self.kernels}) == 1
        self.math = fast.math
        self.fn = torch.compile(self.math.short_layers, options=NUMERICS)
        # The functions compiled ahead of time, by kind of step; None where building one failed (those
        # steps take the torch.compile'd calls). kept_dir: where they are kept between starts.
        self.kept_dir = kept_dir
        self.kept: dict[str, Any] = {}
        self.refused: dict[str, int] = {}  # steps per kind whose kept function's guards refused them
        self.warming = False
        # What a short step does when no traced graph fits it: run eager (tests make it fail instead).
        self.unseen_shape_stance = "eager_on_recompile"

    def kept_kinds(self) -> list[str]:
        """The kinds of short step (KINDS) that a function compiled ahead of time serves."""
        return [kind for kind in KINDS if self.kept.get(kind) is not None]

    def takes(self, ctx: StepContext, rows: int) -> bool:
        """Whether this step runs compiled."""
        if rows > self.rows or len(ctx.groups) != 1:
            return False
        batch, s = ctx.groups[0].kv_index.shape
        run = ctx.groups[0].q_index.shape[1]
        return run <= COMPILED_MAX_RUN and explicit_pays(batch, self.math.heads, run, s)

    def layers(self, x, cos, sin, ctx: StepContext, aux_layers, aux: dict) -> torch.Tensor:
        """Every decoder layer of a short step; fills aux with the residual stream entering aux_layers."""
        group = ctx.groups[0]
        view = group.key_view(None, False)
        step = (ctx.slot_mapping, view.kv_index, view.mask, group.q_index, group.out_index)
        pool = ctx.pool
        single, run1 = view.kv_index.shape[0] == 1, group.q_index.shape[1] == 1
        kind = ("decode" if run1 else "verify") if single else ("batch-decode" if run1 else "batch-verify")
        spans = [range(self.layer_count)] if self.whole_steps else self.spans
        first = self._layer_args(pool, spans[0])
        kept = self._kept_fn(kind, (self.math, x, cos, sin, *step, first))
        if kept is None:
            spans = self.spans
            if self.warming:
                kept_steps.mark_dynamic(x, cos, sin, *step)
        for n, span in enumerate(spans):
            layers = first if n == 0 and kept is not None else self._layer_args(pool, span)
            if kept is not None and (n == 0 or self.uniform or kept.guard_check(self.math, x, cos, sin, *step, layers)):
                outs = kept(self.math, x, cos, sin, *step, layers)
            else:
                # The stance holds for the torch.compile'd calls alone: around a kept function's call it
                # would put every frame its prologue runs through dynamo's cache lookup.
                with torch.compiler.set_stance("default" if self.warming else self.unseen_shape_stance):
                    outs = self.fn(x, cos, sin, *step, layers)
            for i in span:
                if i in aux_layers:
                    aux[i] = x if i == span.start else outs[i - span.start - 1]
            x = outs[-1]
        return x

    def _layer_args(self, pool, span: range) -> tuple:
        """What the compiled layer takes for each layer of span: its keys, values and weights."""
        return tuple((pool.keys[i], pool.values[i], self.kernels[i]) for i in span)

    def warm_up(self, forward: Callable[[], object]) -> None:
        """Run forward() (steps chosen by the caller to cover the graphs short steps need) with the
        varying sizes marked dynamic, so each graph is traced once for all sizes; afterwards a step
        that would need another graph runs eager rather than stall the server to compile it."""
        self.warming = True
        try:
            forward()
        finally:
            self.warming = False

    # ------------------------------------------------------------------ functions kept on disk
    def _kept_fn(self, kind: str, args: tuple):
        """The kept function for this kind of step, or None (not built, or this step, args being its
        first call, is not what its guards allow: then the step takes the torch.compile'd calls)."""
        if kind not in self.kept:
            if not self.warming:
                return None
            self.kept[kind] = self._build_kept(kind, args)
        fn = self.kept[kind]
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
            fn = _load_kept(path, args)
            if fn is not None:
                return fn
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
            options = {"guard_filter_fn": kept_steps.saveable_guards, "size_asserts": False, **NUMERICS}
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
        log.info("compiled %s steps ahead of time (%d layers per call) in %.1f s", kind, len(args[-1]), time.perf_counter() - start)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fn.save_compiled_function(str(path))
                kept_steps.prune(path.parent)
            except Exception as exc:  # noqa: BLE001 - serving goes on; the next start compiles again
                log.warning("could not keep the compiled function in %s: %s", path, exc)
        return fn


def _load_kept(path: Path, args: tuple):
    """The function kept at path, or None where it cannot load or its guards do not take args."""
    try:
        with path.open("rb") as f:
            # The traced code (LayerMath.short_layers) resolves its globals in fast_llama's module.
            fn = torch.compiler.load_compiled_function(f, f_globals=vars(fast_llama))
        fn.disable_guard_check()  # checked by _kept_fn, before the call
        if fn.guard_check(*args):
            os.utime(path)  # in use: see kept_steps.prune
            return fn
        log.info("the kept function %s does not fit this forward (%s); compiling it again", path.name, kept_steps.guard_failure(fn, args))
    except Exception as exc:  # noqa: BLE001 - a stale or broken file is rebuilt
        log.warning("could not load %s (%s: %s); compiling it again", path, type(exc).__name__, exc)
    return None


def _kept_key(args: tuple) -> str:
    """What a kept function depends on beyond its guards: torch, the code it runs, and
    (so that configurations keep separate files) the layer sizes, dtypes and kernel kinds."""
    h = hashlib.sha256(torch.__version__.encode())
    # kernels/cpu.py holds the kernels' schemas, which the graph calls by name; their C++ is not part of the
    # graph, so an edit to it needs a new library (cpu_kernels' own key), not new kept functions.
    for source in (fast_llama.__file__, __file__, kept_steps.__file__, attention.__file__, quant.__file__, cpu_kernels.__file__):
        h.update(Path(source).read_bytes())
    math, x, layers = args[0], args[1], args[-1]
    kernels = [kept_steps.signature(layer[2]) for layer in layers]
    pools = sorted({(str(t.dtype), tuple(t.shape[1:]), t.is_contiguous()) for keys, values, _ in layers for t in (keys, values)})
    h.update(repr((math, x.dtype, x.device.type, pools, kernels)).encode())
    return h.hexdigest()[:20]
