"""Engine speed, side by side in one run: specstream plain / n-gram / draft model vs Hugging
Face generate() plain / prompt lookup, greedy, on the bundled default model.

    .venv/bin/python benchmarks/engine_speed.py            # full run (~6 min on 2 cores)
    .venv/bin/python benchmarks/engine_speed.py --quick    # 2 prompts per set, 64 tokens

Each configuration generates greedily up to --max-tokens new tokens per prompt (stopping at
EOS, as a server would); tokens/s is generated tokens over wall time, summed over a set.
"""

from __future__ import annotations

import argparse
import time

import torch

from gateway.bench.prompts import GROUNDED, OPEN_CHAT
from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.model.loader import load_model, load_tokenizer, resolve_model

def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def run_ours(engine: Engine, prompts, max_tokens: int, batched: bool = False) -> tuple[int, float, float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    start = time.perf_counter()
    if batched:
        outs = engine.generate([chat(p) for p in prompts], params)
    else:
        outs = [engine.generate(chat(p), params)[0] for p in prompts]
    elapsed = time.perf_counter() - start
    drafted = sum(o.stats.drafted for o in outs)
    accepted = sum(o.stats.accepted for o in outs)
    return sum(len(o.token_ids) for o in outs), elapsed, accepted / drafted if drafted else 0.0


def run_hf(model, tokenizer, prompts, max_tokens: int, lookup: int | None) -> tuple[int, float, float]:
    tokens, elapsed = 0, 0.0
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
    for p in prompts:
        enc = tokenizer.apply_chat_template(chat(p), add_generation_prompt=True, return_tensors="pt", return_dict=True)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False, **extra)
        elapsed += time.perf_counter() - start
        tokens += out.shape[1] - enc["input_ids"].shape[1]
    return tokens, elapsed, float("nan")


def truncated_draft(target_dir: str, num_layers: int, out_dir: str) -> str:
    """An honest draft for a model with no smaller sibling here: the target's first layers
    (same embeddings, final norm and head)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(target_dir).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=16, help="num_speculative_tokens for ours")
    ap.add_argument("--hf-lookup", type=int, default=10, help="prompt_lookup_num_tokens for HF")
    ap.add_argument("--draft-layers", type=int, default=8, help="layers of the truncated draft (0 skips it)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    grounded, open_chat = GROUNDED, OPEN_CHAT
    if args.quick:
        grounded, open_chat, args.max_tokens = GROUNDED[:2], OPEN_CHAT[:2], min(args.max_tokens, 64)
    sets = {"input-grounded": grounded, "open chat": open_chat}

    def cfg(method: str, **spec) -> EngineConfig:
        return EngineConfig(dtype="bfloat16", speculative=SpeculativeConfig(method=method, num_speculative_tokens=args.k, **spec))

    source = resolve_model("smollm2-135m")
    hf_tok = load_tokenizer(source)
    hf_model = load_model(source, torch.bfloat16)
    engines = {"ours plain": Engine(cfg("off")), "ours ngram": Engine(cfg("ngram"))}
    if args.draft_layers:
        import tempfile

        draft_dir = truncated_draft(source.path, args.draft_layers, tempfile.mkdtemp(prefix="specstream-draft-"))
        engines[f"ours draft ({args.draft_layers}-layer)"] = Engine(cfg("draft", draft_model=draft_dir))
    for e in engines.values():  # warm-up
        e.generate(chat("Hi"), SamplingParams(max_tokens=4, temperature=0))
    run_hf(hf_model, hf_tok, ["Hi"], 4, None)

    results: dict[tuple[str, str], tuple[int, float, float]] = {}
    for set_name, prompts in sets.items():
        for name, e in engines.items():
            results[(set_name, name)] = run_ours(e, prompts, args.max_tokens)
        results[(set_name, "HF generate plain")] = run_hf(hf_model, hf_tok, prompts, args.max_tokens, None)
        results[(set_name, f"HF prompt lookup ({args.hf_lookup})")] = run_hf(hf_model, hf_tok, prompts, args.max_tokens, args.hf_lookup)

    def tps(key):
        tokens, elapsed, _ = results[key]
        return tokens / elapsed

    print(f"\n## Single stream, greedy, up to {args.max_tokens} new tokens, bf16, {args.threads} threads\n")
    print("| prompts | configuration | tokens | tok/s | vs ours plain | vs HF plain | acceptance |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (set_name, name), (tokens, _, acc) in results.items():
        base, hf = tps((set_name, "ours plain")), tps((set_name, "HF generate plain"))
        rate = tps((set_name, name))
        acc_s = f"{acc:.0%}" if acc == acc and name.startswith("ours") and "plain" not in name else ""
        print(f"| {set_name} | {name} | {tokens} | {rate:.1f} | {rate / base:.2f}x | {rate / hf:.2f}x | {acc_s} |")

    batch = grounded[:4] + open_chat[:4]
    plain_seq = run_ours(engines["ours plain"], batch, args.max_tokens)
    print(f"\n## {len(batch)} prompts batched vs one at a time (throughput)\n")
    print("| configuration | tokens | seconds | tok/s | vs one-at-a-time plain |")
    print("|---|---:|---:|---:|---:|")
    base = plain_seq[0] / plain_seq[1]
    print(f"| ours plain, one at a time | {plain_seq[0]} | {plain_seq[1]:.1f} | {base:.1f} | 1.00x |")
    for name in ("ours plain", "ours ngram"):
        tokens, elapsed, _ = run_ours(engines[name], batch, args.max_tokens, batched=True)
        print(f"| {name}, {len(batch)} batched | {tokens} | {elapsed:.1f} | {tokens / elapsed:.1f} | {tokens / elapsed / base:.2f}x |")

    g = "input-grounded"
    print("\n## Goals")
    checks = [
        ("ours plain >= 1.0x HF plain (all prompts)", min(tps((s, "ours plain")) / tps((s, "HF generate plain")) for s in sets), 1.0),
        ("ours ngram >= 1.25x HF prompt lookup (input-grounded)", tps((g, "ours ngram")) / tps((g, f"HF prompt lookup ({args.hf_lookup})")), 1.25),
        ("ours ngram >= 2.5x ours plain (input-grounded)", tps((g, "ours ngram")) / tps((g, "ours plain")), 2.5),
        ("ours ngram >= ~1.0x ours plain (open chat)", tps(("open chat", "ours ngram")) / tps(("open chat", "ours plain")), 0.95),
    ]
    for label, value, goal in checks:
        print(f"- {label}: {value:.2f}x {'met' if value >= goal else 'NOT met'}")


if __name__ == "__main__":
    main()
