"""Sampled decoding with the sampling kernels (kernels/csrc/sample_rows.cpp: sampling.draw's token and
probabilities_for's distributions) against torch's ops (torch_probabilities_for and sample_from), or at
--temperature 0 greedy decoding with the argmax kernel (sampling.argmax_rows) against torch.argmax, side by side in
one process: one engine, the two alternated group by group of open-chat conversations (the trace of
benchmarks/open_chat_trace.py, whose data it fetches), each group's conversations in flight together (each
answered turn sends that conversation's next turn at once, as the served benchmark's clients do).
Prints tokens/s of each and their ratio per number of streams (and, where the engine speculates, the tokens
drafted and accepted with each).

    python benchmarks/sampling_speed.py                                  # plain decoding, T=0.7, 1/8/32 streams
    python benchmarks/sampling_speed.py --method auto --temperature 1.0 --streams 8 --groups 6
    python benchmarks/sampling_speed.py --top-p 0.9 --streams 1 8        # rows cut to their top-p (torch sorts)
    python benchmarks/sampling_speed.py --min-p 0.05 --top-k 40 --top-p 0.95 --streams 1 8   # llama.cpp's settings
    python benchmarks/sampling_speed.py --method eagle --top-p 0.9 --streams 1 8   # the head's sampled drafts' q
    python benchmarks/sampling_speed.py --rows 1 9 16 --top-p 0.9       # the distributions alone, no engine
    python benchmarks/sampling_speed.py --temperature 0 --streams 1 8    # greedy: the argmax kernel
    python benchmarks/sampling_speed.py --temperature 0 --rows 1 4 9 16  # the argmax alone, no engine
"""

from __future__ import annotations

import argparse
import time
import types

import torch

from draft_hint import build, converse_pool
from open_chat_trace import load_trace
from quant_forward import cpu_name
import specstream.sampling as sampling
from specstream import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="off", help="speculative method of the engine (default: off, plain decoding)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--groups", type=int, default=4, help="groups of conversations per stream count, the draws alternated")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rows", type=int, nargs="+", help="time probabilities_for alone on random logits of these row counts")
    args = ap.parse_args()
    if not 0 <= args.temperature <= 2:
        raise SystemExit("--temperature must be in [0, 2] (0: greedy, the argmax kernel)")
    if not 0 < args.top_p <= 1 or args.top_k < 0 or not 0 <= args.min_p <= 1:
        raise SystemExit("--top-p must be in (0, 1], --top-k at least 0 and --min-p in [0, 1]")
    if not 2 <= args.groups <= 20 or not all(1 <= s <= 64 for s in args.streams):
        raise SystemExit("--groups must be 2-20 and --streams 1-64")
    torch.set_num_threads(2)
    if args.rows:
        return distributions(args)
    chat = load_trace()["chat"]
    engine = build(args.method)
    kernel = sampling.cpu_kernels
    if not kernel.loaded():
        raise SystemExit("specstream's CPU kernels are not loaded here: nothing to compare")
    torch_ops = types.SimpleNamespace(loaded=lambda: False)  # sampling.draw then takes torch's ops
    warm = 16
    # the compiled forward's shapes, the cost curve
    converse_pool(engine, chat[:warm], 8, SamplingParams(max_tokens=args.max_tokens, temperature=0))
    print(f"{args.method}, T={args.temperature}, top_p={args.top_p}, top_k={args.top_k}, min_p={args.min_p}, {args.max_tokens} tokens a turn; "
          f"CPU: {cpu_name()}; 2 threads")
    for streams in args.streams:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=1)
        totals = {"kernel": [0, 0.0, 0, 0], "torch": [0, 0.0, 0, 0]}
        at = warm
        for g in range(args.groups):
            convs = chat[at : at + streams]
            at = at + streams if at + 2 * streams <= len(chat) else warm
            for name in ("kernel", "torch") if g % 2 == 0 else ("torch", "kernel"):
                sampling.cpu_kernels = kernel if name == "kernel" else torch_ops
                start = time.perf_counter()
                tokens, drafted, accepted = converse_pool(engine, convs, streams, params)
                totals[name][0] += tokens
                totals[name][1] += time.perf_counter() - start
                totals[name][2] += drafted
                totals[name][3] += accepted
        sampling.cpu_kernels = kernel
        k, t = (totals[n][0] / totals[n][1] for n in ("kernel", "torch"))
        drafts = "".join(f", {n}: {totals[n][2]} drafted, {totals[n][3]} accepted" for n in totals if totals[n][2])
        print(f"{streams} streams: kernel {k:.1f} tok/s, torch's ops {t:.1f} tok/s, {k / t:.2f}x{drafts}", flush=True)


def distributions(args: argparse.Namespace) -> None:
    """probabilities_for (at --temperature 0: argmax_rows) on random logits of the bundled model's vocabulary: the
    kernel against torch's ops, alternated, the best of 30 runs each."""
    if not sampling.cpu_kernels.load():
        raise SystemExit("specstream's CPU kernels are not built here: nothing to compare")
    what = "argmax_rows" if args.temperature == 0 else "probabilities_for"
    print(f"{what}, T={args.temperature}, top_p={args.top_p}, top_k={args.top_k}, min_p={args.min_p}, 49152 tokens; CPU: {cpu_name()}; 2 threads")
    g = torch.Generator().manual_seed(0)
    for rows in args.rows:
        logits = torch.randn(rows, 49152, generator=g) * 3
        params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)] * rows
        if args.temperature == 0:
            fns = (("kernel", lambda x, _: sampling.argmax_rows(x)), ("torch", lambda x, _: x.argmax(-1)))
        else:
            fns = (("kernel", sampling.probabilities_for), ("torch", sampling.torch_probabilities_for))
        best = {"kernel": float("inf"), "torch": float("inf")}
        for _ in range(30):
            for name, fn in fns:
                start = time.perf_counter()
                fn(logits, params)
                best[name] = min(best[name], time.perf_counter() - start)
        k, t = best["kernel"] * 1e3, best["torch"] * 1e3
        print(f"{rows} rows: kernel {k:.3f} ms, torch's ops {t:.3f} ms, {t / k:.1f}x faster", flush=True)


if __name__ == "__main__":
    main()
