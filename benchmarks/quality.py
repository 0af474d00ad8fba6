"""How far each served numerics' next-token distributions are from the fp32 dense model's, side by side with
llama.cpp's on the same GGUF: mean KL divergence KL(fp32 || served) and top-1 agreement, over English text
this project did not write (the Python reference manual's topics, shipped with CPython as pydoc_data).

    python benchmarks/quality.py                       # a8 (bf16 and fp32), int4 (q4_linear, bf16), llama.cpp
    python benchmarks/quality.py --modes a8 --no-llamacpp --tokens 8192

The text is cut into segments of --segment tokens, each scored from its start. Ours: the served forward,
fed --rows rows a step (1: a decode step's kernels; the fp32 reference in one step). llama.cpp: `llama-server` scores each position as the next token of a
/completion request whose prompt is the segment so far (token ids; its prompt cache makes that one new
token a request), with `n_probs` top probabilities before sampling. Its KL is over those top tokens and one
bucket for the rest of the vocabulary (a lower bound of the whole KL). Ours is given twice: over the whole
vocabulary, and over its own top tokens the same way as llama.cpp's, so that that column compares like
with like.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_forward import cpu_name  # noqa: E402
from specstream import Engine, EngineConfig, SpeculativeConfig  # noqa: E402
from specstream.model.loader import BUNDLED_MODELS, bundled_gguf_path  # noqa: E402
from specstream.model.runner import ForwardItem  # noqa: E402


def english_text() -> str:
    """The Python reference manual's topics, in a fixed order (prose with some code)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def segments(tokenizer, tokens: int, segment: int) -> list[list[int]]:
    ids = tokenizer.encode(english_text(), add_special_tokens=False)[:tokens]
    return [ids[i : i + segment] for i in range(0, len(ids), segment) if len(ids[i : i + segment]) > 1]


def our_logprobs(engine: Engine, segs: list[list[int]], rows: int) -> torch.Tensor:
    """log-softmax of the logits predicting each token after a segment's first: [positions, vocab] float32."""
    out = []
    runner, pool = engine.runner, engine.pool
    for seg in segs:
        table: list[int] = []
        assert pool.reserve(table, len(seg)), "the KV pool is too small for a segment"
        try:
            for start in range(0, len(seg) - 1, rows):
                chunk = seg[start : min(start + rows, len(seg) - 1)]
                logits = runner.forward([ForwardItem(table, start, chunk, len(chunk))])
                out.append(torch.log_softmax(logits.float(), dim=-1))
        finally:
            pool.free(table)
    return torch.cat(out)


def llama_logprobs(binary: Path, gguf: Path, segs: list[list[int]], top: int, threads: int) -> list[dict[int, float]]:
    """llama.cpp's top `top` log-probabilities for each position, as {token id: logprob}."""
    from _servers import free_port, stop_process, wait_up

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="llama-quality-", suffix=".log", delete=False)
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-np", "1", "-c", str(max(len(s) for s in segs) + 16),
           "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_up(url, proc, timeout=600)
        out = []
        with httpx.Client(timeout=600) as client:
            for seg in segs:
                for i in range(1, len(seg)):
                    # A sampled token that ends inside a UTF-8 character is held back with its probabilities: sample
                    # again with another seed (the probabilities reported are the distribution's, before sampling).
                    for seed in range(32):
                        body = {"prompt": seg[:i], "n_predict": 1, "n_probs": top, "cache_prompt": True,
                                "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": seed,
                                "post_sampling_probs": False, "ignore_eos": True}
                        reply = client.post(f"{url}/completion", json=body)
                        reply.raise_for_status()
                        probs = reply.json().get("completion_probabilities")
                        if probs:
                            break
                    else:
                        raise RuntimeError(f"llama-server reported no probabilities at position {i}: {reply.text[:500]}")
                    first = probs[0]
                    entries = first.get("top_logprobs") or first.get("probs")
                    out.append({e["id"]: e["logprob"] if "logprob" in e else math.log(max(e["prob"], 1e-30)) for e in entries})
        return out
    finally:
        stop_process(proc)
        log.close()
        os.unlink(log.name)


def kl_full(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """KL(ref || got) per position, natural log, over the whole vocabulary."""
    return (ref.exp() * (ref - got)).sum(-1)


def kl_top(ref: torch.Tensor, top: list[dict[int, float]]) -> torch.Tensor:
    """KL(ref || got) per position where got is known only by its top tokens: over those tokens and one bucket
    for the rest of the vocabulary (a lower bound of the whole-vocabulary KL, and the same computation for every
    source that reports its top tokens)."""
    out = torch.empty(ref.shape[0], dtype=torch.float64)
    for i, entries in enumerate(top):
        ids = torch.tensor(list(entries), dtype=torch.long)
        q = torch.tensor(list(entries.values()), dtype=torch.float64).exp()
        p = ref[i].double().exp()
        p_top = p[ids]
        p_rest, q_rest = max(1.0 - p_top.sum().item(), 0.0), max(1.0 - q.sum().item(), 1e-12)
        kl = (p_top * (p_top.clamp_min(1e-30).log() - q.clamp_min(1e-30).log())).sum().item()
        out[i] = kl + (p_rest * math.log(max(p_rest, 1e-30) / q_rest) if p_rest > 0 else 0.0)
    return out


def as_top(logprobs: torch.Tensor, n: int) -> list[dict[int, float]]:
    values, ids = logprobs.topk(n, dim=-1)
    return [dict(zip(i.tolist(), v.tolist())) for i, v in zip(ids, values)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["a8", "a8:float32", "int4"],
                    help="quantization modes, each served in --dtype or as MODE:DTYPE")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=4608)
    ap.add_argument("--segment", type=int, default=512)
    ap.add_argument("--rows", type=int, default=1, help="rows per step when scoring ours (1: decoding's kernels)")
    ap.add_argument("--top", type=int, default=40, help="top probabilities llama.cpp reports per position")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llamacpp", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    off = SpeculativeConfig(method="off")
    reference = Engine(EngineConfig(dtype="float32", quantization="none", compile=False, speculative=off), log=False)
    segs = segments(reference.tokenizer, args.tokens, args.segment)
    positions = sum(len(s) - 1 for s in segs)
    print(f"{positions} positions in {len(segs)} segments of up to {args.segment} tokens", file=sys.stderr)
    ref = our_logprobs(reference, segs, rows=args.segment)
    ref_top1 = ref.argmax(-1)
    del reference

    rows = []
    if not args.no_llamacpp:
        from vs_llamacpp import ensure_llama_server

        start = time.perf_counter()
        top = llama_logprobs(ensure_llama_server(), bundled_gguf_path(BUNDLED_MODELS["smollm2-135m"]), segs, args.top, args.threads)
        print(f"llama.cpp: scored in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        agree = sum(max(t, key=t.get) == r for t, r in zip(top, ref_top1.tolist())) / len(top)
        llama_row = (("llama.cpp (its CPU backend)", float("nan"), kl_top(ref, top).mean().item(), agree))

    for spec in args.modes:
        mode, dtype = (spec.split(":") + [args.dtype])[:2]
        engine = Engine(EngineConfig(dtype=dtype, quantization=mode, compile=False, speculative=off), log=False)
        start = time.perf_counter()
        got = our_logprobs(engine, segs, args.rows)
        print(f"{mode}: scored in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        rows.append((f"specstream {mode} ({dtype})", kl_full(ref, got).mean().item(),
                     kl_top(ref, as_top(got, args.top)).mean().item(), (got.argmax(-1) == ref_top1).float().mean().item()))
        del engine
    if not args.no_llamacpp:
        rows.append(llama_row)
    print(f"\nAgainst the fp32 dense model (the GGUF's weights dequantized), {positions} positions of English text:\n")
    print(f"| numerics | mean KL, whole vocabulary | mean KL, top {args.top} + rest (as llama.cpp reports) | top-1 agreement |")
    print("|---|---:|---:|---:|")
    for name, full, truncated, agree in rows:
        full_cell = "-" if math.isnan(full) else f"{full:.5f}"
        print(f"| {name} | {full_cell} | {truncated:.5f} | {agree * 100:.2f}% |")
    print(f"\nCPU: {cpu_name()}; {args.threads} threads")


if __name__ == "__main__":
    main()
