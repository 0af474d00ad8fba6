"""Which kernel serves how many rows: per weight shape, the packed kernel up to the row count where it
stops beating the dense GEMM, timed at start-up and kept (calibration.py) so a restart serves the same
kernels, and so the same rounding, as the start before it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specstream.cache import load_json, save_json
from specstream.kernels.quant import Linear, LinearFactory

# Rows per call at which the kernels are compared; the step sizes of decoding, verification and prefill.
_PROBE_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)
# A dense copy is kept only while all copies together take at most this share of the free memory.
_DENSE_MEMORY_SHARE = 0.25
# The packed kernel's range ends where the dense GEMM wins at this many probes in a row: one timing taken
# while something else ran would otherwise end it early, and a restart would keep that route for good.
_LOSSES_TO_END = 2
# How routes are timed: part of a kept routes file's key, so that files timed under an older rule are timed again.
RULE = 2

log = logging.getLogger(__name__)


@dataclass
class KernelChoice:
    shape: tuple[int, int]
    max_packed_rows: int
    keeps_dense: bool


def _faster_packed(group: list[Linear], x: torch.Tensor, repeats: int = 3) -> bool:
    """Whether the packed kernel beats the dense GEMM on x, for a group of projections of one shape.

    Each timing runs x through every projection of the group in turn, as a forward does: a weight is read
    from memory, not from the cache a repeated call on one weight would find it in (a 3072x576 bf16 copy
    fills a core's L2, and timed hot it looks much faster than it serves in a forward). The fastest
    of interleaved runs counts, since noise from other processes only ever adds time, and interleaving
    spreads it over both alike."""

    def packed() -> None:
        for lin in group:
            lin.packed(x)

    def dense() -> None:
        for lin in group:
            F.linear(x, lin.dense)

    group[0].packed(x), F.linear(x, group[0].dense)
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, fn in enumerate((packed, dense)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0] <= best[1]


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def choose_kernels(
    linears: list[Linear],
    max_rows: int,
    dtype: torch.dtype,
    device: torch.device,
    timed: bool = True,
    routes: dict[str, int] | None = None,
    floors: dict[tuple[int, int], int] | None = None,
) -> list[KernelChoice]:
    """For each weight shape, time the packed kernel against the dense GEMM at growing row counts (the
    fastest of a few runs, interleaved) and route to the packed kernel up to the last count where it wins
    before the dense GEMM wins _LOSSES_TO_END counts in a row.
    A dense copy is dropped where it never wins or does not fit in memory. timed=False routes every call
    to the packed kernel without timing anything, so the route, and the rounding, is the same on every
    start (invariant mode: timings differ between starts, and so would the kernels chosen). routes maps
    "NxK" to a limit timed by an earlier start (load_routes): those shapes are not timed again. floors maps a
    shape to the fewest rows its packed range covers where timing (or a kept route) would end it earlier."""
    by_shape: dict[tuple[int, int], list[Linear]] = {}
    for lin in linears:
        if lin.packed is not None:
            by_shape.setdefault(lin.shape, []).append(lin)
    probes = [r for r in _PROBE_ROWS if r <= max_rows] or [1]
    budget = _free_memory(device) * _DENSE_MEMORY_SHARE
    choices = []
    for shape, group in sorted(by_shape.items(), key=lambda item: -len(item[1]) * item[0][0] * item[0][1]):
        saved = (routes or {}).get(_shape_key(shape))
        # a8 serves every call, untimed: its rows are computed alone (integer sums are exact), so a token's
        # logits do not depend on how many rows its step held; the dense GEMM's rounding would. The price is
        # prefill: the dense GEMM is faster from about 128 rows (a 1024-token prefill measured 951 ms on a8
        # against 832 ms with the dense route). No dense copy is kept.
        every = group[0].packed.kernel[0] == "a8"
        timed_here = timed and not every
        limit = 0 if timed_here else probes[-1]
        losses = 0
        for rows in probes if timed_here and saved is None else []:
            if _faster_packed(group, torch.randn(rows, shape[1], dtype=dtype, device=device)):
                limit, losses = rows, 0
            elif (losses := losses + 1) == _LOSSES_TO_END:
                break
        if timed_here and saved is not None:
            limit = min(saved, probes[-1])
        if timed_here and limit and (floors or {}).get(shape):
            limit = max(limit, min(floors[shape], probes[-1]))
        dense_bytes = sum(lin.dense.nbytes for lin in group)
        keep = limit < probes[-1] and (limit == 0 or dense_bytes <= budget)
        if keep:
            budget -= dense_bytes
        else:
            limit = 1 << 30
        for lin in group:
            lin.max_packed_rows = limit
            if limit == 0:
                lin.packed = None  # the packed kernel never wins here (e.g. torch's scalar float32 int4 path)
            if not keep:
                lin.dense = None
        choices.append(KernelChoice(shape, limit, keep))
    return choices


def settle(
    factory: LinearFactory,
    model,
    max_rows: int,
    timed: bool = True,
    routes_file: Path | None = None,
    floors: dict[tuple[int, int], int] | None = None,
) -> list[KernelChoice]:
    """Measure the kernels for each shape (see choose_kernels for timed), then free the dense weights no
    projection reads any more. With routes_file, the routes an earlier start timed are read from it (and
    the ones timed now written to it): a restart skips the timing and serves the same kernels, so the
    same bf16 rounding, as the start before it. floors: as choose_kernels takes them."""
    routes = load_routes(routes_file) if timed and routes_file else None
    choices = choose_kernels(factory.quantized, max_rows, factory.dtype, factory.device, timed, routes, floors)
    factory.release_unused(model)
    # Shapes the kept file did not name (none, where there was no file) were timed now: kept beside its others,
    # so that the next start times nothing.
    timed_now = {_shape_key(c.shape): c.max_packed_rows for c in choices if _shape_key(c.shape) not in (routes or {})}
    if timed and routes_file and (routes is None or timed_now):
        save_routes(routes_file, {**(routes or {}), **timed_now})
    return choices


def _shape_key(shape: tuple[int, int]) -> str:
    """A weight shape as the routes file names it: "NxK"."""
    return f"{shape[0]}x{shape[1]}"


def load_routes(path: Path) -> dict[str, int] | None:
    routes = load_json(path)
    ok = isinstance(routes, dict) and all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in routes.items())
    return routes if ok else None


def save_routes(path: Path, routes: dict[str, int]) -> None:
    save_json(path, routes)


def describe(factory: LinearFactory, choices: list[KernelChoice]) -> str:
    bits = {lin.packed.bits for lin in factory.built if lin.packed is not None}
    packed = sum(1 for lin in factory.built if lin.packed is not None)
    routes = ", ".join(
        f"{n}x{k}: " + ("dense only" if c.max_packed_rows == 0 else "packed only" if not c.keeps_dense
                         else f"packed <= {c.max_packed_rows} rows")
        for (n, k), c in ((c.shape, c) for c in choices)
    )
    size = sum(lin.nbytes() for lin in factory.built) / 2**20
    return (
        f"{factory.mode}: {packed} of {len(factory.built)} projections int{'/'.join(map(str, sorted(bits)))} "
        f"(kernels {', '.join(factory.kernel_kinds)}; {routes}); projections hold {size:.0f} MiB"
    )
