"""Building an engine: load the target, size its KV pool, make its runner (kernels routed, steps
compiled), build the proposer by name, calibrate, and wire the scheduler and input processor.

Everything here runs once, at start-up; Engine (engine.py) holds the parts and runs steps.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specstream import calibration
from specstream.calibration import CostModel
from specstream.config import EngineConfig
from specstream.engine.processor import InputProcessor
from specstream.engine.scheduler import Scheduler
from specstream.kernels import cpu as cpu_kernels
from specstream.kernels import quant, routes
from specstream.memory.heap import release_free_heap
from specstream.memory.kv import KVPool
from specstream.model import fast_llama
from specstream.model.attention import ATTN_IMPLEMENTATION, model_geometry
from specstream.model.loader import (
    ModelSource,
    gguf_file,
    is_gguf_name,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from specstream.model.runner import INVARIANT_TILE, ModelRunner, layer_windows
from specstream.spec_decode.policy import KPolicy
from specstream.spec_decode.prediction import prediction_hint
from specstream.spec_decode.proposer import Proposer, ProposerContext
from specstream.spec_decode.registry import make_proposer
from specstream.structured.decoding import StructuredDecoding

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What an Engine runs on, built once."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    tokenizer: Any
    model: Any
    vocab_size: int
    eos_token_ids: set[int]
    pool: KVPool
    max_model_len: int
    runner: ModelRunner
    proposer: Proposer
    structured: StructuredDecoding
    policy: KPolicy
    scheduler: Scheduler
    processor: InputProcessor
    calibration_file: Path | None  # where the forward-time curve is kept between starts (None: not kept)
    pricing: Pricing  # prices the forward again once a background compile is installed
    resident_memory: dict[str, int]  # the process's resident bytes after each start-up phase (ResidentMemory)
    forward: str = "eager"  # what the forward runs (runner.compile's description)


class EngineBuilder:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)

    def build(self, log: bool = True) -> EngineParts:
        config, spec = self.config, self.config.speculative
        start = time.perf_counter()
        resident = ResidentMemory()
        self.build_kernels_ahead()
        source = resolve_model(config.model)
        tokenizer = load_tokenizer(source, chat_template=config.chat_template)
        model = load_model(source, self.dtype, self.device, attn_implementation=ATTN_IMPLEMENTATION)
        resident.mark("model")
        vocab_size = model.config.get_text_config().vocab_size
        eos_token_ids = eos_ids(model, tokenizer)
        kv_tokens = self.pool_tokens(model)
        pool = KVPool(
            *model_geometry(model.config),
            kv_tokens,
            config.kv_block_size,
            self.dtype,
            self.device,
            windows=layer_windows(model),
        )
        resident.mark("KV pool")
        # A sequence may take the pool's capacity, but at most its memory's worth (a pool whose every layer
        # is windowed holds a sequence of any length). A proposer's own pool holds as many positions.
        pool_positions = min(pool.capacity, kv_tokens)
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None) or pool_positions
        max_model_len = config.max_model_len or min(limit, pool.capacity)
        if max_model_len > pool.capacity:
            raise ValueError(f"max_model_len {max_model_len} exceeds the KV pool ({pool.capacity} tokens)")
        runner, weights = self.make_runner(model, pool, source)
        resident.mark("weights")
        # A background compile starts once start-up has timed what it times (a compile beside it skews that).
        background = config.compile_in_background and config.compile and not runner.tile
        forward = "eager (compiling in the background)" if background else self.compile(runner)
        resident.mark("compile")
        # trees: full-context layers only (their masks); in invariant mode only where attention is untiled (its kernel
        # lays a tree row's keys side by side: EngineConfig.deterministic says why)
        trees = spec.tree_drafts and not pool.windowed and (not config.deterministic or runner.tile == 0)
        ctx = ProposerContext(config, model, tokenizer, vocab_size, self.dtype, self.device, pool_positions, trees)
        proposer = make_proposer(ctx)
        resident.mark("proposer")
        # [structured] grammars, forced drafts, masks; a proposer's own logits are masked too
        structured = StructuredDecoding(tokenizer, vocab_size, eos_token_ids, forced_drafts=spec.forced_drafts)
        proposer.constrain(structured.mask_draft_logits)
        pricing = Pricing(self, source, weights, runner, proposer)
        # A server measures a contradicted curve once idle (Engine.idle), not before it serves.
        target_cost, kept = pricing.price(forward, later=config.compile_in_background)
        k_max = spec.num_speculative_tokens if spec.enabled else 0
        # One sequence's run past the compiled steps' longest takes the whole step off the short steps' path (eager,
        # its attention apart); the curve times steps of more rows as several sequences' short runs
        # (calibration.step_items), so such a run is not granted.
        longest = fast_llama.COMPILED_MAX_RUN if runner.fast is not None else None
        hint = prediction_hint(proposer.draft_hint)  # a request's prediction first (spec_decode/prediction.py)
        policy = KPolicy(k_max, spec.adaptive, target_cost, proposer.pass_cost, proposer.lookup_cost, hint, longest)
        processor = InputProcessor(
            tokenizer=tokenizer,
            output_tokenizer=tokenizer,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            rng=random.Random(config.seed),
            max_prompt_chars=config.max_prompt_chars,
            allow_special_tokens_in_content=config.allow_special_tokens_in_content,
            structured=structured,
            eos_token_ids=frozenset(eos_token_ids),
        )
        resident.mark("calibration")
        if background:
            forward = self.compile(runner)
        parts = EngineParts(
            config, self.device, self.dtype, tokenizer, model, vocab_size, eos_token_ids, pool, max_model_len,
            runner, proposer, structured, policy, Scheduler(config, pool, policy, proposer.release), processor, kept,
            pricing, resident.phases, forward,
        )
        if log:
            logger.info(
                "engine ready in %.1f s: %s (%s, %s), speculation %s k<=%d, KV pool %s; weights %s; "
                "forward %s; resident memory %s",
                time.perf_counter() - start, config.model, self.dtype, self.device, spec.method, k_max,
                pool.describe(), weights, forward, resident.describe(),
            )
        return parts

    def build_kernels_ahead(self) -> None:
        """Start building specstream's CPU kernels where this configuration uses them (the compiled forward,
        a GGUF file's blocks, int4), so that the compiler runs while the model loads (and converts, the first
        time); a no-op once they are built."""
        config = self.config
        blocks = config.quantization in ("int4", "a8") or config.quantization == "auto" and is_gguf_name(config.model)
        if self.device.type == "cpu" and (blocks or config.compile and not config.deterministic):
            cpu_kernels.build_ahead()

    def pool_tokens(self, model) -> int:
        """KV slots in the target's pool: kv_cache_tokens, else what kv_cache_bytes holds (no more than
        every sequence at full context)."""
        if self.config.kv_cache_tokens is not None:
            return self.config.kv_cache_tokens
        per_token = KVPool.bytes_per_token(*model_geometry(model.config), self.dtype)
        tokens = self.config.kv_cache_bytes // per_token
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if limit:
            tokens = min(tokens, limit * self.config.max_num_seqs)
        return max(tokens, self.config.kv_block_size)

    def make_runner(self, model, pool: KVPool, source: ModelSource) -> tuple[ModelRunner, str]:
        """The target's runner with its projections held as config.quantization says (kernels/), and
        a line for the log."""
        mode = self.config.quantization
        tile = INVARIANT_TILE if self.config.deterministic else 0
        if not fast_llama.supports(model):
            if mode in ("int4", "int8", "a8"):
                raise ValueError(f"quantization {mode} needs a Llama-architecture model (the lean forward)")
            return ModelRunner(model, pool, tile=tile), "dense"
        factory = quant.make_factory(mode, model, gguf_file(source), self.dtype, self.device, self.kept_projections(source))
        if factory is None:
            return ModelRunner(model, pool, tile=tile), "dense"
        runner = ModelRunner(model, pool, linear=factory, tile=tile, stream_dtype=self.stream_dtype(mode))
        factory.keep()
        # Invariant mode: a fixed route (the packed kernel), not one timed at start-up.
        routes_file = calibration.cache_file(
            "routes", source, self.dtype, self.device,
            [mode, self.config.max_num_batched_tokens, factory.kernel_kinds, self.kernels_key(), routes.RULE],
        )
        choices = routes.settle(
            factory, model, self.config.max_num_batched_tokens, timed=not self.config.deterministic,
            routes_file=routes_file, floors=self.packed_floors(runner),
        )
        runner.fast.routes_settled()
        runner.untile()  # (invariant mode)
        return runner, routes.describe(factory, choices)

    def packed_floors(self, runner: ModelRunner) -> dict[tuple[int, int], int]:
        """Where the block kernels multiply bfloat16 rows on AMX tiles, the decoder layers' projections keep them up
        to fast_llama.COMPILED_MAX_ROWS rows, whatever start-up times for a projection alone. A route ending below
        that takes every step above it off the compiled forward (CompiledSteps.rows), whose graphs save more than
        the dense GEMM does; and measured in whole forwards on a Xeon with AMX, the tiles beat the dense GEMM at
        25 and 32 rows eager too (docs/MEASUREMENTS.md, "Steps of up to 64 rows compiled on AMX"). Elsewhere the timing decides alone:
        the vector kernels' cost grows with every row."""
        if self.device.type != "cpu" or self.dtype != torch.bfloat16 or not cpu_kernels.block_tiles():
            return {}
        return {lin.shape: fast_llama.COMPILED_MAX_ROWS for lin in runner.fast.layer_projections()
                if lin.packed is not None and lin.packed.kernel[0] in ("q4", "q8")}

    def stream_dtype(self, mode: str) -> torch.dtype | None:
        """The residual stream's dtype where it is wider than the weights': float32 under a8 with 16-bit
        weights. a8 rounds every projection's input to 8-bit blocks; rounding the stream to bfloat16 as well
        (8 significant bits) added a third to its error against the fp32 model (README, a8's quality: KL
        0.00357 against 0.00262, llama.cpp's 0.00260), for 3-4% of a short step and 9% of a prefill chunk."""
        wide = mode == "a8" and self.dtype in (torch.bfloat16, torch.float16)
        return torch.float32 if wide else None

    def kept_projections(self, source: ModelSource) -> Path | None:
        """Where the projections built for this model and configuration are kept between starts
        (kernels/kept_weights.py), keyed like the start-up timings; None: not kept."""
        mode = self.config.quantization
        if mode == "none":
            return None
        key = calibration.cache_file("projections", source, self.dtype, self.device, [mode, *quant.kept_key(self.device)])
        return key.parent.parent / "projections" / f"{key.stem}.safetensors" if key is not None else None

    def compile(self, runner: ModelRunner) -> str:
        """The forward's compiled steps (runner.compile), after the kernel routes are settled; a line
        for the log."""
        # Invariant mode's line keys the kept forward times (rows alone or in tiles). Its tiles stay eager; without
        # them its steps compile as any (the compiled steps compute a row as the eager forward does).
        mode = f" (invariant mode: {runner.tiling})" if self.config.deterministic else ""
        if runner.tile or not self.config.compile:
            return f"eager{mode}"
        return runner.compile(background=self.config.compile_in_background) + mode

    def calibration_file(self, source: ModelSource, weights: str, runner: ModelRunner) -> Path | None:
        """Where the target's forward-time curve is kept between starts, keyed by the weight kernels,
        invariant mode and the step sizes timed besides calibration.cache_file's own key."""
        plan = calibration.plan(
            self.config.max_num_batched_tokens, runner.pool.capacity, calibration.compiled_rows(runner)
        )
        return calibration.cache_file(
            "forward", source, self.dtype, self.device, [weights, self.config.deterministic, *plan, self.kernels_key(), calibration.TIMING]
        )

    def kernels_key(self) -> str:
        """The build of specstream's CPU kernels serving here ("" where none serve): timings kept between
        starts are keyed by it, so a changed kernel is timed again rather than routed by its predecessor's
        times."""
        return cpu_kernels.build_key() if self.device.type == "cpu" and cpu_kernels.loaded() else ""



@dataclass
class Pricing:
    """What the target's forward costs, and the proposer's own steps measured against it, for the forward
    that serves: at start-up, and again once a background compile changes it (Engine.idle)."""

    builder: EngineBuilder
    source: ModelSource
    weights: str  # the weights' kernels, as the log names them
    runner: ModelRunner
    proposer: Proposer
    next_refine: float = 0.0  # time.monotonic() before which a suspect curve is not timed again

    def refine(self, cost: CostModel, kept: Path | None) -> bool:
        """Time a suspect curve's small sizes again and keep each size's faster time (and the curve, where it
        is kept); at most once every REFINE_EVERY seconds. Whether the curve moved."""
        if not cost.suspect() or time.monotonic() < self.next_refine:
            return False
        self.next_refine = time.monotonic() + calibration.REFINE_EVERY
        if not calibration.refine_small_sizes(self.runner, self.builder.config.max_num_batched_tokens, cost):
            return False
        ratio = cost.timed(2) / cost.timed(1)
        logger.info("forward-time curve timed again at its small sizes: two tokens %.2fx one", ratio)
        if kept is not None:
            cost.save(kept)
        return True

    def price(self, forward: str, later: bool = False) -> tuple[CostModel | None, Path | None]:
        """The forward-time curve (None where k is not adaptive: no draft is priced) and the file it is
        kept in between starts. A forward still compiling in the background is priced as eager. later: a
        kept curve that a step timed now contradicts is scaled, not measured again (calibration.forward_cost)."""
        config = self.builder.config
        spec = config.speculative
        if forward.startswith("eager"):
            forward = "eager"
        kept = self.builder.calibration_file(self.source, f"{self.weights}; {forward}", self.runner)
        if not (spec.enabled and spec.adaptive):
            return None, kept
        target_cost = calibration.forward_cost(self.runner, config.max_num_batched_tokens, kept, later)
        self.proposer.calibrate(target_cost, config.max_num_batched_tokens)
        return target_cost, kept


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class ResidentMemory:
    """The process's resident memory before start-up ("before": imports, and anything the process held
    already) and after each phase: where a server's memory goes."""

    def __init__(self) -> None:
        release_free_heap()
        self.phases = {"before": resident_bytes()}

    def mark(self, phase: str) -> None:
        release_free_heap()  # what a phase keeps, not the temporaries it freed (memory/heap.py)
        self.phases[phase] = resident_bytes()

    def describe(self) -> str:
        names, values = list(self.phases), list(self.phases.values())
        steps = [f"{n} +{(v - p) / 2**20:.0f}" for n, v, p in zip(names[1:], values[1:], values)]
        return f"{values[-1] / 2**20:.0f} MiB ({names[0]} {values[0] / 2**20:.0f}, {', '.join(steps)})"


def eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
