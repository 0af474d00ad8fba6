"""`auto` with and without the k policy's draft hint (Proposer.draft_hint: a greedy request's long n-gram match
granted k at what such matches were accepted lately), beside `off`, in process, side by side in one run, on
the open-chat trace's conversations (benchmarks/open_chat_trace.py: MT-Bench and AlpacaEval chat, Berkeley
function-calling agent tasks, fetched from PyPI into the cache), one conversation at a time (--streams: that many
in flight, each answered turn sending the next at once, as the served benchmark's clients do; --lockstep: each
turn of --streams conversations as one batch, the way this script ran them before, which overstates drafting at
many streams), every turn carrying the engine's own earlier answers.

Both `auto` engines first run --warm conversations (their suffix caches and shared acceptance records fill
as a server's would); each repeat then takes --per-repeat conversations no engine has seen, every engine in
turn, the order reversed every other repeat. Prints tokens per second and each repeat's ratio to `off`.

    .venv/bin/python benchmarks/draft_hint.py --workload agent
    .venv/bin/python benchmarks/draft_hint.py --workload chat --temperature 0.7 --repeats 6
    .venv/bin/python benchmarks/draft_hint.py --workload agent --temperature 0.7 --repeats 4 --per-repeat 32 --streams 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from open_chat_trace import Conversation, load_trace  # noqa: E402
from quant_forward import cpu_name  # noqa: E402

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig  # noqa: E402


def build(method: str, hint: bool = True) -> Engine:
    engine = Engine(EngineConfig(speculative=SpeculativeConfig(method=method)), log=False)
    engine.upgrade(wait=True)  # the compiled forward, as a server runs once it is installed
    while not engine.priced:  # the forward-time curve the policy prices drafts with
        engine.idle()
    if not hint:
        engine.policy.draft_hint = lambda seq: None
    return engine


def converse(engine: Engine, conv: Conversation, params: SamplingParams) -> tuple[int, int, int]:
    """(completion tokens, drafted, accepted) of one conversation, turn by turn."""
    return converse_together(engine, [conv], params)


def converse_pool(engine: Engine, convs: list[Conversation], streams: int, params: SamplingParams) -> tuple[int, int, int]:
    """(completion tokens, drafted, accepted) of conversations served as the served benchmark's clients serve them
    (open_chat_trace.run_cell): `streams` conversations in flight, each answered turn sending that conversation's
    next turn at once, a finished conversation replaced by the next. Unlike converse_together's turns in lockstep,
    no sequence waits for the batch's longest answer, so the engine decodes `streams` sequences nearly all the time
    (in lockstep each turn ends with a few long answers decoding alone, where drafting pays most)."""
    queue = list(convs)
    live: dict[str, tuple[Conversation, list[dict], int, list[str]]] = {}  # request id -> (conv, history, turn, text)
    tokens = drafted = accepted = 0

    def send(conv: Conversation, history: list[dict], turn: int) -> None:
        history.append({"role": "user", "content": conv.turns[turn]})
        live[engine.add_request(history, params)] = (conv, history, turn, [])

    def start_next() -> None:
        if queue:
            conv = queue.pop(0)
            send(conv, [{"role": "system", "content": conv.system}] if conv.system else [], 0)

    for _ in range(streams):
        start_next()
    while live:
        for chunk in engine.step():
            conv, history, turn, text = live[chunk.request_id]
            text.append(chunk.text)
            tokens, drafted, accepted = tokens + len(chunk.token_ids), drafted + chunk.num_drafted, accepted + chunk.num_accepted
            if not chunk.finished:
                continue
            del live[chunk.request_id]
            if chunk.error:
                raise RuntimeError(f"{chunk.request_id}: {chunk.error}")
            history.append({"role": "assistant", "content": "".join(text)})
            if turn + 1 < len(conv.turns):
                send(conv, history, turn + 1)
            else:
                start_next()
    return tokens, drafted, accepted


def converse_together(engine: Engine, convs: list[Conversation], params: SamplingParams) -> tuple[int, int, int]:
    """(completion tokens, drafted, accepted) of conversations run side by side: each turn of every conversation
    that has one is one batch of requests (the engine decodes them together)."""
    histories = [[{"role": "system", "content": c.system}] if c.system else [] for c in convs]
    tokens = drafted = accepted = 0
    for t in range(max(len(c.turns) for c in convs)):
        live = [i for i, c in enumerate(convs) if t < len(c.turns)]
        for i in live:
            histories[i].append({"role": "user", "content": convs[i].turns[t]})
        for i, out in zip(live, engine.generate([histories[i] for i in live], params)):
            histories[i].append({"role": "assistant", "content": out.text})
            tokens, drafted, accepted = tokens + len(out.token_ids), drafted + out.stats.drafted, accepted + out.stats.accepted
    return tokens, drafted, accepted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["chat", "agent", "code"], default="agent")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warm", type=int, default=30)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--per-repeat", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=1, help="conversations in flight at once (each repeat's, as clients send them)")
    p.add_argument(
        "--lockstep", action="store_true", help="run --streams conversations turn by turn as one batch each turn (the old way)"
    )
    args = p.parse_args()
    if not 1 <= args.streams <= args.per_repeat:
        raise SystemExit("--streams must be between 1 and --per-repeat")
    convs = load_trace()[args.workload]
    if args.warm + args.repeats * args.per_repeat > len(convs):
        raise SystemExit(f"the {args.workload} trace has {len(convs)} conversations; lower --warm, --repeats or --per-repeat")
    engines = {"off": build("off"), "auto": build("auto"), "auto, no hint": build("auto", hint=False)}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=1)
    for name in ("auto", "auto, no hint"):
        for conv in convs[: args.warm]:
            converse(engines[name], conv, params)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.repeats):
        batch = convs[args.warm + r * args.per_repeat : args.warm + (r + 1) * args.per_repeat]
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            start, tokens, drafted, accepted = time.perf_counter(), 0, 0, 0
            if args.lockstep:
                for i in range(0, len(batch), args.streams):
                    t, d, a = converse_together(engines[name], batch[i : i + args.streams], params)
                    tokens, drafted, accepted = tokens + t, drafted + d, accepted + a
            else:
                tokens, drafted, accepted = converse_pool(engines[name], batch, args.streams, params)
            rates[name].append(tokens / (time.perf_counter() - start))
            print(f"repeat {r} {name}: {rates[name][-1]:.1f} tok/s, {drafted} drafted, {accepted} accepted", file=sys.stderr)
    print(f"| engine ({args.workload}, T={args.temperature:g}, {args.streams} at a time) | tok/s | vs off (each repeat) |")
    print("|---|---|---|")
    for name, rs in rates.items():
        ratios = [x / y for x, y in zip(rs, rates["off"])]
        each = "/".join(f"{x:.2f}" for x in ratios)
        print(f"| {name} | {statistics.mean(rs):.1f} | {statistics.mean(ratios):.2f}x ({each}) |")
    print(f"\nCPU: {cpu_name()}")


if __name__ == "__main__":
    main()
