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
    .venv/bin/python benchmarks/plain_steps.py --streams 32 --conversations 64 --passes 2 --tap-blocks 4

--tap-blocks N runs `auto` alone instead, its draft head's features computed in alternate blocks of N steps whatever
its policy says (the head forgetting its rows each time they stop, as when auto puts it to sleep): what computing and
handing over the features costs a plain step, both kinds of step timed in the same minutes.
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


def time_plain_steps(engine, into: dict[int, list[tuple[float, float, float, bool]]], tapped: list[int]) -> None:
    """Hook engine so that each step of decoding sequences alone with no draft appends (step, propose, forward
    seconds, whether its forward computed a draft head's features) to into[batch], and each step counts in tapped:
    [steps whose forward computed the features, steps]."""
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
        now["tapped"] = bool(args[1] if len(args) > 1 else kwargs.get("aux_layers"))
        tapped[0] += now["tapped"]
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
            into[now["batch"]].append((time.perf_counter() - started, now["propose"], now["forward"], now["tapped"]))
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
    p.add_argument("--tap-blocks", type=int, default=0, help="auto alone, the head's features on and off by N steps")
    args = p.parse_args()
    convs = load_trace()[args.workload]
    if args.warm + args.conversations * args.passes > len(convs) or args.streams < 1 or args.passes < 1:
        raise SystemExit(f"the {args.workload} trace has {len(convs)} conversations; lower --warm, --conversations or --passes")
    if args.tap_blocks > 0:
        return tap_blocks(args, convs)
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
    print(f"\n| batch | off plain steps | off ms: step / propose / forward | auto{features} plain steps (features) "
          "| auto ms: step / propose / forward | auto / off, step | auto's steps with / without features, step |")
    print("|---|---|---|---|---|---|---|")
    for batch in sorted(set(steps["off"]) & set(steps["auto"])):
        off, auto = steps["off"][batch], steps["auto"][batch]
        if min(len(off), len(auto)) < args.min_steps:
            continue
        med = [[statistics.median(s[i] for s in v) * 1e3 for i in range(3)] for v in (off, auto)]
        tap = [[s[0] for s in auto if s[3] == t] for t in (True, False)]
        split = f"{statistics.median(tap[0]) / statistics.median(tap[1]):.3f}x" if min(map(len, tap)) >= 5 else "-"
        print(f"| {batch} | {len(off)} | {' / '.join(f'{x:.2f}' for x in med[0])} | {len(auto)} ({len(tap[0])}) | "
              f"{' / '.join(f'{x:.2f}' for x in med[1])} | {med[1][0] / med[0][0]:.3f}x | {split} |")
    print(f"\nCPU: {cpu_name()}")


def tap_blocks(args, convs) -> None:
    """auto alone, its head's features computed in alternate blocks of args.tap_blocks steps: each batch's plain
    steps with the features against those without."""
    from specstream.spec_decode.auto import AutoProposer

    engine = build("auto")
    auto, on = engine.proposer, [True]
    if auto.head is None:
        raise SystemExit("auto has no draft head here: no features to tap")
    layers, step, count = auto.head.aux_layers, engine.step, [0]
    AutoProposer.aux_layers = property(lambda self: layers if on[0] else ())  # its policy's tap set aside

    def stepped():
        count[0] += 1
        tap = (count[0] // args.tap_blocks) % 2 == 0
        if on[0] and not tap:
            auto.head.drop_states()  # as when auto puts its head to sleep
        on[0] = tap
        return step()

    engine.step = stepped
    converse_pool(engine, convs[: args.warm], args.streams, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    steps: dict[int, list] = defaultdict(list)
    time_plain_steps(engine, steps, [0, 0])
    for n in range(args.passes):
        lo = args.warm + n * args.conversations
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=n)
        converse_pool(engine, convs[lo : lo + args.conversations], args.streams, params)
    print(f"\n{args.workload} x{args.streams} T={args.temperature}, {args.passes} passes of {args.conversations} "
          f"conversations, auto's head features on and off by {args.tap_blocks} steps")
    print("\n| batch | plain steps with / without features | ms with: step / forward | ms without: step / forward "
          "| with / without, step |")
    print("|---|---|---|---|---|")
    for batch in sorted(steps):
        both = [[s for s in steps[batch] if s[3] == t] for t in (True, False)]
        if min(map(len, both)) < args.min_steps:
            continue
        med = [[statistics.median(s[i] for s in v) * 1e3 for i in (0, 2)] for v in both]
        print(f"| {batch} | {len(both[0])} / {len(both[1])} | {med[0][0]:.2f} / {med[0][1]:.2f} | "
              f"{med[1][0]:.2f} / {med[1][1]:.2f} | {med[0][0] / med[1][0]:.3f}x |")
    print(f"\nCPU: {cpu_name()}")


if __name__ == "__main__":
    main()
