"""One packed forward over many sequences.

Each sequence contributes its own number of new tokens (a prefill chunk, or its last token
plus its drafts). The tokens are concatenated into one [1, T] batch, nothing is padded, and
each sequence attends only to its own prefix in the KV pool (see attention.py).

Invariant mode (EngineConfig.deterministic): a kernel may pick its blocking, and so the order
in which it sums, from the shape of its inputs (on this CPU a bf16 matmul over 1536 inputs
rounds differently from 19 rows on; fp32 ones differ from 2 rows on). A token's logits then
depend on how many other rows its step held: its drafts, its neighbours in the batch. With a
tile, every row-wise op (norms, projections, rotary, MLP, LM head) runs on fixed tiles of
`tile` rows, padded, and attention runs per tile of `tile` query rows of one sequence, always
masked, over keys padded with masked columns (which add exact zeros) to a multiple of 64. Every kernel then
sees one shape, and a token's numbers are the same whether it was computed alone, as one of
k + 1 verified tokens, in a prefill chunk or beside other sequences. The price is the padding
(a one-row decode step computes `tile` rows) and a loop over tiles for long prefills.

Tiles are only needed where a kernel's rounding follows the shape. Where every projection takes
specstream's block kernels, asked to compute each row alone (kernels/quant.py's ROWS_ALONE: one path
and one summation order at any row count), and the norms take the rms_norm kernel, the row-wise work
runs untiled (FastLlama.untile_rows); where the attention kernel multiplies bfloat16 pairs it attends
every group alone too and attention's tiles go as well (FastLlama.attend_alone, ModelRunner.untile).
A decode step then computes one row, as outside invariant mode.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specstream.model import fast_llama
from specstream.model.architectures import check_architecture
from specstream.model.compiled_steps import CompiledSteps
from specstream.model.attention import SHORT_RUN, AttentionGroup, StepContext, model_geometry, step_context
from specstream.model.fast_llama import FastLlama, dense_linear
from specstream.memory.kv import KVPool
from specstream.model.loader import ModelError
from specstream.cache import cache_dir, point_inductor_here

log = logging.getLogger("specstream.model.runner")


# Rows per tile in invariant mode: one tile holds a verification step (the adaptive policy's runs are at most
# fast_llama.COMPILED_MAX_RUN = 16 rows) so speculation costs no second tile; see the README for the measured price.
INVARIANT_TILE = 16
_KEY_BLOCK = 64


def _lower_priority() -> None:
    """Give this thread (and the compiler processes it starts, which inherit it) a lower CPU priority than
    the engine thread's: on a few cores a background compile would otherwise slow every step it overlaps.
    Linux sets niceness per thread; elsewhere nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


@dataclass
class _PendingCompile:
    """A compile running in a thread of its own (ModelRunner.compile(background=True))."""

    tables: list[list[int]]  # the warm-up's scratch blocks, reserved by the thread that runs steps
    thread: threading.Thread | None = None
    result: tuple[CompiledSteps | None, str] | None = field(default=None)  # set by the thread as it ends


def tree_depths(parents: list[int], root: int = 0) -> list[int]:
    """Each node's depth in a tree given by parents (an earlier index, or -1): `root` for a node whose
    parent is -1, its parent's + 1 below."""
    depths: list[int] = []
    for p in parents:
        depths.append(root if p < 0 else depths[p] + 1)
    return depths


@dataclass
class ForwardItem:
    table: list[int]  # the sequence's block table (already reserved for start + len(tokens))
    start: int  # positions already in the cache
    tokens: list[int]  # new tokens, fed at positions start, start + 1, ...
    num_logits: int  # logits wanted for the last num_logits new tokens
    # [trees] each new token's parent among them (-1 for the first, which follows the cached prefix): the
    # token sits at position start + its depth and sees the prefix and its own ancestors only; its KV still
    # goes to the slot of position start + its index (the engine moves an accepted path's KV into place)
    parents: list[int] | None = None

    def positions(self) -> np.ndarray:
        """Each new token's position: start + its index, or [trees] start + its depth."""
        if self.parents is None:
            return np.arange(self.start, self.start + len(self.tokens), dtype=np.int64)
        return self.start + np.asarray(tree_depths(self.parents), dtype=np.int64)

    def ancestry(self) -> np.ndarray:
        """[trees] [n, n] bool: row i sees token j (j is i or one of its ancestors)."""
        n = len(self.tokens)
        seen = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                seen[i] = seen[p]
            seen[i, i] = True
        return seen


class ModelRunner:
    def __init__(
        self,
        model,
        pool: KVPool,
        fast: bool = True,
        linear=dense_linear,
        tile: int = 0,
        stream_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.tile = tile
        check_architecture(model)
        # Llama-architecture models take the lean forward (with its projections made by `linear`, see
        # kernels/quant.py); others run transformers' modules.
        # stream_dtype: a residual stream wider than the weights (FastLlama), for the lean forward only.
        self.fast = FastLlama(model, linear, tile, stream_dtype) if fast and fast_llama.supports(model) else None
        if self.fast is None:
            if tile:
                raise ModelError(
                    f"deterministic (batch-invariant) mode needs the lean Llama forward; "
                    f"{type(model).__name__} runs through transformers' modules, which it cannot tile"
                )
            self._probe()

    def untile(self) -> None:
        """Invariant mode (a tile) without the tiles its kernels make needless: the row-wise work's where every
        projection computes a row alone (FastLlama.untile_rows), then attention's where its kernel does
        (FastLlama.attend_alone). A no-op outside invariant mode."""
        if self.tile and self.fast is not None and self.fast.untile_rows() and self.fast.attend_alone():
            self.tile = 0

    @property
    def tiling(self) -> str:
        """What invariant mode runs in tiles, for the log."""
        if self.fast is not None and self.fast.tile:
            return f"tiles of {self.tile} rows"
        return f"rows alone, attention in tiles of {self.tile} rows" if self.tile else "rows alone"

    _pending: _PendingCompile | None = None

    def _probe(self) -> None:
        """One tiny forward at load time, so a model whose attention asks for something the
        packed attention does not implement is refused now (UnsupportedAttentionError, a
        ModelError), not while serving."""
        table = self.pool.new_table()
        if not self.pool.reserve(table, 2):
            return
        try:
            self.forward([ForwardItem(table, 0, [0, 0], 1)])
        finally:
            self.pool.free(table)

    def compile(self, layers_per_graph: int = 1, whole_steps: bool = True, background: bool = False) -> str:
        """Compile the lean forward's short steps (compiled_steps.CompiledSteps, which takes the arguments) and
        trace their graphs now, on scratch blocks of the pool, so no request waits for a compile. Inductor keeps
        the compiled code under the specstream cache (inductor/, compiled/), so only the first start on a
        machine pays for most of it. Where compiling fails (no C++ compiler, say), the forward stays eager and
        the log says why. Returns what the forward runs, for the start-up log (and the calibration cache's key).

        background: return at once, the forward eager, and compile in a thread of its own while the eager
        forward serves; the thread that runs steps installs the result between two steps (install_compiled).
        The warm-up's scratch blocks are reserved here, so that thread never touches the pool's allocator."""
        if self.fast is None:
            return "eager (transformers modules)"
        point_inductor_here()
        tables = [self.pool.new_table(), self.pool.new_table()]
        if not all(self.pool.reserve(t, 40) for t in tables):
            for t in tables:
                self.pool.free(t)
            return "eager (the KV pool has no room for the warm-up steps)"
        if not background:
            try:
                steps, description = self._compile(tables, layers_per_graph, whole_steps)
            finally:
                for t in tables:
                    self.pool.free(t)
            self.fast.steps = steps
            return description
        pending = _PendingCompile(tables)

        def run() -> None:
            _lower_priority()
            pending.result = self._compile(tables, layers_per_graph, whole_steps)

        pending.thread = threading.Thread(target=run, name="specstream-compile", daemon=True)
        self._pending = pending
        pending.thread.start()
        return "eager (compiling in the background)"

    def _compile(self, tables: list[list[int]], layers_per_graph: int, whole_steps: bool) -> tuple[CompiledSteps | None, str]:
        start = time.perf_counter()
        try:
            steps = CompiledSteps(self.fast, layers_per_graph, whole_steps, kept_dir=cache_dir() / "compiled")
            rows = steps.rows
            if not rows:
                return None, "eager (no step shape to compile)"
            # One step per graph a short step needs: sizes of 1 are specialized, so a lone decode step,
            # one sequence's verification, a batch of decode steps and a batch of verifications differ.
            # Sizes are distinct (rows, sequences, query run, context) so none is traced as equal to another.
            a, b = tables
            shapes = [
                [ForwardItem(a, 37, [0], 1)],
                [ForwardItem(a, 37, [0] * 3, 3)],
                [ForwardItem(a, 37, [0], 1), ForwardItem(b, 29, [0], 1)],
                [ForwardItem(a, 37, [0] * 3, 3), ForwardItem(b, 29, [0] * 2, 2)],
            ]
            shapes = [s for s in shapes if sum(len(i.tokens) for i in s) <= rows]
            with self.fast.warming(steps):
                steps.warm_up(lambda: [self.forward(s) for s in shapes])
        except Exception as exc:  # noqa: BLE001 - any failure to compile leaves the eager forward serving
            log.warning("compiling the forward failed, serving eager: %s: %s", type(exc).__name__, exc)
            return None, f"eager (compile failed: {type(exc).__name__})"
        log.info(
            "compiled the forward's steps of <= %d rows: %d step shapes in %.1f s (compiled ahead of time: %s)",
            rows,
            len(shapes),
            time.perf_counter() - start,
            ", ".join(steps.kept_kinds()) or "none",
        )
        parts = [f"steps of <= {rows} rows"] + ["one call per step"] * steps.whole_steps
        parts += ["specstream's attention kernel"] * steps.math.attention_kernel
        return steps, f"compiled ({'; '.join(parts)})"

    @property
    def compiling(self) -> bool:
        """Whether a background compile has not been installed yet."""
        return self._pending is not None

    def install_compiled(self, wait: bool = False) -> str | None:
        """From the thread that runs steps, between two steps: install a finished background compile and
        free its scratch blocks. Returns the forward's description once installed (None: nothing changed).
        wait: wait for the compile to finish first."""
        pending = self._pending
        if pending is None or pending.thread is None:
            return None
        if wait:
            pending.thread.join()
        if pending.thread.is_alive():
            return None
        self._pending = None
        for t in pending.tables:
            self.pool.free(t)
        steps, description = pending.result or (None, "eager (compile failed: the compiling thread died)")
        self.fast.steps = steps
        log.info("the forward runs %s from now on", description)
        return description

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem], aux_layers: tuple[int, ...] = ()):
        """Run the model; return float32 logits [sum(num_logits), vocab] in item order. With
        aux_layers, return (logits, aux): aux [sum(len(tokens)), len(aux_layers) * hidden]
        is the residual stream entering those layers for every new token (a draft head's
        input), taken from the same pass."""
        input_ids, pos, ctx, keep_idx = pack(self.pool, items, self.tile)
        dev = self.device
        if self.fast is not None:
            return self.fast(input_ids, pos, ctx, keep_idx, aux_layers)
        out = _modules_forward(self.model, input_ids, pos, ctx, keep_idx, bool(aux_layers))
        logits = out.logits[0].float()
        if not aux_layers:
            return logits
        # hidden_states[i] is the input of layer i.
        return logits, torch.cat([out.hidden_states[i][0] for i in aux_layers], dim=-1).to(dev)


def _modules_forward(model, input_ids, pos, ctx: StepContext, keep_idx, hidden_states: bool = False):
    """One packed step through transformers' own modules, attending through ctx."""
    with step_context(ctx):
        return model(
            input_ids=input_ids[None],
            position_ids=pos[None],
            use_cache=False,
            logits_to_keep=keep_idx,
            # Only when asked: the model hands its kwargs down to the attention function.
            **({"output_hidden_states": True} if hidden_states else {}),
        )


def layer_windows(model) -> list[int | None]:
    """Each layer's sliding window (None: the whole context) as the model's attention asks for it,
    recorded from one 2-token forward through transformers' modules over a scratch pool. The KV
    pool is laid out from these (kv.py); a layer that later asks for more than its group keeps is
    refused by attention.attend."""
    num_layers, kv_heads, head_dim = model_geometry(model.config)
    if fast_llama.supports(model):
        return [None] * num_layers  # the lean forward attends the whole context
    weight = next(model.parameters())
    pool = KVPool(num_layers, kv_heads, head_dim, 2, 2, weight.dtype, weight.device)
    table = pool.new_table()
    pool.reserve(table, 2)
    input_ids, pos, ctx, keep_idx = pack(pool, [ForwardItem(table, 0, [0, 0], 1)])
    ctx.windows = {}
    with torch.inference_mode():
        _modules_forward(model, input_ids, pos, ctx, keep_idx)
    return [ctx.windows.get(i) for i in range(num_layers)]


def pack(
    pool: KVPool, items: list[ForwardItem], q_tile: int = 0
) -> tuple[torch.Tensor, torch.Tensor, StepContext, torch.Tensor]:
    """Concatenate the items' new tokens into one packed step over pool: (input_ids [T],
    positions [T], the attention context, rows whose logits are wanted). With q_tile, each
    sequence's query rows are padded to a multiple of it (attention then runs per tile).

    The indexes are built in NumPy and become tensors once each: a step packs every sequence's
    slots, and a few small torch ops per sequence cost more than the NumPy ones."""
    dev = pool.device
    num_groups = len(pool.groups)
    input_ids: list[int] = []
    lengths = [len(item.tokens) for item in items]
    offsets = np.cumsum([0, *lengths[:-1]], dtype=np.int64)
    positions = [item.positions() for item in items]
    # [layer group][item]: the pool slots of all its positions (the new tokens' are the last len(tokens))
    kv_slots: list[list[np.ndarray]] = [[] for _ in range(num_groups)]
    keep = []
    for item, n, offset in zip(items, lengths, offsets):
        input_ids.extend(item.tokens)
        for g in range(num_groups):
            kv_slots[g].append(pool.slot_array(item.table, 0, item.start + n, g))
        if item.num_logits:
            keep.append(np.arange(offset + n - item.num_logits, offset + n, dtype=np.int64))
    # Decode and verification runs attend apart from prefill chunks (see AttentionGroup).
    short = [i for i, n in enumerate(lengths) if n <= SHORT_RUN]
    long = [i for i, n in enumerate(lengths) if n > SHORT_RUN]
    members = [g for g in (short, long) if g]
    if len(members) == 2 and len(long) * len(short) <= 1:
        members = [list(range(len(items)))]  # nothing to gain from splitting
    groups = [
        _group(
            [[slots[i] for i in m] for slots in kv_slots],
            [lengths[i] for i in m],
            offsets[m],
            [items[i] for i in m],
            [positions[i] for i in m],
            q_tile,
            dev,
        )
        for m in members
    ]
    slot_mappings = [_tensor(np.concatenate([s[item.start :] for s, item in zip(slots, items)]), dev) for slots in kv_slots]
    ctx = StepContext(pool=pool, slot_mappings=slot_mappings, groups=groups, q_tile=q_tile)
    keep_idx = _tensor(np.concatenate(keep), dev) if keep else torch.zeros(0, dtype=torch.long, device=dev)
    return torch.tensor(input_ids, device=dev), _tensor(np.concatenate(positions), dev), ctx, keep_idx


def _tensor(array: np.ndarray, dev) -> torch.Tensor:
    return torch.from_numpy(array).to(dev)


def _group(
    kv_slots: list[list[np.ndarray]],
    lengths: list[int],
    offsets: np.ndarray,
    items: list[ForwardItem],
    positions: list[np.ndarray],
    q_tile: int,
    dev,
) -> AttentionGroup:
    """The padded attention layout of some of a step's sequences (kv_slots: per KV layer group, each
    sequence's slots; lengths and offsets: each one's new tokens and where they start in the packed step).
    A group holding a draft tree gets its full-context mask here: causal by position, and within each
    tree's own rows, its ancestry."""
    batch = len(lengths)
    t_max, s_max = max(lengths), max(len(s) for s in kv_slots[0])
    if q_tile:
        # Whole tiles of queries, and keys padded (masked) to a multiple of _KEY_BLOCK, so no real key
        # falls in a kernel's remainder loop, whose summation order differs from its main loop's.
        t_max += -t_max % q_tile
        s_max += -s_max % _KEY_BLOCK
    kv_indexes = []
    for slots_of in kv_slots:
        kv_index = np.zeros((batch, s_max), dtype=np.int64)
        for i, slots in enumerate(slots_of):
            kv_index[i, : len(slots)] = slots
        kv_indexes.append(_tensor(kv_index, dev))
    span = np.arange(t_max, dtype=np.int64)
    runs = [offset + span[:n] for n, offset in zip(lengths, offsets)]  # each sequence's packed rows
    q_index = np.zeros((batch, t_max), dtype=np.int64)
    for i, run in enumerate(runs):
        q_index[i, : len(run)] = run
    out_index = np.concatenate([i * t_max + span[:n] for i, n in enumerate(lengths)])
    rows = np.concatenate(runs)
    q_pos = np.array([item.start for item in items], dtype=np.int64)[:, None] + span[None, :]
    tree_mask = None
    if any(item.parents is not None for item in items):
        for i, item in enumerate(items):
            if item.parents is not None:
                q_pos[i, : len(item.tokens)] = positions[i]  # pack's: each tree token at its depth
        mask = np.arange(s_max)[None, None, :] <= q_pos[:, :, None]  # [B, T_max, S_max]
        for i, item in enumerate(items):
            if item.parents is not None:
                n = len(item.tokens)
                mask[i, :n, item.start : item.start + n] = item.ancestry()
        tree_mask = _tensor(mask, dev)[:, None]  # a torch view: its strides are what the kept functions were traced with
    return AttentionGroup(
        kv_indexes=kv_indexes,
        q_index=_tensor(q_index, dev),
        out_index=_tensor(out_index, dev),
        rows=_tensor(rows, dev),
        q_pos=_tensor(q_pos, dev),
        tree_mask=tree_mask,
    )
