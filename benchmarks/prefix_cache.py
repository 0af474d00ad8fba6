"""Prefix caching on vs off, side by side in one run (ABBA order), on the bundled model.

    .venv/bin/python benchmarks/prefix_cache.py            # full run (~10 min on 2 idle cores)
    .venv/bin/python benchmarks/prefix_cache.py --quick    # fewer requests and turns

Three workloads, each run on two engines that differ only in enable_prefix_caching, in the
order off, on, on, off (each half of a workload's requests goes to both engines), so slow
drift of a shared machine hits both alike:
1. a shared ~1500-token system prompt + 24 different short questions, at concurrency 1 and
   4: p50 time to first token (TTFT) and cached/prompt tokens after the first request;
2. multi-turn chat, 8 turns of ~60-token user messages and greedy replies: TTFT per turn;
3. no sharing at all (distinct raw-text prompts): generated tokens/s, plus the cost of
   hashing alone per 1000 tokens.
TTFT is measured in-process: from add_request to the step that returns the first token.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.memory.prefix_cache import extend_digests

TOPICS = [
    "billing",
    "shipping",
    "returns",
    "warranty",
    "accounts",
    "privacy",
    "security",
    "outages",
    "refunds",
    "discounts",
    "gift cards",
    "subscriptions",
    "invoices",
    "taxes",
    "repairs",
    "loyalty points",
]
QUESTIONS = [
    "How do I reset my password?",
    "Can I change my delivery address after ordering?",
    "What is your refund policy?",
    "How long does shipping to Canada take?",
    "Do you price match?",
    "How do I cancel my subscription?",
    "Where can I download my invoice?",
    "Is my card data stored?",
    "Can I pay with a gift card and a card together?",
    "What happens if my parcel is lost?",
    "How do I report a security issue?",
    "Can I return an opened item?",
    "Do loyalty points expire?",
    "How do I update my tax number?",
    "Why was my payment declined?",
    "Can I pause my subscription?",
    "How do I contact a human agent?",
    "Do you ship to PO boxes?",
    "What is the warranty on headphones?",
    "How do I delete my account?",
    "Can I get a discount for students?",
    "How do I track a repair?",
    "Are there fees for international orders?",
    "Can I change the name on an invoice?",
]
WORD_LIST = (
    "river stone orbit lantern copper meadow signal harbor violet engine summit canvas ember falcon quartz "
    "willow thunder pixel garden marble voyage crystal beacon rocket forest silver puzzle anchor breeze"
)
WORDS = WORD_LIST.split()


def system_prompt(tokenizer, target_tokens: int) -> str:
    """A support-desk policy long enough to fill target_tokens."""
    rules, i = [], 0
    while True:
        topic = TOPICS[i % len(TOPICS)]
        rules.append(
            f"Rule {i + 1} ({topic}): when a customer asks about {topic}, first confirm their order number, "
            f"then explain the {topic} policy in plain words, cite section {i % 7 + 1}.{i % 5 + 1}, and offer "
            f"a follow-up if the case needs a specialist from the {topic} team."
        )
        text = "You are the support assistant of Acme Outfitters. Follow these rules.\n" + "\n".join(rules)
        if len(tokenizer.encode(text)) >= target_tokens:
            return text
        i += 1


@dataclass
class Result:
    ttft: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    text: str


def row(workload: str, off: str, on: str, ratio: float, cached: float) -> str:
    return f"| {workload} | {off} | {on} | {ratio:.{3 if ratio < 2 else 1}f}x | {cached:.3f} |"


def run_closed_loop(
    engine: Engine, prompts: list, params: SamplingParams, concurrency: int
) -> tuple[list[Result], float]:
    """Keep `concurrency` requests in flight; return per-request results (in prompt order)
    and the wall time."""
    pending = list(enumerate(prompts))
    live: dict[str, tuple[int, float]] = {}
    first: dict[str, float] = {}
    texts: dict[str, list[str]] = {}
    results: dict[int, Result] = {}
    start = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            i, prompt = pending.pop(0)
            rid = engine.add_request(prompt, params)
            live[rid] = (i, time.perf_counter())
            texts[rid] = []
        for chunk in engine.step():
            now = time.perf_counter()
            if chunk.token_ids and chunk.request_id not in first:
                first[chunk.request_id] = now
            texts[chunk.request_id].append(chunk.text)
            if chunk.finished:
                i, submitted = live.pop(chunk.request_id)
                u = chunk.usage
                ttft = first.get(chunk.request_id, now) - submitted
                results[i] = Result(
                    ttft, u.prompt_tokens, u.cached_tokens, u.completion_tokens, "".join(texts[chunk.request_id])
                )
    return [results[i] for i in range(len(prompts))], time.perf_counter() - start


def abba(engines: dict[str, Engine], prompts: list, run) -> dict[str, list]:
    """Run prompts' first half off then on, the second half on then off; collect per engine."""
    half = len(prompts) // 2
    out: dict[str, list] = {"off": [], "on": []}
    for name, part in (
        ("off", prompts[:half]),
        ("on", prompts[:half]),
        ("on", prompts[half:]),
        ("off", prompts[half:]),
    ):
        out[name].append(run(engines[name], part))
    return out


def shared_prompt(engines, args) -> list[str]:
    system = system_prompt(engines["on"].tokenizer, args.system_tokens)
    prompts = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}] for q in QUESTIONS[: args.questions]
    ]
    params = SamplingParams(max_tokens=args.shared_max_tokens, temperature=0)
    lines = []
    for concurrency in (1, 4):
        runs = abba(engines, prompts, lambda e, part, c=concurrency: run_closed_loop(e, part, params, c)[0])
        off = [r for run in runs["off"] for r in run]
        on = [r for run in runs["on"] for r in run]
        p50_off, p50_on = statistics.median(r.ttft for r in off), statistics.median(r.ttft for r in on)
        warm = on[1:] if concurrency == 1 else on  # the engine's first request ever is the cold one
        cached = sum(r.cached_tokens for r in warm) / sum(r.prompt_tokens for r in warm)
        workload = f"shared system prompt ({on[0].prompt_tokens} tokens), concurrency {concurrency}"
        lines.append(row(workload, f"{p50_off * 1000:.0f} ms", f"{p50_on * 1000:.0f} ms", p50_off / p50_on, cached))
    return lines


def multi_turn(engines, args) -> list[str]:
    rng = random.Random(1)
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0)

    def user_message(turn: int) -> str:
        words = " ".join(rng.choice(WORDS) for _ in range(40))
        return f"Turn {turn}. Here are some words: {words}. Write a short story that uses the first five of them."

    conversations = [[user_message(t) for t in range(args.turns)] for _ in range(2)]

    def converse(engine: Engine, convs: list) -> list[list[Result]]:
        per_turn = [[] for _ in range(args.turns)]
        for users in convs:
            messages: list[dict] = []
            for t, text in enumerate(users):
                messages.append({"role": "user", "content": text})
                result = run_closed_loop(engine, [list(messages)], params, 1)[0][0]
                messages.append({"role": "assistant", "content": result.text})
                per_turn[t].append(result)
        return per_turn

    runs = abba(engines, conversations, converse)
    lines = []
    ttft = {name: [[r.ttft for run in runs[name] for r in run[t]] for t in range(args.turns)] for name in runs}
    for t in range(args.turns):
        off, on = statistics.median(ttft["off"][t]), statistics.median(ttft["on"][t])
        results = [r for run in runs["on"] for r in run[t]]
        prompt = statistics.median(r.prompt_tokens for r in results)
        cached = sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results)
        workload = f"multi-turn chat, turn {t + 1} (~{prompt:.0f} prompt tokens)"
        lines.append(row(workload, f"{off * 1000:.0f} ms", f"{on * 1000:.0f} ms", off / on, cached))
    return lines


def no_sharing(engines, args) -> list[str]:
    rng = random.Random(2)
    prompts = [
        f"Note {i}: " + " ".join(rng.choice(WORDS) for _ in range(args.unique_words))
        for i in range(args.unique_requests)
    ]
    params = SamplingParams(max_tokens=args.unique_max_tokens, temperature=0)
    runs = abba(engines, prompts, lambda e, part: run_closed_loop(e, part, params, 4))
    tps = {}
    for name, parts in runs.items():
        tokens = sum(r.output_tokens for results, _ in parts for r in results)
        tps[name] = tokens / sum(wall for _, wall in parts)
        cached = sum(r.cached_tokens for results, _ in parts for r in results)
        assert cached == 0, "distinct prompts must share nothing"
    workload = f"no sharing, {args.unique_requests} distinct prompts, concurrency 4 (throughput)"
    return [row(workload, f"{tps['off']:.1f} tok/s", f"{tps['on']:.1f} tok/s", tps["on"] / tps["off"], 0.0)]


def hashing_cost(block_size: int) -> float:
    """CPU milliseconds to compute the chained digests of 1000 tokens (process time: on a
    shared machine, wall time would count the time others held the core)."""
    tokens = list(range(1000))
    reps = 300
    start = time.process_time()
    for _ in range(reps):
        extend_digests([], tokens, block_size, "salt", len(tokens) // block_size)
    return (time.process_time() - start) / reps * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--speculative-method", default="ngram", choices=["ngram", "off"])
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--shared-max-tokens", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--reply-tokens", type=int, default=64)
    ap.add_argument("--unique-requests", type=int, default=16)
    ap.add_argument("--unique-words", type=int, default=300)
    ap.add_argument("--unique-max-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.quick:
        args.questions, args.turns, args.unique_requests, args.unique_max_tokens = 8, 4, 8, 32
    torch.set_num_threads(args.threads)
    spec = SpeculativeConfig(method=args.speculative_method)
    engines = {
        name: Engine(EngineConfig(args.model, args.dtype, speculative=spec, enable_prefix_caching=name == "on"))
        for name in ("off", "on")
    }
    for e in engines.values():  # warm-up, on a prompt no workload shares
        e.generate("Warm-up: hello", SamplingParams(max_tokens=4, temperature=0))
    lines = []
    for workload in (shared_prompt, multi_turn, no_sharing):
        rows = workload(engines, args)
        print("\n".join(rows), file=sys.stderr, flush=True)  # progress
        lines += rows
    print(f"\n## Prefix caching off vs on ({args.dtype}, {args.threads} threads, {args.speculative_method}, ABBA)\n")
    print("| workload | cache off | cache on | on vs off | cached / prompt tokens (on) |")
    print("|---|---:|---:|---:|---:|")
    print("\n".join(lines))
    cost = hashing_cost(engines["on"].pool.block_size)
    print(f"\nHashing: {cost:.3f} CPU ms per 1000 tokens (sha256 chain, 16-token blocks)")


if __name__ == "__main__":
    main()
