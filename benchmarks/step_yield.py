"""Where `auto`'s gains and losses on open chat come from, step by step, in process.

A whole run's ratio to `off` moves by a tenth from one set of conversations to the next: a sampled text
differs between the two engines (speculation consumes a request's random draws as plain decoding does, but
the default kernels round a row differently in steps of other sizes, and a near-tie flips), so their answers'
lengths differ, and with them the prefill share and the tail where few streams are left. This benchmark looks
at steps instead. It runs `auto` alone on the open-chat trace's conversations (benchmarks/open_chat_trace.py),
--streams in flight (each answered turn sends that conversation's next turn at once and a finished
conversation is replaced by the next, as the served benchmark's clients do), after a greedy warm-up that fills
its suffix cache as a server's would, times every step whole (scheduling to the last token's bookkeeping), and
records its batch (decoding sequences), the rows its drafts added, the tokens it emitted, and the tokens `auto`
expected its drafts to add (the gain it priced them at). Steps of decoding sequences alone are grouped by batch and drafted rows; each drafting group's
tokens per second is set against the plain steps of the same batch in the same run (their median time), and
its tokens beyond one a sequence against what was expected.

    .venv/bin/python benchmarks/step_yield.py --streams 1 --temperature 0.7 --conversations 16
    .venv/bin/python benchmarks/step_yield.py --streams 8 --temperature 0.7 --conversations 48
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from draft_hint import build, converse_pool  # noqa: E402
from open_chat_trace import load_trace  # noqa: E402
from quant_forward import cpu_name  # noqa: E402

from specstream import SamplingParams  # noqa: E402
from specstream.spec_decode import policy  # noqa: E402


@dataclass
class Step:
    batch: int  # decoding sequences
    drafted: int  # rows their drafts added
    prefill: bool  # a prefill chunk rode along
    tokens: int  # emitted by the decoding rounds
    expected: float  # tokens auto expected its drafts to add
    seconds: float  # the whole step


def record(engine) -> list[Step]:
    """Hook an engine so that every step it runs is appended, as a Step, to the returned list. The expected gain is
    read by wrapping policy.StepPrice.add, `auto`'s pricing, for the whole process."""
    steps: list[Step] = []
    now: dict = {}
    pack, record_round, step = engine._pack, engine.metrics.record_round, engine.step

    def packed(decodes, drafts, prefills):
        now.update(batch=len(decodes), drafted=sum(len(d.tokens) for d in drafts), prefill=bool(prefills))
        return pack(decodes, drafts, prefills)

    def rounded(num_drafted, num_accepted, num_tokens, method="", num_forced=0, decoding=True):
        if decoding:
            now["tokens"] += num_tokens
        return record_round(num_drafted, num_accepted, num_tokens, method, num_forced, decoding)

    def stepped():
        now.clear()
        now.update(tokens=0, expected=0.0)
        started = time.perf_counter()
        out = step()
        if "batch" in now:
            steps.append(Step(now["batch"], now["drafted"], now["prefill"], now["tokens"], now["expected"], time.perf_counter() - started))
        return out

    price_add = policy.StepPrice.add

    def priced(self, gain, rows, extra=0.0):
        if "tokens" in now:
            now["expected"] += gain
        return price_add(self, gain, rows, extra)

    policy.StepPrice.add = priced
    engine._pack, engine.metrics.record_round, engine.step = packed, rounded, stepped
    return steps


def summarize(steps: list[Step], group: int = 4) -> tuple[list[dict], dict]:
    """Rows of the table (per batch, drafted rows grouped by `group` past 4) and the totals, from steps of decoding
    sequences alone; a batch's plain steps (no draft) are the yardstick of its drafting ones."""
    alone = [s for s in steps if not s.prefill and s.batch]
    plain = defaultdict(list)
    for s in alone:
        if not s.drafted:
            plain[s.batch].append(s.seconds)
    plain_step = {b: statistics.median(v) for b, v in plain.items() if len(v) >= 5}
    groups: dict[tuple[int, int], list[Step]] = defaultdict(list)
    for s in alone:
        if s.drafted and s.batch in plain_step:
            lo = s.drafted if s.drafted <= 4 else 5 + (s.drafted - 5) // group * group
            groups[(s.batch, lo)].append(s)
    rows = []
    for (batch, lo), g in sorted(groups.items()):
        seconds = sum(s.seconds for s in g)
        as_plain = seconds / plain_step[batch] * batch  # tokens plain steps would have emitted in that time
        rows.append(
            dict(
                batch=batch,
                drafted=str(lo) if lo <= 4 else f"{lo}-{lo + group - 1}",
                steps=len(g),
                tokens=sum(s.tokens for s in g) / len(g),
                ms=seconds / len(g) * 1e3,
                plain_ms=plain_step[batch] * 1e3,
                vs_plain=sum(s.tokens for s in g) / as_plain,
                extra=sum(s.tokens - s.batch for s in g),
                expected=sum(s.expected for s in g),
            )
        )
    drafting = [s for g in groups.values() for s in g]
    time_drafting = sum(s.seconds for s in drafting)
    as_plain = sum(s.seconds / plain_step[s.batch] * s.batch for s in drafting)
    total = dict(
        steps=len(alone),
        drafting_steps=len(drafting),
        time_share=time_drafting / max(sum(s.seconds for s in alone if s.batch in plain_step), 1e-9),
        vs_plain=sum(s.tokens for s in drafting) / as_plain if drafting else float("nan"),
        extra=sum(s.tokens - s.batch for s in drafting),
        expected=sum(s.expected for s in drafting),
    )
    return rows, total


def report(steps: list[Step], rate: float, args, conversations: int) -> None:
    rows, total = summarize(steps)
    print(f"`auto`, {args.workload}, {args.streams} stream(s), T={args.temperature:g}, {conversations} conversations: {rate:.1f} tok/s")
    print("| batch | drafted rows | steps | tokens a step | ms a step (plain) | tok/s vs plain steps | extra tokens / expected |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['drafted']} | {r['steps']} | {r['tokens']:.2f} | {r['ms']:.1f} ({r['plain_ms']:.1f}) "
            f"| {r['vs_plain']:.2f}x | {r['extra']} / {r['expected']:.0f} |"
        )
    if not total["drafting_steps"]:
        print(f"steps of decoding alone: {total['steps']}, none of them drafting")
        return
    print(
        f"steps of decoding alone: {total['steps']}, drafting {total['drafting_steps']} ({total['time_share']:.0%} of their time); "
        f"drafting steps {total['vs_plain']:.3f}x the tokens a second of plain steps of their batch; "
        f"extra tokens {total['extra']} where {total['expected']:.0f} were expected"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["chat", "agent", "code"], default="chat")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--warm", type=int, default=16, help="conversations run greedily first (the suffix cache fills)")
    p.add_argument("--conversations", type=int, default=16, help="conversations measured")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    convs = load_trace()[args.workload]
    if args.warm + args.conversations > len(convs) or args.streams < 1:
        raise SystemExit(f"the {args.workload} trace has {len(convs)} conversations; lower --warm or --conversations")
    engine = build("auto")
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    converse_pool(engine, convs[: args.warm], args.streams, greedy)
    steps = record(engine)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=1)
    measured = convs[args.warm : args.warm + args.conversations]
    started = time.perf_counter()
    tokens = converse_pool(engine, measured, args.streams, params)[0]
    report(steps, tokens / (time.perf_counter() - started), args, len(measured))
    charge = engine.policy.surcharge
    charged = ", ".join(f"{b}: {charge.extra[b] * 1e3:.2f} over {charge.plain[b] * 1e3:.2f}" for b in sorted(charge.extra))
    print(f"ms a drafting step adds beyond its rows' price, as charged at the end, over a plain step's, by batch: {charged or 'none'}")
    print(f"CPU: {cpu_name()}")


if __name__ == "__main__":
    main()
