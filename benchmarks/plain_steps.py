"""What `auto` costs where it drafts nothing: its steps without a draft against `off`'s, by batch, in one process.

Both engines serve the same open-chat trace's conversations (benchmarks/open_chat_trace.py) --streams at a time,
as the served benchmark's clients do (each answered turn sends its next turn, a finished conversation is replaced),
after a greedy warm-up of --warm conversations, in passes (off, auto, auto, off, ...) of fresh conversations, the
same for both. Not step by step: the engines share the process's heap, so what one does to the allocator would slow
the other's steps as well and hide it. Every step of decoding sequences alone where no sequence drafted is timed
whole, its proposer call and its forward apart. Such a step does the same work in both engines, so where `auto`'s
is dearer, drafting's bookkeeping costs every step, drafting or not (a draft head's features handed over each step,
the proposer's lookups). The passes' throughput ratios are printed too, but they move with the sampled answers'
lengths; the plain steps' times do not.

    .venv/bin/python benchmarks/plain_steps.py --workload agent --streams 32 --temperature 0.7
    .venv/bin/python benchmarks/plain_steps.py --streams 32 --no-features   # auto without the head's features
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from draft_hint import build, converse_pool  # noqa: E402
from open_chat_trace import load_trace  # noqa: E402
from quant_forward import cpu_name  # noqa: E402

from specstream import SamplingParams  # noqa: E402


def time_plain_steps(engine, into: dict[int, list[tuple[float, float, float]]], tapped: list[int]) -> None:
    """Hook engine so that each step of decoding sequences alone with no draft appends (step, propose, forward)
    seconds to into[batch], and each step counts in tapped: [steps whose forward computed a head's features, steps]."""
    now: dict = {}
    propose, forward, pack, step = engine._propose, engine.runner.forward, engine._pack, engine.step

    def proposed(plan):
        started = time.perf_counter()
        out = propose(plan)
        now["propose"] = time.perf_counter() - started
        return out

    def forwarded(*args, **kwargs):
        started = time.perf_counter()
        out = forward(*args, **kwargs)
        now["forward"] = time.perf_counter() - started
        tapped[0] += bool(args[1] if len(args) > 1 else kwargs.get("aux_layers"))
        tapped[1] += 1
        return out

    def packed(decodes, drafts, prefills):
        now.update(batch=len(decodes), drafted=sum(len(d.tokens) for d in drafts), prefill=bool(prefills))
        return pack(decodes, drafts, prefills)

    def stepped():
        now.clear()
        started = time.perf_counter()
        out = step()
        if now.get("batch") and not now["drafted"] and not now["prefill"]:
            into[now["batch"]].append((time.perf_counter() - started, now["propose"], now["forward"]))
        return out

    engine._propose, engine.runner.forward, engine._pack, engine.step = proposed, forwarded, packed, stepped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["chat", "agent", "code"], default="agent")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--warm", type=int, default=30, help="conversations run greedily first, by each engine")
    p.add_argument("--conversations", type=int, default=32, help="conversations a pass")
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-features", action="store_true", help="auto without its draft head (nor its features)")
    p.add_argument("--min-steps", type=int, default=20, help="plain steps a batch size needs in both engines to be shown")
    args = p.parse_args()
    convs = load_trace()[args.workload]
    if args.warm + args.conversations * args.passes > len(convs) or args.streams < 1 or args.passes < 1:
        raise SystemExit(f"the {args.workload} trace has {len(convs)} conversations; lower --warm, --conversations or --passes")
    engines = {method: build(method) for method in ("off", "auto")}
    if args.no_features:
        engines["auto"].proposer.head = None  # no head: no features computed or handed
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    steps: dict[str, dict[int, list]] = {}
    tapped = [0, 0]  # auto's steps whose forward computed the head's features, its steps
    for method, engine in engines.items():
        converse_pool(engine, convs[: args.warm], args.streams, greedy)
        time_plain_steps(engine, steps.setdefault(method, defaultdict(list)), tapped if method == "auto" else [0, 0])
    rates: dict[str, list[float]] = defaultdict(list)
    for n in range(args.passes):
        lo = args.warm + n * args.conversations
        for method in ("off", "auto") if n % 2 == 0 else ("auto", "off"):
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=n)
            started = time.perf_counter()
            tokens = converse_pool(engines[method], convs[lo : lo + args.conversations], args.streams, params)[0]
            rates[method].append(tokens / (time.perf_counter() - started))
    ratios = [a / o for a, o in zip(rates["auto"], rates["off"])]
    features = " (no head features)" if args.no_features else ""
    print(f"\n{args.workload} x{args.streams} T={args.temperature}, {args.passes} passes of {args.conversations} conversations")
    print(f"throughput auto{features} / off by pass: {' '.join(f'{r:.2f}' for r in ratios)}; "
          f"all passes {sum(rates['auto']) / sum(rates['off']):.2f}x; auto's steps with the head's features computed: "
          f"{tapped[0]} of {tapped[1]}")
    print(f"\n| batch | off plain steps | off ms: step / propose / forward | auto{features} plain steps "
          "| auto ms: step / propose / forward | auto / off, step |")
    print("|---|---|---|---|---|---|")
    for batch in sorted(set(steps["off"]) & set(steps["auto"])):
        off, auto = steps["off"][batch], steps["auto"][batch]
        if min(len(off), len(auto)) < args.min_steps:
            continue
        med = [[statistics.median(s[i] for s in v) * 1e3 for i in range(3)] for v in (off, auto)]
        print(f"| {batch} | {len(off)} | {' / '.join(f'{x:.2f}' for x in med[0])} | {len(auto)} | "
              f"{' / '.join(f'{x:.2f}' for x in med[1])} | {med[1][0] / med[0][0]:.3f}x |")
    print(f"\nCPU: {cpu_name()}")


if __name__ == "__main__":
    main()
