"""What the drafts `auto` picks from could gain at best on the open-chat trace's greedy answers: a bound on its
tokens per drafting step, with no timing in it.

Greedy decoding is lossless, so the answers any method gives are plain decoding's. This runs plain decoding (method
`off`) over the trace's conversations (benchmarks/open_chat_trace.py) at one stream, keeps each request's prompt and
answer, and replays the answers round by round offline through the n-gram and suffix proposers as `auto` builds them
(the suffix cache filled by the --warm conversations' answers first, then by each answer as it ends, as a server's
is). Each round, a draft's accepted length is how far it agrees with the answer (a tree's, its longest agreeing path),
and the round emits that plus one token. Three ways to pick a round's draft:
- n-gram alone, suffix alone: that proposer's draft, whole (up to --k);
- the better of the two: whichever agrees further with the answer, known only in hindsight. `auto` picks one of them
  (or the draft head's chain, or none) before the round, and cuts it to what pays, so its tokens per drafting step
  are at most this, give or take the head's rounds; and a drafting step costs at least a plain one, so `auto`'s
  throughput over plain decoding is below it too.
For each suffix setting of --suffix (max_spec_factor:min_token_prob; the server's `suffix_max_spec_factor` and
`suffix_min_token_prob`), since a longer suffix draft is kept further where its text repeats.

    .venv/bin/python benchmarks/draft_oracle.py --workload agent
    .venv/bin/python benchmarks/draft_oracle.py --workload chat --suffix 1:0.1 2:0.1 4:0.05
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).parent))
from draft_hint import build, converse_pool  # noqa: E402
from open_chat_trace import Conversation, load_trace  # noqa: E402

from specstream import SamplingParams  # noqa: E402
from specstream.config import SpeculativeConfig  # noqa: E402
from specstream.sequence import Sequence  # noqa: E402
from specstream.spec_decode.ngram import NgramProposer  # noqa: E402
from specstream.spec_decode.proposer import Draft  # noqa: E402
from specstream.spec_decode.suffix import SuffixProposer  # noqa: E402

PICKS = ("n-gram alone", "suffix alone", "the better of the two")


class Answer(NamedTuple):
    prompt: list[int]
    output: list[int]
    finish_reason: str


def answers(convs: list[Conversation], max_tokens: int) -> list[Answer]:
    """Plain greedy decoding's answers to convs, in the order they ended (one stream: the order they were asked)."""
    engine = build("off")
    done: list[Answer] = []
    finish = engine._finish

    def finished(seq: Sequence) -> None:
        done.append(Answer(seq.token_ids[: seq.num_prompt_tokens], seq.output_ids, seq.finish_reason or "stop"))
        finish(seq)

    engine._finish = finished
    converse_pool(engine, convs, 1, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return done


def agreed(draft: Draft, truth: list[int]) -> int:
    """How many of draft's tokens a round keeps where the target's tokens are `truth`: along its one path, or a
    tree's longest path that agrees."""
    node, n = -1, 0
    parents = draft.parents if draft.parents is not None else list(range(-1, len(draft.tokens) - 1))
    while n < len(truth):
        node = next((i for i, (t, p) in enumerate(zip(draft.tokens, parents)) if p == node and t == truth[n]), None)
        if node is None:
            return n
        n += 1
    return n


class Tally(NamedTuple):
    rounds: int
    tokens: int
    suffix_drafted: int  # tokens (a tree's nodes) the suffix proposer drafted, over the rounds it drafted any
    suffix_rounds: int


def replay(done: list[Answer], warm: int, k: int, pick: str, factor: float, min_prob: float) -> Tally:
    """Rounds and tokens of the answers after the first `warm`, each round drafted as `pick` says."""
    spec = SpeculativeConfig()
    ngram = NgramProposer(spec.ngram_min, spec.ngram_max)
    suffix = SuffixProposer(spec.suffix_max_depth, factor, min_prob, spec.suffix_max_cached_requests, trees=spec.tree_drafts)
    params = SamplingParams(max_tokens=len(max(done, key=lambda a: len(a.output)).output), temperature=0.0)
    rounds = tokens = drafted = drafting = 0
    for i, answer in enumerate(done):
        seq, pos = Sequence(f"answer-{i}", answer.prompt, params, i), 0
        while pos < len(answer.output):
            truth = answer.output[pos:]
            kept = 0
            if pick != PICKS[1]:
                kept = agreed(Draft(ngram.match_seq(seq, k)[0]), truth)
            if pick != PICKS[0]:
                draft = suffix.draft(seq, k)
                kept = max(kept, agreed(draft, truth))
                if i >= warm and draft.tokens:
                    drafted, drafting = drafted + len(draft.tokens), drafting + 1
            step = min(kept + 1, len(truth))
            seq.token_ids.extend(truth[:step])
            pos += step
            if i >= warm:
                rounds, tokens = rounds + 1, tokens + step
        seq.finish_reason = answer.finish_reason
        ngram.release(seq)
        suffix.release(seq)
    return Tally(rounds, tokens, drafted, drafting)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["chat", "agent", "code"], default="agent")
    p.add_argument("--warm", type=int, default=30, help="conversations whose answers only fill the suffix cache")
    p.add_argument("--conversations", type=int, default=48, help="conversations replayed after them")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=SpeculativeConfig().num_speculative_tokens, help="longest draft")
    p.add_argument("--suffix", nargs="+", default=["1:0.1", "2:0.1", "4:0.05"], help="max_spec_factor:min_token_prob")
    args = p.parse_args()
    try:
        settings = [(float(f), float(m)) for f, m in (s.split(":") for s in args.suffix)]
    except ValueError:
        settings = []
    if not settings or not all(0 < f <= 64 and 0 < m <= 1 for f, m in settings):
        raise SystemExit("--suffix takes max_spec_factor:min_token_prob pairs, as 2:0.1 (factor above 0, min prob in (0, 1])")
    if not 1 <= args.k <= 64 or min(args.warm, args.conversations) < 0 or args.conversations < 1:
        raise SystemExit("--k takes 1 to 64; --warm at least 0 and --conversations at least 1")
    started = time.perf_counter()
    convs = load_trace()[args.workload][: args.warm + args.conversations]
    done = answers(convs, args.max_tokens)
    first = sum(len(c.turns) for c in convs[: args.warm])  # the warm conversations' answers
    print(f"\n{args.workload}: {len(done) - first} answers ({sum(len(a.output) for a in done[first:])} tokens) after "
          f"{first} warm ones, plain greedy decoding in {time.perf_counter() - started:.0f} s; drafts up to {args.k}")
    print("\n| suffix factor : min prob | " + " | ".join(f"{name}: tokens a round" for name in PICKS)
          + " | suffix tokens a drafting round |")
    print("|---|---|---|---|---|")
    for factor, min_prob in settings:
        tallies = [replay(done, first, args.k, pick, factor, min_prob) for pick in PICKS]
        row = " | ".join(f"{t.tokens / t.rounds:.3f}" for t in tallies)
        print(f"| {factor:g} : {min_prob:g} | {row} | {tallies[1].suffix_drafted / max(tallies[1].suffix_rounds, 1):.1f} |")


if __name__ == "__main__":
    main()
