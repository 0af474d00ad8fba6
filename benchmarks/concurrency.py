"""Concurrency: 1, 4, 8 and 16 concurrent streams through AsyncEngine on the bundled model
(bf16, greedy), speculative (n-gram) vs plain at each level, in one run.

    .venv/bin/python benchmarks/concurrency.py             # ~10 min on 2 cores
    .venv/bin/python benchmarks/concurrency.py --max-tokens 32 --levels 1 4

Reports aggregate tokens/s, TTFT p50/p99, ITL p50/p99 (gap between consecutive chunks as
the client sees them) and TPOT (per-token time after the first). A last section measures
how a long prompt arriving mid-stream affects a running stream (chunked prefill).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from specstream import AsyncEngine, EngineConfig, SamplingParams, SpeculativeConfig

from gateway.bench.prompts import GROUNDED, OPEN_CHAT


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def one_stream(engine: AsyncEngine, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    times, tokens = [], 0
    async for chunk in engine.stream([{"role": "user", "content": prompt}], SamplingParams(max_tokens=max_tokens, temperature=0)):
        times.append(time.perf_counter())
        tokens += len(chunk.token_ids)
    ttft = times[0] - start
    gaps = [b - a for a, b in zip(times, times[1:])]
    tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else float("nan")
    return {"ttft": ttft, "gaps": gaps, "tokens": tokens, "tpot": tpot}


async def run_level(engine: AsyncEngine, prompts: list[str], n: int, max_tokens: int) -> tuple[list[dict], float]:
    chosen = [prompts[i % len(prompts)] for i in range(n)]
    start = time.perf_counter()
    results = await asyncio.gather(*(one_stream(engine, p, max_tokens) for p in chosen))
    return list(results), time.perf_counter() - start


def summarize(runs: list[tuple[list[dict], float]]) -> dict:
    """Pool repeated runs of one level: tokens over total wall time, pooled latencies."""
    results = [r for rs, _ in runs for r in rs]
    wall = sum(w for _, w in runs)
    gaps = [g for r in results for g in r["gaps"]]
    return {
        "tokens": sum(r["tokens"] for r in results),
        "tps": sum(r["tokens"] for r in results) / wall,
        "ttft50": pct([r["ttft"] for r in results], 50),
        "ttft99": pct([r["ttft"] for r in results], 99),
        "itl50": pct(gaps, 50),
        "itl99": pct(gaps, 99),
        "tpot": statistics.median(r["tpot"] for r in results),
    }


async def long_prompt_effect(engine: AsyncEngine, prompt_tokens: int) -> tuple[float, float]:
    """Max chunk gap of a running stream before and while a long prompt is prefilled."""
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    times = []
    long_done = asyncio.Event()

    async def runner():
        async for _ in engine.stream("Count from one to one hundred: one, two, three,", params):
            times.append(time.perf_counter())
            if long_done.is_set():
                return

    task = asyncio.create_task(runner())
    while len(times) < 10:
        await asyncio.sleep(0.01)
    before = max(b - a for a, b in zip(times, times[1:]))
    arrival = time.perf_counter()
    await engine.generate(list(range(1000, 1000 + prompt_tokens)), SamplingParams(max_tokens=1))
    long_done.set()
    await task
    during = [b - a for a, b in zip(times, times[1:]) if b > arrival]
    return before, max(during)


async def main_async(args) -> None:
    prompts = GROUNDED[:4] + OPEN_CHAT[:4]
    methods = ("off", "ngram")
    engines = {}
    for method in methods:
        cfg = EngineConfig(
            dtype="bfloat16",
            max_num_batched_tokens=args.max_batched_tokens,
            speculative=SpeculativeConfig(method=method, num_speculative_tokens=args.k),
        )
        engines[method] = await AsyncEngine(cfg).start()
        await engines[method].generate("Hi", SamplingParams(max_tokens=4))
    rows = {}
    try:
        for n in args.levels:
            runs = {m: [] for m in methods}
            # ABBA order: plain and speculative alternate, so drift in machine speed
            # during the run does not favour either.
            for rep in range(args.repeats):
                for method in methods if rep % 2 == 0 else methods[::-1]:
                    runs[method].append(await run_level(engines[method], prompts, n, args.max_tokens))
            for method in methods:
                rows[(method, n)] = summarize(runs[method])
                print(f"  {method:5} x{n:<2} {rows[(method, n)]['tps']:.1f} tok/s", flush=True)
        before, during = await long_prompt_effect(engines["ngram"], args.long_prompt)
    finally:
        for e in engines.values():
            await e.stop()

    base = rows[("off", args.levels[0])]["tps"]
    print(f"\n## Concurrent streams, greedy, up to {args.max_tokens} new tokens, bf16, {torch.get_num_threads()} threads\n")
    print("| streams | method | tok/s | vs 1-stream plain | spec vs plain | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | TPOT (ms) |")
    print("|---:|---|---:|---:|---:|---|---|---:|")
    for n in args.levels:
        for method in ("off", "ngram"):
            r = rows[(method, n)]
            vs_plain = r["tps"] / rows[("off", n)]["tps"]
            print(
                f"| {n} | {'plain' if method == 'off' else 'ngram'} | {r['tps']:.1f} | {r['tps'] / base:.2f}x | {vs_plain:.2f}x | "
                f"{r['ttft50'] * 1e3:.0f} / {r['ttft99'] * 1e3:.0f} | {r['itl50'] * 1e3:.0f} / {r['itl99'] * 1e3:.0f} | {r['tpot'] * 1e3:.0f} |"
            )
    print(
        f"\nChunked prefill: a {args.long_prompt}-token prompt arriving mid-stream "
        f"(max_num_batched_tokens={args.max_batched_tokens}) raised the running stream's largest "
        f"chunk gap from {before * 1e3:.0f} ms to {during * 1e3:.0f} ms."
    )
    print("\n## Goals")
    if 8 in args.levels:
        g = rows[("off", 8)]["tps"] / base
        print(f"- 8 streams >= 4x single-stream plain throughput: {g:.2f}x {'met' if g >= 4 else 'NOT met'}")
    worst = min(rows[("ngram", n)]["tps"] / rows[("off", n)]["tps"] for n in args.levels)
    print(f"- speculation never loses more than 5% to plain: worst {worst:.2f}x {'met' if worst >= 0.95 else 'NOT met'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--long-prompt", type=int, default=1500)
    ap.add_argument("--repeats", type=int, default=2, help="runs per level and method, in ABBA order")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
