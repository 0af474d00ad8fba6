"""Batch and speculation invariance in bf16, side by side in one run.

For the default mode and the invariant mode (EngineConfig(deterministic=True), `specstream
serve --deterministic`), on the bundled model in bf16, greedy, 128 tokens, over the 10 prompts of
gateway/bench/prompts.py (6 grounded, 4 open chat):

- speculative == plain: every speculative method present (ngram; auto and eagle when the model
  has a draft head), each prompt alone, against plain decoding of that prompt alone;
- batched == alone: plain and n-gram decoding of all 10 prompts in one batch, against alone;
- Hugging Face prompt lookup (generate(prompt_lookup_num_tokens=10)) against HF greedy on the
  same prompts: the bar the default mode should meet;
- the invariant mode's cost: tok/s at 1, 8 and 16 streams with the default speculation, both
  modes, in ABBA order.

    .venv/bin/python benchmarks/invariance.py            # full run
    .venv/bin/python benchmarks/invariance.py --quick    # 32 tokens, 1 and 8 streams
"""

from __future__ import annotations

import argparse
import time

import torch

from gateway.bench.prompts import GROUNDED, OPEN_CHAT
from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.spec_decode.draft_head import HeadError
from specstream.spec_decode.head_files import resolve_head_dir
from specstream.model.loader import DEFAULT_MODEL, load_model, load_tokenizer, resolve_model

PROMPTS = GROUNDED + OPEN_CHAT


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def engine(method: str, deterministic: bool, k: int) -> Engine:
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k)
    config = EngineConfig(model=DEFAULT_MODEL, dtype="bfloat16", deterministic=deterministic, speculative=spec)
    return Engine(config, log=False)


def tokens(eng: Engine, prompts, params, batched: bool) -> list[list[int]]:
    if batched:
        return [o.token_ids for o in eng.generate([chat(p) for p in prompts], params)]
    return [eng.generate(chat(p), params)[0].token_ids for p in prompts]


def agree(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def methods() -> list[str]:
    try:
        resolve_head_dir(None, DEFAULT_MODEL)
        return ["ngram", "auto", "eagle"]
    except HeadError:
        return ["ngram"]


def agreement(deterministic: bool, params: SamplingParams, k: int) -> list[tuple[str, str]]:
    plain = engine("off", deterministic, k)
    alone = tokens(plain, PROMPTS, params, batched=False)
    rows = [("plain, batch of 10 == alone", agree(tokens(plain, PROMPTS, params, batched=True), alone))]
    del plain
    for method in methods():
        spec = engine(method, deterministic, k)
        rows.append((f"{method} == plain (alone)", agree(tokens(spec, PROMPTS, params, batched=False), alone)))
        if method == "ngram":
            rows.append(("ngram, batch of 10 == plain alone", agree(tokens(spec, PROMPTS, params, batched=True), alone)))
    return rows


def hf_prompt_lookup(max_tokens: int) -> str:
    """HF assisted generation with prompt lookup vs HF greedy: how often the two agree."""
    source = resolve_model(DEFAULT_MODEL)
    tok = load_tokenizer(source)
    model = load_model(source, torch.bfloat16, "cpu")
    same = 0
    for p in PROMPTS:
        ids = tok.apply_chat_template(chat(p), add_generation_prompt=True, return_tensors="pt", return_dict=True)
        kw = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        with torch.inference_mode():
            greedy = model.generate(**ids, **kw)
            lookup = model.generate(**ids, prompt_lookup_num_tokens=10, **kw)
        same += torch.equal(greedy, lookup)
    return f"{same}/{len(PROMPTS)}"


def throughput(streams: list[int], params: SamplingParams, k: int, method: str) -> dict[tuple[bool, int], float]:
    """tok/s of `method` at each stream count, default vs invariant, ABBA over two passes."""
    engines = {det: engine(method, det, k) for det in (False, True)}
    tally: dict[tuple[bool, int], list[float]] = {}
    for n in streams:
        batch = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
        for order in ((False, True), (True, False)):
            for det in order:
                start = time.perf_counter()
                outs = engines[det].generate([chat(p) for p in batch], params)
                seconds = time.perf_counter() - start
                t = tally.setdefault((det, n), [0, 0.0])
                t[0] += sum(len(o.token_ids) for o in outs)
                t[1] += seconds
    return {key: n_tok / sec for key, (n_tok, sec) in tally.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    max_tokens = 32 if args.quick else args.max_tokens
    streams = [1, 8] if args.quick else [1, 8, 16]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    default_method = EngineConfig().speculative.method

    print(f"bf16, greedy, {max_tokens} tokens, {len(PROMPTS)} prompts, {args.threads} threads, k={args.k}\n")
    print("| agreement (same tokens) | default mode | invariant mode |\n|---|---|---|")
    default_rows, invariant_rows = agreement(False, params, args.k), agreement(True, params, args.k)
    for (name, a), (_, b) in zip(default_rows, invariant_rows):
        print(f"| {name} | {a} | {b} |")
    if not args.skip_hf:
        print(f"| HF prompt lookup == HF greedy | {hf_prompt_lookup(max_tokens)} | |")

    print(f"\n| {default_method} speculation, streams | default tok/s | invariant tok/s | invariant / default |")
    print("|---|---|---|---|")
    tps = throughput(streams, params, args.k, default_method)
    for n in streams:
        d, i = tps[(False, n)], tps[(True, n)]
        print(f"| {n} | {d:.1f} | {i:.1f} | {i / d:.2f}x |")


if __name__ == "__main__":
    main()
