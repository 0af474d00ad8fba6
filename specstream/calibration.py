"""What start-up measures on this machine, and where it is kept between starts.

Three things are timed: the target's forward time by step size (a CostModel, which prices every
draft), the kernel routes (kernels/routes.py: up to how many rows the packed kernel beats the
dense GEMM, per weight shape), and a draft model's or draft head's step (measured each start:
they take milliseconds). Each is measured on throwaway sequences whose KV is freed after.

One key scheme (cache_file): a kept measurement is named by everything a timing depends on:
the weights (only models held in specstream's own content-keyed cache qualify), dtype, device
and processor, threads, torch, plus what the caller adds (kernels, step sizes, invariant mode).
One rule for measuring again: a kept file is used while its key matches and it parses; the
forward-time curve is also checked against a one-token step timed now (TOLERANCE), since it is
the one kept figure that a busy spell during its measurement skews into wrong decisions (routes
compare two kernels timed alike, so load skews both). Delete the directory to measure all again.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from specstream.cache import cache_dir, load_json, processor_name, save_json
from specstream.memory.kv import KVPool
from specstream.model.fast_llama import COMPILED_MAX_RUN
from specstream.model.loader import ModelSource, converted_source
from specstream.model.runner import ForwardItem, ModelRunner

log = logging.getLogger(__name__)

# How far a one-token step timed at start may be from the kept curve's before it is measured again
# (repeated timings of one step vary by about a tenth).
TOLERANCE = 0.15
# Cached tokens the forward-time curve is timed over.
CONTEXT = 64
# How the curve is timed, in its kept file's key: a curve kept by an earlier way of timing is timed again
# ("sweeps": each repeat sweeps every size, CostModel.measure; "largest first": each size right after the next
# larger one, not the one-token step right after the largest, which it then paid for; "every row's logits":
# steps are timed as verifications, time_steps. docs/MEASUREMENTS.md has the figures.)
TIMING = "sweeps largest first, every row's logits, wide steps over sequences"
_STEP_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
# A step's cost jumps past each multiple of ROW_TILE rows (the AMX kernels multiply tiles of 16 rows: a 17th or a
# 33rd row costs a tile's work more, though it adds one row's tokens) and past the compiled steps' limit (the
# rest runs eager). Interpolated between sizes on either side, a draft that takes a step of many streams past
# one was priced at a small share of what it adds; the curve is timed on both sides of each, up to TILED_UPTO.
ROW_TILE = 16
TILED_UPTO = 64
# Steps of more rows than one sequence's compiled run (COMPILED_MAX_RUN) are timed as the engine meets them:
# several sequences' short runs, WIDE_RUN rows each (decoding sequences with a draft each), over at most
# WIDE_SEQS sequences. Timed as one sequence's run, such a step ran eager and attended one context: the
# curve priced a step of many streams, compiled or not, at one long chain's cost.
WIDE_RUN = 2
WIDE_SEQS = 32
FILL_TABLES = 8  # tables whose context one forward fills before timing
# A curve that prices a step of two tokens above SUSPECT_RATIO times a one-token step is suspect: a busy
# spell while it was timed may have priced its small sizes high, and then no draft pays (a fresh sequence's
# first draft, accepted half the time by the prior, pays only below 1.5x), so the policy never runs the
# steps that would show the online correction its error. While it stays suspect, an idle server times its
# sizes up to REFINE_UPTO again, at most once every REFINE_EVERY seconds, and keeps each size's faster time
# (CostModel.refine; engine.Engine.idle).
SUSPECT_RATIO = 1.3
REFINE_UPTO = 8
REFINE_EVERY = 60.0


# Online correction (CostModel.observe): how far one observed step moves the curve toward it (a fraction
# of the log-ratio), and the largest log-ratio one step may count with (a step that compiled a new shape,
# or was descheduled, says little about the next ones). The correction is one factor for the whole curve
# (the machine's speed now), learned at ONLINE_RATE, and a factor per timed size for the curve's shape,
# learned slower and bounded by SHAPE_BOUND: drafting decisions compare step sizes, so a wrong shape
# that stopped all drafting would never see the larger steps again to correct itself.
ONLINE_RATE = 0.1
SHAPE_RATE = 0.03
ONLINE_CLIP = math.log(3.0)
SHAPE_BOUND = math.log(1.5)


class CostModel:
    """Piecewise-linear forward time (seconds) as a function of the step's token count, as timed, times a
    correction learned online from the steps the engine runs (observe): the curve follows the machine as
    it is now (a busy spell while it was timed, replicas sharing the node, noisy neighbours)."""

    def __init__(self, tokens: list[int], seconds: list[float]) -> None:
        self.tokens = list(tokens)
        self.stale = False  # a kept curve scaled to one step timed now, to be measured again (forward_cost)
        # A forward over more tokens never costs less; smooth out timing noise.
        self.seconds = []
        for s in seconds:
            self.seconds.append(max(s, self.seconds[-1]) if self.seconds else s)
        self.log_speed = 0.0  # the online correction of the whole curve, in log
        # and of its shape at each timed size, in log: learned from the steps near that size once there is one
        # (seen); until then, the next smaller size's correction (effective, with the monotone floor: _shape)
        self.log_scale = [0.0] * len(self.tokens)
        self.seen = [False] * len(self.tokens)
        self.effective = [0.0] * len(self.tokens)
        self.observed = 0  # steps observed

    def timed(self, n: float) -> float:
        """The curve as timed, without the online correction."""
        t, s = self.tokens, self.seconds
        if len(t) == 1:
            return s[0] * max(n, 1) / t[0]
        i = min(max(bisect.bisect_left(t, n), 1), len(t) - 1)
        slope = (s[i] - s[i - 1]) / (t[i] - t[i - 1])
        return max(s[i - 1] + slope * (n - t[i - 1]), 1e-9)

    def _weights(self, n: float) -> list[tuple[int, float]]:
        """The timed sizes around n and their linear weights (the nearest one past either end)."""
        t = self.tokens
        if n <= t[0] or len(t) == 1:
            return [(0, 1.0)]
        if n >= t[-1]:
            return [(len(t) - 1, 1.0)]
        i = bisect.bisect_left(t, n)
        w = (n - t[i - 1]) / (t[i] - t[i - 1])
        return [(i - 1, 1.0 - w), (i, w)]

    def __call__(self, n: float) -> float:
        if not self.observed:
            return self.timed(n)
        return self.timed(n) * math.exp(self.log_speed + sum(w * self.effective[j] for j, w in self._weights(n)))

    def observe(self, n: int, seconds: float) -> None:
        """A step over n tokens took `seconds`: move the curve toward it (mostly as a whole, a little near n)."""
        if n < 1 or not seconds > 0 or not math.isfinite(seconds):
            return
        error = min(max(math.log(seconds / self(n)), -ONLINE_CLIP), ONLINE_CLIP)
        self.log_speed += ONLINE_RATE * error
        for j, w in self._weights(n):
            if w > 0 and not self.seen[j]:  # its first step: it starts from the correction it was priced with
                self.seen[j], self.log_scale[j] = True, self.effective[j]
            self.log_scale[j] = min(max(self.log_scale[j] + SHAPE_RATE * w * error, -SHAPE_BOUND), SHAPE_BOUND)
        self._shape()
        self.observed += 1

    def _shape(self) -> None:
        """The correction each size is priced with. A size no step has come near takes the next smaller size's:
        the curve keeps its timed shape above the sizes the engine runs. (Floored at the smaller size's price
        instead, a size above a few hundred steps of 32 rows that ran slower than timed was priced as the 32-row
        step, and the 33rd row, the start of a third pass of the tiled kernels, looked free.) And a forward over
        more tokens never costs less, corrected too: each size's own correction, learned from the steps near it
        (whose prefill chunks and sequences vary), may not price it below a smaller size, or rows added past it
        would look free, and more of them cheaper than fewer."""
        for j in range(len(self.tokens)):
            own = self.log_scale[j] if self.seen[j] or not j else self.effective[j - 1]
            floor = self.effective[j - 1] + math.log(self.seconds[j - 1] / self.seconds[j]) if j else -math.inf
            self.effective[j] = max(own, floor)

    def suspect(self) -> bool:
        """Whether the curve as timed prices a second token above SUSPECT_RATIO times a one-token step."""
        return self.tokens[0] == 1 and len(self.tokens) > 1 and self.timed(2) > SUSPECT_RATIO * self.timed(1)

    def refine(self, fresh: CostModel) -> bool:
        """Lower each timed size that `fresh` timed faster to its time (timing noise only ever adds time);
        whether any moved. The online correction is kept."""
        moved = False
        for n, seconds in zip(fresh.tokens, fresh.seconds):
            if n in self.tokens and seconds < self.seconds[self.tokens.index(n)]:
                self.seconds[self.tokens.index(n)] = seconds
                moved = True
        for j in range(1, len(self.seconds)):  # a forward over more tokens never costs less
            self.seconds[j] = max(self.seconds[j], self.seconds[j - 1])
        self._shape()
        return moved

    def save(self, path: Path) -> None:
        save_json(path, {"tokens": self.tokens, "seconds": self.seconds})

    @classmethod
    def load(cls, path: Path) -> CostModel | None:
        """A saved curve, or None when there is none or it is not one."""
        data = load_json(path)
        try:
            tokens, seconds = [int(t) for t in data["tokens"]], [float(x) for x in data["seconds"]]
        except (ValueError, KeyError, TypeError):
            return None
        if not tokens or len(tokens) != len(seconds) or min(seconds) <= 0 or tokens != sorted(tokens):
            return None
        return cls(tokens, seconds)

    @classmethod
    def measure(cls, run: Callable[[int], None], sizes: list[int], repeats: int = 3) -> CostModel:
        """Time run(n) (one forward over n tokens, or one step over n sequences) for each n; the fastest
        of repeats, since timing noise (other processes, page faults) only ever adds time. The repeats are
        sweeps over all the sizes, not runs of one size in a row: a busy spell of a second or two then
        slows one repeat of several sizes, not every repeat of one size. (Run back to back, one spell
        could price every repeat of the 2-token step high: above 1.5x a one-token step, a first draft
        expected to be accepted half the time never pays, and a one-stream server that stops drafting never
        runs the steps that would show the curve its error.) Each sweep runs the sizes largest first, so that
        every step follows one of about its own size, as a server's steps do: a small step right after a much
        larger one runs slower for a few steps (seen on a Xeon with a large shared cache), and a curve timed
        smallest first priced the one-token step high and every draft row below what it adds in a steady
        run (docs/MEASUREMENTS.md: "Steps timed as a server runs them")."""
        order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
        run(sizes[order[0]])  # warm-up
        times = [math.inf] * len(sizes)
        for _ in range(repeats):
            for i in order:
                start = time.perf_counter()
                run(sizes[i])
                times[i] = min(times[i], time.perf_counter() - start)
        return cls(sizes, times)


# ------------------------------------------------------------------------ kept files
def cache_file(kind: str, source: ModelSource, dtype: torch.dtype, device: torch.device, key: list) -> Path | None:
    """Where a measurement of `kind` is kept: only for models that specstream holds in its own
    content-keyed cache (the bundled model, any GGUF file), so the file names exactly these weights;
    keyed by everything else a timing depends on, and by `key`."""
    models = (cache_dir() / "models").resolve()
    path = Path(converted_source(source).path).resolve()
    if models not in path.parents:
        return None
    full = json.dumps(
        [kind, path.name, str(dtype), str(device), processor_name(device), torch.get_num_threads(),
         torch.__version__, *key]
    )
    return cache_dir() / "calibration" / f"{kind}-{hashlib.sha256(full.encode()).hexdigest()[:32]}.json"


# ------------------------------------------------------------------------ timing
@contextmanager
def throwaway_tables(pool: KVPool, count: int, length: int) -> Iterator[list[list[int]]]:
    """Up to count block tables of length positions each, freed on exit: timing never keeps KV."""
    tables: list[list[int]] = []
    try:
        for _ in range(count):
            table = pool.new_table()
            if not pool.reserve(table, length):
                pool.free(table)
                break
            tables.append(table)
        yield tables
    finally:
        for table in tables:
            pool.free(table)


def plan(max_batched_tokens: int, capacity: int, compiled: int = 0) -> tuple[list[int], int]:
    """The step sizes the forward-time curve is timed at, and the context (cached tokens) they are
    timed over, in a pool of `capacity` positions. compiled: the most rows a step runs compiled (0: none
    does). The curve is timed on both sides of each jump in a step's cost (ROW_TILE's multiples up to
    TILED_UPTO, the compiled steps' limit): interpolated over one, a draft that takes a step past it was
    priced at a few percent of its cost (a 17th row at the 16th's, where it costs about as much as eight)."""
    top = max(max_batched_tokens, 1)
    sizes = {n for n in _STEP_SIZES if n <= top} | {min(top, 128)}
    edges = set(range(ROW_TILE, min(top, TILED_UPTO) + 1, ROW_TILE)) | ({compiled} if compiled > 0 else set())
    sizes |= {n for edge in edges if edge < top for n in (edge, edge + 1)}
    sizes = sorted(sizes)
    return sizes, min(CONTEXT, capacity - sizes[-1])


def compiled_rows(runner: ModelRunner) -> int:
    """The most rows a step may have and run compiled in runner's forward as it serves now (0: none): a step of
    several sequences' short runs (what time_steps times past COMPILED_MAX_RUN rows)."""
    fast = getattr(runner, "fast", None)
    return fast.compiled_rows if fast is not None and fast.steps is not None else 0


def wide_seqs(n: int) -> int:
    """The sequences a step of n rows is timed over (step_items): one up to COMPILED_MAX_RUN rows, past that
    enough for runs of WIDE_RUN rows, at most WIDE_SEQS."""
    return min(-(-n // WIDE_RUN), WIDE_SEQS) if n > COMPILED_MAX_RUN else 1


def step_items(tables: list[list[int]], context: int, n: int) -> list[ForwardItem]:
    """A step of n rows over `context` cached tokens of each table, as the engine's steps hold them: one
    sequence's run up to COMPILED_MAX_RUN rows; past that, several sequences' runs of WIDE_RUN rows (as evenly
    as they split, wide_seqs) where there are tables enough, else the first table's alone. Every row keeps its
    logits, as a verification does."""
    seqs = wide_seqs(n)
    if seqs == 1 or len(tables) < seqs:
        return [ForwardItem(tables[0], context, [0] * n, n)]
    runs = [n // seqs + (i < n % seqs) for i in range(seqs)]
    return [ForwardItem(table, context, [0] * run, run) for table, run in zip(tables, runs)]


def time_steps(runner: ModelRunner, sizes: list[int], context: int, repeats: int = 3) -> CostModel | None:
    """Steps of each size over `context` cached tokens (step_items: one sequence's, or past COMPILED_MAX_RUN rows
    several sequences', where the pool holds them), timed; None where the pool cannot hold one. Each step keeps
    every row's logits, as a verification does: a draft's price is what its row adds, through the layers and the
    LM head (timed with one row's logits, as a prefill chunk keeps, a draft row was priced without its LM-head
    pass; the README has the figures)."""
    if context < 0:
        return None
    largest = max(sizes, default=0)
    seqs = wide_seqs(largest)
    with throwaway_tables(runner.pool, 1, context + largest) as first:
        if not first:
            return None
        with throwaway_tables(runner.pool, seqs - 1, context + -(-largest // seqs)) as more:
            tables = first + more
            if context:
                for i in range(0, len(tables), FILL_TABLES):
                    runner.forward([ForwardItem(table, 0, [0] * context, 1) for table in tables[i : i + FILL_TABLES]])
            return CostModel.measure(lambda n: runner.forward(step_items(tables, context, n)), sizes, repeats)


def refine_small_sizes(runner: ModelRunner, max_batched_tokens: int, cost: CostModel) -> bool:
    """Time cost's sizes up to REFINE_UPTO again, as forward_cost timed them, and keep each size's faster time
    (CostModel.refine); whether the curve moved."""
    sizes, context = plan(max_batched_tokens, runner.pool.capacity, compiled_rows(runner))
    fresh = time_steps(runner, [n for n in sizes if n <= REFINE_UPTO], context)
    return fresh is not None and cost.refine(fresh)


def forward_cost(runner: ModelRunner, max_batched_tokens: int, kept: Path | None = None, later: bool = False) -> CostModel:
    """The runner's forward time by step size. With a kept file, the curve an earlier start measured is
    read from it once a one-token step timed now agrees with it (TOLERANCE); else it is measured, and
    kept. later: where they disagree, return the kept curve scaled to the step timed now, marked stale,
    for the caller to measure when it has the time (a server, once idle), rather than measure it now."""
    sizes, context = plan(max_batched_tokens, runner.pool.capacity, compiled_rows(runner))
    if (cost := CostModel.load(kept) if kept is not None else None) is not None:
        now = time_steps(runner, [1], context, repeats=5)
        if now is None or abs(now(1) / cost(1) - 1.0) <= TOLERANCE:
            return cost
        log.info(
            "a one-token step takes %.2f ms now, %.2f ms in the kept forward-time curve: measuring it again%s",
            1e3 * now(1),
            1e3 * cost(1),
            " once idle (until then the kept curve, scaled)" if later else "",
        )
        if later:
            scaled = CostModel(cost.tokens, [s * now(1) / cost(1) for s in cost.seconds])
            scaled.stale = True
            return scaled
    cost = time_steps(runner, sizes, context) or CostModel([1], [1.0])
    if kept is not None:
        cost.save(kept)
    return cost
