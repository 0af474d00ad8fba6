"""Forward time of the lean forward per quantization mode, side by side in one process (ABBA order),
at the step shapes that matter: a decode step (1 row), a verification (9 or 16 rows), a batch of 8 decodes
(8 rows), 8 streams verifying 2 drafts each (24 rows: past one pass of 16 AMX tile rows), a prefill chunk (256
rows), each over a 256-token context (--context). As the engine packs them, decode and verification rows all take
logits (the LM head runs at every row), a prefill chunk at its last row only. Each shape runs --lead-in untimed
steps (default 8), then --timed timed ones, one after another, as a server decoding or verifying steadily runs them; the table gives each shape's median step and the ratios of
the medians (the fastest step in brackets). A step right after another shape's is slower than in a steady run:
on a 2-core Xeon with AMX a decode step took 8.8-8.9 ms right after a 256-row prefill chunk and 6.3-7.6 ms
from the sixth decode step on.

    python benchmarks/quant_forward.py                         # bf16, modes none auto int4 (eager)
    python benchmarks/quant_forward.py --modes none auto --repeats 20
    python benchmarks/quant_forward.py --modes auto auto+compile int4 int4+compile   # the compiled forward
    python benchmarks/quant_forward.py --modes auto+compile+layers auto+compile   # a call per layer vs per step
    python benchmarks/quant_forward.py --modes auto+compile+torchops auto+compile   # torch's kernels vs
                                                                                   # specstream's CPU kernels
    python benchmarks/quant_forward.py --modes auto+compile --context 1024   # the steps over a longer cache
    python benchmarks/quant_forward.py --modes auto+compile --scattered   # each cache in blocks all over the pool
    python benchmarks/quant_forward.py --modes auto+compile --rows 2 3 4 --context 512   # one sequence's short
                                                      # verifications (a drafting step at one stream) beside decode
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from specstream import Engine, EngineConfig, SpeculativeConfig
from specstream.kernels import cpu as cpu_kernels
from specstream.model.runner import ForwardItem

CONTEXT = 256
SHAPES = {
    "decode 1 row": [1],
    "verify 9 rows": [9],
    "verify 16 rows": [16],
    "8 streams x 1 row": [1] * 8,
    "8 streams x 3 rows": [3] * 8,
    "prefill 256 rows": [256],
}


def items_for(rows: list[int], tables: list[list[int]], context: int = CONTEXT) -> list[ForwardItem]:
    """A step's items as the engine packs them, each after `context` cached tokens: logits at every row of a
    decode or verification (each draft is checked), at the last row of a prefill chunk."""
    return [ForwardItem(t, context, [7] * n, 1 if n >= 256 else n) for t, n in zip(tables, rows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["none", "auto", "int4"],
                    help="quantization modes, each eager or as MODE+compile (the compiled forward: one call per "
                         "step) or MODE+compile+layers (compiled, one call per layer: runner.compile(whole_steps=False)); "
                         "+torchops: torch's kernels only (int4 weights, attention), not specstream's CPU kernels")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--context", type=int, default=CONTEXT, help="tokens already in every sequence's cache")
    ap.add_argument("--lead-in", type=int, default=8,
                    help="untimed steps of a shape before its timed ones (0: the first is timed right after a step of "
                         "another shape, a prefill chunk's before the decode step; the CPU and its caches then carry "
                         "the other shape's state, which a server decoding steadily does not)")
    ap.add_argument("--timed", type=int, default=5, help="timed steps of a shape per repeat, one after another")
    ap.add_argument("--rows", nargs="+", type=int, default=None,
                    help="instead of the shapes above, one sequence's steps of these many rows (each checked: logits at "
                         "every row), beside the decode step")
    ap.add_argument("--scattered", action="store_true",
                    help="each sequence's cache in blocks drawn at random from the whole pool, as a server's are "
                         "after hours of requests coming and going (default: one run of consecutive blocks each, as a "
                         "fresh pool hands them out)")
    args = ap.parse_args()
    if not 1 <= args.context <= 2048:  # 8 sequences of it fit the default KV pool
        raise SystemExit("--context must be between 1 and 2048")
    if not 0 <= args.lead_in <= 50:
        raise SystemExit("--lead-in must be between 0 and 50")
    if not 1 <= args.timed <= 50:
        raise SystemExit("--timed must be between 1 and 50")
    if args.rows is not None and not all(2 <= n <= 64 for n in args.rows):
        raise SystemExit("--rows takes row counts between 2 and 64")
    shapes = SHAPES if args.rows is None else {"decode 1 row": [1], **{f"{n} rows": [n] for n in args.rows}}
    engines = {}
    for mode in args.modes:
        quantization, *options = mode.split("+")
        config = EngineConfig(dtype=args.dtype, quantization=quantization, compile=False,
                              speculative=SpeculativeConfig(method="off"))
        kernels, cpu_kernels._loaded = cpu_kernels._loaded, False if "torchops" in options else cpu_kernels._loaded
        engines[mode] = Engine(config)
        if "compile" in options:
            engines[mode].runner.compile(whole_steps="layers" not in options)
        cpu_kernels._loaded = kernels
    tables = {}
    for mode, engine in engines.items():
        tables[mode] = []
        spread = random.Random(0).sample(range(engine.pool.num_blocks), 8 * engine.pool.blocks_for(args.context + 256))
        for i in range(8):
            table: list[int] = []
            engine.pool.reserve(table, args.context + 256)
            if args.scattered:  # reserved as counted, then read from blocks spread over the pool (no other
                table[:] = spread[i * len(table):(i + 1) * len(table)]  # sequence uses this pool: none is shared)
            engine.runner.forward([ForwardItem(table, 0, [7] * args.context, 1)])
            tables[mode].append(table)
    steps: dict[tuple[str, str], list[float]] = {(m, s): [] for m in engines for s in shapes}
    order = list(engines)
    for r in range(args.repeats):
        for mode in order if r % 2 == 0 else order[::-1]:
            for shape, rows in shapes.items():
                items = items_for(rows, tables[mode], args.context)
                for _ in range(args.lead_in):  # as in serving, a step follows steps of its own shape
                    engines[mode].runner.forward(items)
                for _ in range(args.timed):
                    start = time.perf_counter()
                    engines[mode].runner.forward(items)
                    steps[mode, shape].append(time.perf_counter() - start)
    best = {key: statistics.median(times) for key, times in steps.items()}
    base = order[0]
    print(f"\n| forward, median ms (speed-up over {base}) [fastest] | " + " | ".join(shapes) + " |")
    print("|---" * (len(shapes) + 1) + "|")
    for mode in order:
        cells = [f"{best[mode, s] * 1e3:.1f} ({best[base, s] / best[mode, s]:.2f}x) [{min(steps[mode, s]) * 1e3:.1f}]"
                 for s in shapes]
        print(f"| {mode} | " + " | ".join(cells) + " |")
    print("\n| step cost / the same mode's decode step | " + " | ".join(list(shapes)[1:]) + " |")
    print("|---" * len(shapes) + "|")
    for mode in order:
        decode = best[mode, "decode 1 row"]
        print(f"| {mode} | " + " | ".join(f"{best[mode, s] / decode:.2f}x" for s in list(shapes)[1:]) + " |")
    print(f"\nCPU: {cpu_name()}; {torch.get_num_threads()} threads")


def cpu_name() -> str:
    """The CPU's model name and the flags that choose kernels here."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")
    l3 = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    size = l3.read_text().strip() if l3.exists() else ""
    cache = f", L3 {int(size[:-1]) // 1024} MiB" if size.endswith("K") and size[:-1].isdigit() else ""
    return f"{name} ({' '.join(f for f in wanted if f in flags)}{cache})"


if __name__ == "__main__":
    main()
