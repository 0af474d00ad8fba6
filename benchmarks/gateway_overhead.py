"""Gateway overhead: streaming tokens/s through HTTP (`specstream serve` in its own process,
read with httpx as SSE) vs the in-process AsyncEngine, same model, prompts and settings, in
one run. Runs alternate (HTTP, in-process, HTTP, ...) so drift hits both sides alike.

    .venv/bin/python benchmarks/gateway_overhead.py            # ~3 min on 2 cores
    .venv/bin/python benchmarks/gateway_overhead.py --concurrency 1 4 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import time

import httpx
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _servers import free_port, wait_up  # noqa: E402

from gateway.bench.prompts import GROUNDED, OPEN_CHAT  # noqa: E402
from specstream import AsyncEngine, EngineConfig, SamplingParams, SpeculativeConfig  # noqa: E402


async def http_stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> int:
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                payload = json.loads(line[6:])
                if payload.get("usage"):
                    tokens = payload["usage"]["completion_tokens"]
    return tokens


async def engine_stream(engine: AsyncEngine, prompt: str, max_tokens: int) -> int:
    tokens = 0
    async for chunk in engine.stream([{"role": "user", "content": prompt}], SamplingParams(max_tokens=max_tokens, temperature=0)):
        tokens += len(chunk.token_ids)
    return tokens


async def timed(make, prompts, concurrency: int) -> tuple[int, float]:
    start = time.perf_counter()
    total = 0
    for i in range(0, len(prompts), concurrency):
        total += sum(await asyncio.gather(*(make(p) for p in prompts[i : i + concurrency])))
    return total, time.perf_counter() - start


async def main_async(args) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--dtype", "bfloat16",
           "--num-speculative-tokens", str(args.k), "--log-level", "warning"]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
            await asyncio.to_thread(wait_up, f"http://127.0.0.1:{port}", server)
            cfg = EngineConfig(dtype="bfloat16", speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=args.k))
            async with AsyncEngine(cfg) as engine:
                prompts = (GROUNDED[:3] + OPEN_CHAT[:3]) * 2 if not args.quick else GROUNDED[:1] + OPEN_CHAT[:1]
                await http_stream(client, "Hi", 4)
                await engine_stream(engine, "Hi", 4)
                print(f"\n## Streaming through HTTP vs in-process AsyncEngine (bf16, ngram k<={args.k}, {args.max_tokens} tokens)\n")
                print("| concurrency | HTTP tok/s | in-process tok/s | HTTP / in-process |")
                print("|---:|---:|---:|---:|")
                for c in args.concurrency:
                    http_t = http_s = eng_t = eng_s = 0.0
                    for _ in range(args.rounds):
                        t, s = await timed(lambda p: http_stream(client, p, args.max_tokens), prompts, c)
                        http_t, http_s = http_t + t, http_s + s
                        t, s = await timed(lambda p: engine_stream(engine, p, args.max_tokens), prompts, c)
                        eng_t, eng_s = eng_t + t, eng_s + s
                    ratio = (http_t / http_s) / (eng_t / eng_s)
                    print(f"| {c} | {http_t / http_s:.1f} | {eng_t / eng_s:.1f} | {ratio:.2f}x |", flush=True)
    finally:
        server.terminate()
        server.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
