"""The bundled draft head, side by side in one run: auto / eagle vs plain and n-gram decoding,
greedy, bf16, on the bundled default model and held-out prompts (clients/bench_prompts.py;
the head never saw them: it trained on questions the model wrote itself).

    .venv/bin/python benchmarks/draft_head_speed.py            # full run
    .venv/bin/python benchmarks/draft_head_speed.py --quick    # 3 prompts per set, 64 tokens
    .venv/bin/python benchmarks/draft_head_speed.py --repeats 3   # three passes: steadier ratios

Single stream: every prompt runs once per configuration and pass, the configurations' order
flipped from one prompt to the next (ABBA), so a slow spell on a shared machine hits all of
them alike. One pass is ten short generations per method: runs of it have differed by 10%
in auto vs ngram here, so read ratios from several passes. Batched: all open-chat prompts at once (--streams of them), auto vs plain, twice in
ABBA order. Ratios are what to read; absolute tok/s depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import time

import torch

from gateway.bench.prompts import GROUNDED, OPEN_CHAT
from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig


def chat(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


class Tally:
    def __init__(self) -> None:
        self.tokens = self.rounds = self.drafting_rounds = self.accepted = 0
        self.seconds = 0.0
        self.per_pos_drafted: list[int] = []
        self.per_pos_accepted: list[int] = []

    def add(self, outs, seconds: float) -> None:
        self.seconds += seconds
        for o in outs:
            st = o.stats
            self.tokens += len(o.token_ids)
            self.rounds += st.rounds
            self.accepted += st.accepted
            self.drafting_rounds += st.drafted_per_position[0] if st.drafted_per_position else 0
            for i, (d, a) in enumerate(zip(st.drafted_per_position, st.accepted_per_position)):
                if i >= len(self.per_pos_drafted):
                    self.per_pos_drafted.append(0)
                    self.per_pos_accepted.append(0)
                self.per_pos_drafted[i] += d
                self.per_pos_accepted[i] += a

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def accepted_length(self) -> float:
        """Mean tokens a drafting round emitted (accepted drafts + 1), vLLM's definition."""
        return 1 + self.accepted / self.drafting_rounds if self.drafting_rounds else 1.0

    def per_position(self, n: int = 5) -> str:
        return " / ".join(f"{a / d:.2f}" for a, d in list(zip(self.per_pos_accepted, self.per_pos_drafted))[:n] if d)


def timed(engine: Engine, prompts, params: SamplingParams):
    start = time.perf_counter()
    outs = engine.generate([chat(p) for p in prompts], params)
    return outs, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--streams", type=int, default=16, help="concurrent open-chat streams in the batched comparison")
    ap.add_argument("--draft-model", default=None, help="head directory (default: the bundled head)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="passes over the single-stream prompts (the method order reversed each pass)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    grounded, open_chat = GROUNDED, OPEN_CHAT
    if args.quick:
        grounded, open_chat, args.max_tokens = GROUNDED[:3], OPEN_CHAT[:3], min(args.max_tokens, 64)

    def engine(method: str) -> Engine:
        spec = SpeculativeConfig(
            method=method,
            num_speculative_tokens=args.k,
            draft_model=args.draft_model if method in ("auto", "eagle") else None,
        )
        return Engine(EngineConfig(dtype="bfloat16", speculative=spec, max_num_seqs=max(64, args.streams)), log=False)

    engines = {name: engine(name) for name in ("off", "auto", "eagle", "ngram")}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    for e in engines.values():  # warm-up
        e.generate(chat("Hi"), SamplingParams(max_tokens=8, temperature=0))

    tallies: dict[tuple[str, str], Tally] = {}
    for rep in range(args.repeats):
        for set_name, prompts in (("open chat", open_chat), ("input-grounded", grounded)):
            order = list(engines)
            for i, p in enumerate(prompts):
                for name in order if (i + rep) % 2 == 0 else order[::-1]:
                    outs, secs = timed(engines[name], [p], params)
                    tallies.setdefault((set_name, name), Tally()).add(outs, secs)

    print(
        f"\n## Single stream, greedy, up to {args.max_tokens} new tokens, bf16, {args.threads} threads, k <= {args.k}, "
        f"{args.repeats} pass(es)\n"
    )
    print("| prompts | method | tokens | tok/s | vs plain | vs ngram | mean accepted length | acceptance by position |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for (set_name, name), t in tallies.items():
        base, ng = tallies[(set_name, "off")].tps, tallies[(set_name, "ngram")].tps
        print(
            f"| {set_name} | {name} | {t.tokens} | {t.tps:.1f} | {t.tps / base:.2f}x | {t.tps / ng:.2f}x | "
            f"{t.accepted_length:.2f} | {t.per_position()} |"
        )

    batch = (open_chat * (args.streams // len(open_chat) + 1))[: args.streams]
    batched = {"off": Tally(), "auto": Tally()}
    for name in ("off", "auto", "auto", "off"):
        outs, secs = timed(engines[name], batch, params)
        batched[name].add(outs, secs)
    print(f"\n## {args.streams} open-chat streams batched (ABBA), greedy\n")
    print("| method | tokens | tok/s | vs plain | mean accepted length |")
    print("|---|---:|---:|---:|---:|")
    for name, t in batched.items():
        print(f"| {name} | {t.tokens} | {t.tps:.1f} | {t.tps / batched['off'].tps:.2f}x | {t.accepted_length:.2f} |")

    chat_auto = tallies[("open chat", "auto")].tps / tallies[("open chat", "off")].tps
    grounded_auto = tallies[("input-grounded", "auto")].tps / tallies[("input-grounded", "ngram")].tps
    many = batched["auto"].tps / batched["off"].tps
    print("\n## Goals")
    print(f"- open chat, one stream, auto >= 2.0x plain: {chat_auto:.2f}x {'met' if chat_auto >= 2.0 else 'NOT met'}")
    print(
        f"- input-grounded, auto no slower than ngram: {grounded_auto:.2f}x {'met' if grounded_auto >= 0.95 else 'NOT met'}"
    )
    print(
        f"- {args.streams} streams, auto no more than 5% behind plain: {many:.2f}x {'met' if many >= 0.95 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
