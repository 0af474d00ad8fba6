"""The copy task through `Engine`: a chat prompt asking the bundled model to copy a paragraph, decoded plain and
with n-gram drafts (k = 8, not adaptive: every round drafts), per quantization mode, side by side in one process
(ABBA order over --repeats passes). Where the answer copies its input, n-gram drafts are accepted at several
tokens a round, so the ratio to plain decoding is what verifying k drafts costs against a decode step.

    python benchmarks/copy_task.py                        # a8 and int4 (q4_linear), compiled forward, bf16
    python benchmarks/copy_task.py --modes a8 --no-compile --repeats 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_forward import cpu_name  # noqa: E402
from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig  # noqa: E402


def paragraph() -> str:
    """A paragraph this project did not write: the opening of the Python reference manual's `for` topic."""
    import pydoc_data.topics

    text = pydoc_data.topics.topics["for"]
    words = text.split()
    return " ".join(words[:120])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=["a8", "int4"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    prompt = [{"role": "user", "content": f"Copy the following paragraph exactly, word for word:\n\n{paragraph()}"}]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    engines = {}
    for mode in args.modes:
        for method in ("off", "ngram"):
            spec = SpeculativeConfig(method=method, num_speculative_tokens=args.k, adaptive=False)
            config = EngineConfig(dtype=args.dtype, quantization=mode, compile=not args.no_compile,
                                  compile_in_background=False, speculative=spec)
            engines[mode, method] = Engine(config, log=False)
            engines[mode, method].generate([prompt], params)  # warm-up
    rates = {key: [] for key in engines}
    accepted = {}
    order = list(engines)
    for r in range(args.repeats):
        for key in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            out = engines[key].generate([prompt], params)[0]
            rates[key].append(len(out.token_ids) / (time.perf_counter() - start))
            if key[1] == "ngram":
                accepted[key] = out.stats.accepted / max(out.stats.rounds, 1) if hasattr(out.stats, "rounds") else None
    print(f"\nCopy task, {args.max_tokens} tokens greedy, n-gram k={args.k} (every round drafts), {args.repeats} passes ABBA:\n")
    print("| mode | plain tok/s (median, min-max) | n-gram tok/s (median, min-max) | n-gram / plain |")
    print("|---|---:|---:|---:|")
    for mode in args.modes:
        plain, ngram = rates[mode, "off"], rates[mode, "ngram"]
        ratio = statistics.median(ngram) / statistics.median(plain)
        spread = sorted(n / p for n, p in zip(ngram, plain))
        print(f"| {mode} | {statistics.median(plain):.1f} ({min(plain):.1f}-{max(plain):.1f}) | "
              f"{statistics.median(ngram):.1f} ({min(ngram):.1f}-{max(ngram):.1f}) | "
              f"{ratio:.2f}x (passes {spread[0]:.2f}-{spread[-1]:.2f}x) |")
    for (mode, _), a in accepted.items():
        if a is not None:
            print(f"{mode}: {a:.2f} drafts accepted a round")
    print(f"\nCPU: {cpu_name()}; {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
