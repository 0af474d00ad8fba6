"""What `auto`'s drafting gains over plain decoding, judged inside one engine: drafting on and off in
blocks of a few steps, so both kinds of step run in the same minutes on the same sequences.

Served runs of `off` against `auto` (open_chat_trace.py) compare two servers minutes apart; on a shared machine
their plain throughput moved by a third from one ten-minute run to the next, more than the few percent a policy
change is worth at many sampled streams. Here one `auto` engine serves the open-chat trace's conversations
(benchmarks/open_chat_trace.py) --streams at a time, as the served benchmark's clients do, after --warm greedy
conversations (its suffix cache and acceptance records fill as a server's would). Then, step by step, blocks of
--blocks steps, each a drafting block or a plain one by a seeded coin: in a drafting block `auto` proposes as it
would; in a plain block no sequence is asked for a draft (the proposer is not called, the head's features are not
computed), so the step is `off`'s. Two ratios of `auto` to plain decoding, each over the whole run, each pass (a
fresh set of conversations) and --parts equal runs of steps:
- every step: tokens a second of the drafting steps over the plain steps'. Steps with prompt chunks weigh in it by
  which kind of block the prompts happened to land in, and at many streams turns end in waves (conversations that
  start together end their turns together), so there a few waves decide it;
- decoding alone, batch by batch (the one to judge by): the seconds plain steps would take for the drafting steps'
  tokens at each batch size's plain rate, over the seconds the drafting steps took, steps with prompt chunks left
  out (drafting changes their decodes, not their prompt's work).

A plain block leaves the proposers nothing to draft from that a drafting block would not: n-gram and suffix
lookups read the sequence's tokens (they catch up on the next call), and the draft head, whose features a plain
step does not compute, starts its cache again past the gap, as when `auto` puts it to sleep. The k policy learns
acceptance only from drafting blocks, and its cost curve from every step, as a server's does.

    .venv/bin/python benchmarks/draft_blocks.py --workload chat --streams 8 --temperature 0.7
    .venv/bin/python benchmarks/draft_blocks.py --workload agent --streams 32 --temperature 0.7 --conversations 64
    .venv/bin/python benchmarks/draft_blocks.py --workload chat --streams 1 --temperature 0 --conversations 12
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).parent))
from draft_hint import build, converse_pool  # noqa: E402
from open_chat_trace import load_trace  # noqa: E402
from quant_forward import cpu_name  # noqa: E402

from specstream import SamplingParams  # noqa: E402


class Step(NamedTuple):
    drafting: bool
    batch: int  # decoding sequences
    prefill: bool  # whether a prompt chunk rode along
    tokens: int  # emitted
    seconds: float
    drafted: int
    accepted: int
    tapped: bool  # whether the forward computed the draft head's features
    prompt: int  # prompt tokens prefilled
    preempted: int  # sequences preempted for KV space (their prompt and output prefilled again)


def alternate(engine, block: int, log: list[Step], methods: dict[str, list[int]]) -> None:
    """Hook engine so that drafting runs only in some blocks of `block` steps, each block's kind drawn by a coin
    (seeded), and each step appends its Step to log. Not in strict turns: conversations that start together
    at many streams end their turns together, max_tokens steps later, and where that is a multiple of two blocks
    every next turn's prompt would land in a block of the kind its first turn's did. methods[name] counts the
    rounds each method drafted: [rounds, tokens drafted, accepted]."""
    from specstream.spec_decode.auto import AutoProposer

    policy, step, pack, forward, count, now = engine.scheduler.policy, engine.step, engine._pack, engine.runner.forward, [0], {}
    if not isinstance(engine.proposer, AutoProposer):
        raise SystemExit("the engine's proposer is not auto's")
    tap, choose, drafting, coin = AutoProposer.aux_layers.fget, policy.choose, [True], random.Random(0)
    AutoProposer.aux_layers = property(lambda self: tap(self) if drafting[0] else ())
    # a plain step asks no sequence for a draft, so the proposer is not called: `off`'s step
    policy.choose = lambda seqs, base_tokens, budget: choose(seqs, base_tokens, budget) if drafting[0] else [0] * len(seqs)

    def packed(decodes, drafts, prefills):
        now.update(batch=len(decodes), prefill=bool(prefills), prompt=sum(n for _, n in prefills))
        return pack(decodes, drafts, prefills)

    def forwarded(*args, **kwargs):
        now["tapped"] = bool(args[1] if len(args) > 1 else kwargs.get("aux_layers"))
        return forward(*args, **kwargs)

    def stepped():
        if count[0] % block == 0:
            drafting[0] = coin.random() < 0.5
        count[0] += 1
        now.clear()
        preempted = engine.scheduler.num_preemptions
        started = time.perf_counter()
        out = step()
        seconds = time.perf_counter() - started
        for c in out:
            if c.method:
                counts = methods.setdefault(c.method, [0, 0, 0])
                counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + c.num_drafted, counts[2] + c.num_accepted
        if now:
            log.append(Step(drafting[0], now["batch"], now["prefill"], sum(len(c.token_ids) for c in out), seconds,
                            sum(c.num_drafted for c in out), sum(c.num_accepted for c in out), now.get("tapped", False),
                            now["prompt"], engine.scheduler.num_preemptions - preempted))
        return out

    engine._pack, engine.step, engine.runner.forward = packed, stepped, forwarded


def ratio(steps: list[Step]) -> float:
    """Drafting steps' tokens a second over plain steps', every step."""
    rate = []
    for kind in (True, False):
        tokens = sum(s.tokens for s in steps if s.drafting == kind)
        seconds = sum(s.seconds for s in steps if s.drafting == kind)
        rate.append(tokens / seconds if seconds else float("nan"))
    return rate[0] / rate[1]


def decoding_ratio(steps: list[Step], min_steps: int = 5) -> float:
    """Steps of decoding alone, batch by batch: the seconds plain steps would take for the drafting steps' tokens
    at each batch's plain rate, over the seconds the drafting steps took (batches each kind ran min_steps times).
    The mix of batch sizes and prompt chunks then weighs nothing: only what drafting does to a step of b."""
    plain_needed = took = 0.0
    for b in {s.batch for s in steps}:
        on = [s for s in steps if s.batch == b and not s.prefill and s.drafting]
        off = [s for s in steps if s.batch == b and not s.prefill and not s.drafting]
        if min(len(on), len(off)) < min_steps:
            continue
        plain_needed += sum(s.tokens for s in on) * sum(s.seconds for s in off) / sum(s.tokens for s in off)
        took += sum(s.seconds for s in on)
    return plain_needed / took if took else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["chat", "agent", "code"], default="chat")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--warm", type=int, default=30, help="conversations run greedily first, drafting throughout")
    p.add_argument("--conversations", type=int, default=32, help="conversations a pass")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--blocks", type=int, default=8, help="steps a block (drafting, then plain, ...)")
    p.add_argument("--parts", type=int, default=4, help="equal runs of steps the spread is also given over")
    args = p.parse_args()
    convs = load_trace()[args.workload]
    if args.warm + args.conversations * args.passes > len(convs) or min(args.streams, args.passes, args.blocks) < 1:
        raise SystemExit(f"the {args.workload} trace has {len(convs)} conversations; lower --warm, --conversations or --passes")
    engine = build("auto")
    converse_pool(engine, convs[: args.warm], args.streams, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    log: list[Step] = []
    methods: dict[str, list[int]] = {}
    alternate(engine, args.blocks, log, methods)
    ends = []
    for n in range(args.passes):
        lo = args.warm + n * args.conversations
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=n)
        converse_pool(engine, convs[lo : lo + args.conversations], args.streams, params)
        ends.append(len(log))
    size = -(-len(log) // args.parts)
    spans = {"pass": list(zip([0] + ends, ends)), "part": [(i, i + size) for i in range(0, len(log), size)]}
    print(f"\n{args.workload} x{args.streams} T={args.temperature:g}, {args.passes} passes of {args.conversations} "
          f"conversations, drafting on and off by {args.blocks} steps")
    print("\n| steps | count (decoding alone) | tokens | seconds | tok/s | tokens drafted / accepted "
          "| steps with prompt chunks: count, tokens, seconds | head's features computed: steps, seconds | preempted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, kind in (("drafting", True), ("plain", False)):
        ss = [s for s in log if s.drafting == kind]
        tokens, seconds = sum(s.tokens for s in ss), sum(s.seconds for s in ss)
        print(f"| {name} | {len(ss)} ({sum(not s.prefill for s in ss)}) | {tokens} | {seconds:.1f} | "
              f"{tokens / seconds:.1f} | {sum(s.drafted for s in ss)} / {sum(s.accepted for s in ss)} | "
              f"{sum(s.prefill for s in ss)}, {sum(s.prompt for s in ss)}, {sum(s.seconds for s in ss if s.prefill):.1f} | "
              f"{sum(s.tapped for s in ss)}, {sum(s.seconds for s in ss if s.tapped):.1f} | {sum(s.preempted for s in ss)} |")
    print("\nrounds by method: " + ", ".join(f"{m} {r} ({d} drafted, {a} accepted)" for m, (r, d, a) in sorted(methods.items())))
    for name, measure in (("every step", ratio), ("decoding alone, batch by batch", decoding_ratio)):
        each = {k: " ".join(f"{measure(log[a:b]):.3f}" for a, b in v) for k, v in spans.items()}
        print(f"\nauto / plain, {name}: **{measure(log):.3f}x**; by pass {each['pass']}; by {args.parts} parts {each['part']}")
    print(f"\nCPU: {cpu_name()}")


if __name__ == "__main__":
    main()
