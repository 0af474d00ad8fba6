"""specstream's CPU kernels (specstream/cpu_kernels.py) against the torch ops they replace, at the shapes of
the bundled model (SmolLM2-135M: 576 wide, 9 query heads over 3 key/value heads of 64), bf16, the threads
torch uses (2 here), best of N interleaved runs, weights and keys random but laid out as served.

- q4_linear vs torch's int4 kernel (_weight_int4pack_mm_for_cpu) on 4-bit block weights, per layer shape;
- q8_linear vs torch's int4 kernel on two 4-bit planes (how 8-bit blocks were served), and vs the dense bf16 GEMM
  (the route above the rows where q8_linear wins), the LM head's shape;
- a8_linear (x rounded to 8-bit blocks, integer dot products) vs q4_linear and q8_linear on the same blocks,
  with each one's cost at k rows over its cost at one row (what makes a verification cheap or dear);
- Q4_K (GGUF's super-blocks, most files users bring): the dense bf16 GEMM (how such weights were served before
  specstream read them) against q4_linear and a8_linear on the file's blocks, float32 scales, at a Llama 3.2 1B
  layer's shapes (Q4_K needs rows of whole 256-input super-blocks: the bundled model's 576 are not);
- where the CPU has AMX-BF16: q4_linear's and q8_linear's vector path (float32, or VDPBF16PS pairs) against their AMX
  tiles (TDPBF16PS), forced by path, at the same shapes;
- short_attention vs the torch ops of a short step's attention (gather, two matmuls, softmax), compiled
  with torch.compile as in the forward, over a paged pool; where the CPU has AMX-BF16, short_attention's
  vector path against its AMX tiles (the default there).

    python benchmarks/cpu_kernels.py
    python benchmarks/cpu_kernels.py --repeats 50 --rows 1 9 16
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from specstream.kernels import cpu as cpu_kernels
from specstream.model.attention import attend_short
from specstream.kernels.weights import Int4Weights, Int8Blocks, q4_k_weights
from specstream.kernels.quant import PackedA8, PackedInt4, PackedInt8Blocks, PackedQ4


def best_of(fns: list, repeats: int) -> list[float]:
    """Microseconds per call of each fn, the fastest of `repeats` interleaved runs."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return [b * 1e6 for b in best]


def random_int4(n: int, k: int, gen: torch.Generator) -> Int4Weights:
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
    mins = (-8 * scales + torch.randn(n, k // 32, generator=gen) * 1e-3).half().float()
    return Int4Weights(codes, scales, mins)


def random_q4_k(n: int, k: int, gen: torch.Generator) -> Int4Weights:
    """Q4_K super-blocks as a file holds them (random codes, 6-bit scales and minimums, float16 d and dmin), read
    as specstream reads them: blocks of 32 with float32 scales."""
    raw = torch.randint(0, 256, (n * k // 256, 144), generator=gen, dtype=torch.uint8)
    for start in (0, 2):
        d = (torch.rand(len(raw), generator=gen) * 2e-3 + 1e-4).half()
        raw[:, start : start + 2] = d.view(torch.uint8).view(-1, 2)
    return q4_k_weights(raw.view(n, -1).numpy())


def tile_paths(rows: list[int], repeats: int, gen: torch.Generator) -> None:
    """q4_linear and q8_linear on their vector path and on AMX-BF16 tiles (path 0 / 1), where the CPU has them."""
    if 1 not in torch.ops.specstream.q4_paths():
        print("(no AMX-BF16 here: the weight-only kernels' tile path is not compared)\n")
        return
    cpu = torch.device("cpu")
    print("| weight-only kernels, us (vector path / AMX tiles) | weight | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    shapes = [("q4_linear", n, k) for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536)]] + [("q8_linear", 49152, 576)]
    for kernel, n, k in shapes:
        if kernel == "q4_linear":
            p = PackedQ4(random_int4(n, k, gen), cpu)
            weights = (p.codes, p.scales, p.mins)
        else:
            p = PackedInt8Blocks(Int8Blocks(torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, k // 32, generator=gen) * 0.01), cpu)
            weights = (p.codes, p.scales)
        op = getattr(torch.ops.specstream, kernel)
        cells = []
        for r in rows:
            x = torch.randn(r, k, generator=gen).bfloat16()
            v, a = best_of([partial(op, x, *weights, 0), partial(op, x, *weights, 1)], repeats if kernel == "q4_linear" else max(3, repeats // 5))
            cells.append(f"{v:.0f} / {a:.0f} ({v / a:.2f}x)")
        print(f"| {kernel} | {n}x{k} | " + " | ".join(cells) + " |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 9, 16])
    args = ap.parse_args()
    if not cpu_kernels.load():
        raise SystemExit("specstream's CPU kernels did not build (is g++ installed?)")
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    print(f"threads: {torch.get_num_threads()}, bf16, best of {args.repeats}; us per call (torch / specstream)\n")
    tile_paths(args.rows, args.repeats, gen)
    print("| kernel | weight | " + " | ".join(f"{r} rows" for r in args.rows) + " |")
    print("|---|---|" + "---|" * len(args.rows))
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:
        weights = random_int4(n, k, gen)
        theirs, ours = PackedInt4(weights, torch.bfloat16, cpu), PackedQ4(weights, cpu)
        cells = []
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            t, o = best_of([partial(theirs, x), partial(ours, x)], args.repeats)
            cells.append(f"{t:.0f} / {o:.0f} ({t / o:.2f}x)")
        print(f"| q4_linear | {n}x{k} | " + " | ".join(cells) + " |")
    n, k = 49152, 576
    blocks = Int8Blocks(
        torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8),
        (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4).half().float(),
    )
    theirs, ours = PackedInt4(blocks.planes(), torch.bfloat16, cpu), PackedInt8Blocks(blocks, cpu)
    cells = []
    for rows in args.rows:
        x = torch.randn(rows, k, generator=gen).bfloat16()
        t, o = best_of([partial(theirs, x), partial(ours, x)], max(3, args.repeats // 5))
        cells.append(f"{t:.0f} / {o:.0f} ({t / o:.2f}x)")
    print(f"| q8_linear (two int4 planes) | {n}x{k} | " + " | ".join(cells) + " |")
    dense = blocks.dequantize().bfloat16()  # the route's other choice: the dense GEMM on a bf16 copy
    cells = []
    for rows in args.rows:
        x = torch.randn(rows, k, generator=gen).bfloat16()
        t, o = best_of([partial(torch.nn.functional.linear, x, dense), partial(ours, x)], max(3, args.repeats // 5))
        cells.append(f"{t:.0f} / {o:.0f} ({t / o:.2f}x)")
    print(f"| q8_linear (dense bf16 GEMM) | {n}x{k} | " + " | ".join(cells) + " |")

    print("\n| a8_linear vs weight-only, us (q4/q8_linear / a8_linear; cost over 1 row) | weight | "
          + " | ".join(f"{r} rows" for r in args.rows) + " |")
    print("|---|---|" + "---|" * len(args.rows))
    shapes = [(960, 576, 4), (576, 576, 4), (3072, 576, 4), (576, 1536, 4), (49152, 576, 8)]
    for n, k, bits in shapes:
        weights = random_int4(n, k, gen) if bits == 4 else blocks
        theirs = PackedQ4(weights, cpu) if bits == 4 else PackedInt8Blocks(weights, cpu)
        ours = PackedA8(weights, cpu)
        cells, first = [], None
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            t, o = best_of([partial(theirs, x), partial(ours, x)], args.repeats if bits == 4 else max(3, args.repeats // 5))
            first = first or (t, o)
            cells.append(f"{t:.0f} / {o:.0f} ({t / o:.2f}x; {t / first[0]:.1f} / {o / first[1]:.1f})")
        print(f"| {'q4' if bits == 4 else 'q8'}_linear / a8_linear | {n}x{k} | " + " | ".join(cells) + " |")

    print("\n| Q4_K, us (dense bf16 / q4_linear / a8_linear; over dense) | weight | "
          + " | ".join(f"{r} rows" for r in args.rows) + " |")
    print("|---|---|" + "---|" * len(args.rows))
    for n, k in [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]:  # qkv, o, gate+up, down
        weights = random_q4_k(n, k, gen)
        dense = weights.dequantize().bfloat16()
        q4, a8 = PackedQ4(weights, cpu), PackedA8(weights, cpu)
        cells = []
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            fns = [partial(torch.nn.functional.linear, x, dense), partial(q4, x), partial(a8, x)]
            d, q, a = best_of(fns, max(3, args.repeats // 3))
            cells.append(f"{d:.0f} / {q:.0f} / {a:.0f} ({d / q:.2f}x / {d / a:.2f}x)")
        print(f"| Q4_K | {n}x{k} | " + " | ".join(cells) + " |")

    attention(args.repeats, gen)


def attention(repeats: int, gen: torch.Generator) -> None:
    """short_attention against the torch version, then (AMX-BF16 CPUs) its vector path against its tiles."""
    slots, block = 23000, 16
    keys = torch.randn(slots, 3, 64, generator=gen).bfloat16()
    values = torch.randn(slots, 3, 64, generator=gen).bfloat16()
    torch_version = torch.compile(attend_short, dynamic=True)
    steps = [("decode, 1 sequence", 1, 1), ("verify 9 rows, 1 sequence", 1, 9), ("verify 16 rows, 1 sequence", 1, 16),
             ("decode, 8 sequences", 8, 1), ("verify 3 rows, 8 sequences", 8, 3)]
    tiles = 1 in torch.ops.specstream.short_attention_paths()
    for compare in ["torch"] + (["tiles"] if tiles else []):
        what = "torch / specstream" if compare == "torch" else "vector path / AMX tiles"
        print(f"\n| short_attention, 9 heads over 3 of 64, us ({what}) | context 256 | context 1024 |")
        print("|---|---|---|")
        for label, batch, run in steps:
            cells = []
            for context in (256, 1024):
                table = torch.randperm(slots // block, generator=gen)[: batch * context // block].view(batch, -1)
                kv_index = (table[:, :, None] * block + torch.arange(block)).view(batch, -1)
                n_rows = batch * run
                q_index = torch.arange(n_rows).view(batch, run)
                out_index = torch.arange(n_rows)
                positions = torch.arange(context)[None, :] <= (context - run + torch.arange(run))[:, None]
                mask = None if batch == 1 and run == 1 else positions[None, None].expand(batch, 1, run, context).contiguous()
                query = torch.randn(n_rows, 9, 64, generator=gen).bfloat16()
                if compare == "torch":
                    none = torch.empty(0, dtype=torch.long)
                    step = (keys, values, none, query, keys[:0], values[:0], kv_index, mask, q_index, out_index, 0.125)
                    fns = [partial(torch_version, *step), partial(attend_short, *step, kernel=True)]
                else:
                    step = (query, keys, values, kv_index, mask, q_index, out_index, 0.125)
                    fns = [partial(torch.ops.specstream.short_attention, *step, path) for path in (0, 1)]
                t, o = best_of(fns, repeats)
                cells.append(f"{t:.0f} / {o:.0f} ({t / o:.2f}x)")
            print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
