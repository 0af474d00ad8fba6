"""Batched acceptance of drafted tokens.

Vocabulary (after vLLM's rejection sampler): a round verifies k drafted tokens d_1..d_k of a
sequence with one target forward that yields target distributions p_1..p_{k+1}.
- accepted tokens: the longest prefix of drafts the target keeps;
- recovered token: at the first rejection, a token drawn from the target's correction
  (greedy: the target argmax; sampling: norm(max(p_i - q_i, 0)));
- bonus token: when all k are accepted, a token drawn from p_{k+1}.
Each round emits accepted + 1 tokens. k may differ per sequence; rows are padded to the
batch's largest k and masked by num_drafts.

Greedy: accept while d_i == argmax p_i. Sampling with a draft model (q known): accept d_i
with probability min(1, p_i(d_i) / q_i(d_i)), else recover from the residual
(Leviathan et al. 2023; Chen et al. 2023); the emitted tokens are distributed exactly as
the target's. A deterministic proposer (n-gram) has q_i = one-hot(d_i): accepting with
probability p_i(d_i) and recovering from p_i without d_i is the same as drawing y_i ~ p_i
and accepting while y_i == d_i, which is how it is computed here, so that a seeded request
samples the same tokens whether or not drafts were offered.

Trees (Draft.parents): row 0 is the target after the sequence's last token, row j + 1 after draft j
(having seen only draft j's ancestors). From row 0, the target's own token at the row (its argmax, or
for a sampled request a draw from p with the uniform of the output position the row decides) is looked
up among the row's children; the walk goes down while one matches, and the token that matched none is
emitted last. A one-hot proposal accepted this way is the multi-draft rejection sampler (SpecInfer)
with deterministic drafts: every emitted token is a draw from the target's own distribution, the very
draw plain decoding would make, so greedy and seeded output equal plain decoding's.

A sampled tree with q (Draft.probs: a node's children drawn from its q without replacement, in index
order) is walked by recursive rejection sampling (Jeon et al. 2024; SpecInfer's multi-draft sampling with
draws without replacement): at a row, the children are tried in the order drawn, the i-th accepted with
probability min(1, p_i(x) / q_i(x)), where q_i is q without the children tried before and p_i the
residual left by their rejections, norm(max(p_{i-1} - q_{i-1}, 0)); the walk goes down the accepted child,
and where every child is rejected the last residual draws the emitted token. Each test is the lossless
rejection of one proposal from the distribution it was drawn from, so the emitted token follows p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specstream.model.runner import tree_depths
from specstream.spec_decode.proposer import Draft
from specstream.sampling import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    STREAM_TREE_ACCEPT,
    argmax_rows,
    apply_penalties,
    apply_repetition_penalty,
    draw,
    probabilities_for,
    sample_from,
    uniform,
)
from specstream.sequence import Sequence


def accepted_prefix(matches: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True in each row, within num_drafts. [B, K] -> [B]."""
    k = matches.shape[1]
    valid = torch.arange(k, device=matches.device)[None, :] < num_drafts[:, None]
    return (matches & valid).long().cumprod(dim=1).sum(dim=1)


def accept_by_match(target_tokens: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept drafts equal to the target's own token at each position.

    target_tokens [B, K+1]: the target's choice per position (argmax for greedy, a sample
    from p_i for one-hot proposals); drafts [B, K]. Returns (num_accepted [B], next_token [B]).
    """
    k = drafts.shape[1]
    num_accepted = accepted_prefix(drafts == target_tokens[:, :k], num_drafts)
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token


def accept_rejection_sampling(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling for drafts drawn from known distributions.

    target_probs [B, K+1, V]; draft_probs [B, K, V]; drafts [B, K]; num_drafts [B];
    accept_uniforms [B, K]; sample_uniforms [B, K+1]: column i draws the recovered or bonus
    token when it lands at draft position i (i = num_accepted), so each output position has
    its own uniform. Returns (num_accepted [B], next_token [B]).
    """
    b, k = drafts.shape
    rows = torch.arange(b, device=drafts.device)
    p_d = target_probs[:, :k].gather(2, drafts[..., None]).squeeze(-1)
    q_d = draft_probs.gather(2, drafts[..., None]).squeeze(-1)
    # u < p/q, written without the division (q_d > 0 for a token sampled from q).
    num_accepted = accepted_prefix(accept_uniforms * q_d < p_d, num_drafts)
    p_next = target_probs[rows, num_accepted]
    rejected = num_accepted < num_drafts
    q_next = draft_probs[rows, num_accepted.clamp(max=max(k - 1, 0))] if k else torch.zeros_like(p_next)
    residual = torch.where(rejected[:, None], (p_next - q_next).clamp_(min=0), p_next)
    # p == q exactly leaves no residual mass; rejection then has probability zero, but
    # rounding can still get here: fall back to p.
    empty = residual.sum(-1) <= 0
    residual = torch.where(empty[:, None], p_next, residual)
    return num_accepted, sample_from(residual, sample_uniforms.gather(1, num_accepted[:, None]).squeeze(1))


@dataclass
class Round:
    """One sequence's part of a verification step."""

    seq: Sequence
    draft: Draft
    logits: torch.Tensor  # [len(draft.tokens) + 1, V]: row i is the target after draft i (row 0: after the last token)

    @property
    def k(self) -> int:
        return len(self.draft.tokens)


@dataclass
class RoundResult:
    num_accepted: int  # drafts the target kept
    tokens: list[int]  # to emit: the accepted drafts, then the recovered or bonus token
    path: list[int] | None = None  # [trees] the accepted drafts' indices, root first (None: the first num_accepted)
    at_leaf: bool = False  # no draft on the round's path was rejected: the walk ended at a leaf (a chain's last draft)

    def rows(self) -> list[int]:
        """The round's logits rows of the emitted tokens: row 0, then the row after each accepted draft."""
        if self.path is None:
            return list(range(self.num_accepted + 1))
        return [0] + [j + 1 for j in self.path]

    def take_rows(self, step_rows: torch.Tensor) -> torch.Tensor:
        """The rows() of this round's slice of a per-row tensor: a view where they are its first rows (a chain's
        round), a copy where a tree's path skips some."""
        return step_rows[: self.num_accepted + 1] if self.path is None else step_rows[self.rows()]


def verify_round(rounds: list[Round]) -> list[RoundResult]:
    """Accept or reject each sequence's drafts for one round: greedy rows by matching the
    target's argmax, sampled rows by matching a sample (one-hot proposals) or by rejection
    sampling (proposals with known q)."""
    logits = [_penalize(r) for r in rounds]
    trees = {i for i, r in enumerate(rounds) if r.draft.is_tree}
    greedy = [i for i, r in enumerate(rounds) if r.seq.params.greedy and i not in trees]
    sampled = [i for i, r in enumerate(rounds) if not r.seq.params.greedy]
    with_q = [i for i in sampled if rounds[i].draft.probs is not None and rounds[i].k and i not in trees]
    one_hot = [i for i in sampled if i not in with_q and i not in trees]
    # The sampled trees and the rounds with q read every row's distribution; one-hot rounds draw row by row as
    # their walk reaches it (_verify_one_hot), and one-hot trees draw every row from its logits (sampling.draw).
    whole = [i for i in sampled if i not in one_hot and rounds[i].draft.probs is not None]
    probs = dict(zip(whole, _probabilities([rounds[i] for i in whole], [logits[i] for i in whole])))
    results: list[RoundResult | None] = [None] * len(rounds)
    for i in sorted(trees):
        r = rounds[i]
        if r.seq.params.greedy or r.draft.probs is None:
            results[i] = _verify_tree(r, logits[i])
        else:
            results[i] = _verify_tree_with_q(r, probs[i])
    for idx, verify, inputs in (
        (greedy, _verify_greedy, logits),
        (one_hot, _verify_one_hot, logits),
        (with_q, _verify_with_q, probs),
    ):
        if idx:
            group = [rounds[i] for i in idx]
            num_accepted, next_token = verify(group, [inputs[i] for i in idx])
            if isinstance(num_accepted, torch.Tensor):
                num_accepted, next_token = num_accepted.tolist(), next_token.tolist()
            for i, r, a, t in zip(idx, group, num_accepted, next_token):
                results[i] = RoundResult(a, r.draft.tokens[:a] + [t], at_leaf=a == r.k)
    return results


def _penalize(r: Round) -> torch.Tensor:
    """The round's logits with presence/frequency penalties over the output so far and the repetition penalty over
    the prompt and output, each row counting the drafts before it as generated."""
    p = r.seq.params
    logits = _hold_ends(r)
    if not p.has_penalties:
        return logits
    rows, vocab, device = r.logits.shape[0], r.logits.shape[-1], r.logits.device
    drafted = torch.zeros(rows, vocab, dtype=r.logits.dtype)  # each row's drafts before it, as generated
    if r.draft.is_tree:
        # Row j + 1 follows draft j and its ancestors: it counts them as generated.
        for j in range(r.k):
            a = j
            while a >= 0:
                drafted[j + 1, r.draft.tokens[a]] += 1
                a = r.draft.parents[a]
    else:
        for i, tok in enumerate(r.draft.tokens):
            drafted[i + 1 :, tok] += 1
    drafted = drafted.to(device)
    if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
        counts = torch.bincount(torch.tensor(r.seq.output_ids, dtype=torch.long), minlength=vocab)[:vocab]
        counts = counts.to(device=device, dtype=r.logits.dtype) + drafted
        presence = torch.full((rows,), p.presence_penalty, device=device)
        frequency = torch.full((rows,), p.frequency_penalty, device=device)
        logits = apply_penalties(logits, counts, presence, frequency)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(r.seq.token_ids, dtype=torch.long)] = True  # the prompt's tokens and the output's
        logits = apply_repetition_penalty(logits, seen.to(device) | (drafted > 0), p.repetition_penalty)
    return logits


def _hold_ends(r: Round) -> torch.Tensor:
    """The round's logits with the sequence's held ends (EOS, its stop tokens) at -inf on every row that decides an
    output position before params.min_tokens (row j: the position after the drafts on its path)."""
    before = r.seq.params.min_tokens - r.seq.num_output_tokens  # rows deciding positions below min_tokens
    if not r.seq.held_ends or before <= 0:
        return r.logits
    depths = [0] + (draft_depths(r.draft.parents) if r.draft.is_tree else list(range(1, len(r.draft.tokens) + 1)))
    rows = [j for j, d in enumerate(depths) if d < before]
    logits = r.logits.clone()
    logits[torch.tensor(rows)[:, None], torch.tensor(r.seq.held_ends)[None, :]] = float("-inf")
    return logits


def _probabilities(rounds: list[Round], logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each sampled round's target distributions, computed in one batch."""
    if not rounds:
        return []
    sizes = [x.shape[0] for x in logits]
    row_params = [r.seq.params for r, n in zip(rounds, sizes) for _ in range(n)]
    return list(probabilities_for(torch.cat(logits), row_params).split(sizes))


def draft_depths(parents: list[int]) -> list[int]:
    """Each draft's depth: 1 for a token that follows the sequence's last token, its parent's + 1 below (as the
    runner places the verified rows: tree_depths)."""
    return tree_depths(parents, root=1)


def _verify_tree(r: Round, rows: torch.Tensor) -> RoundResult:
    """Walk a draft tree from its root while the target's own token at a row is one of the row's children.
    rows: the round's penalized logits, [k + 1, V]."""
    parents = r.draft.parents
    if r.seq.params.greedy:
        choice = argmax_rows(rows).tolist()
    else:
        # Row 0 decides the next output position; row j + 1 the one after draft j's depth.
        depth = [0] + draft_depths(parents)
        pos = r.seq.num_output_tokens
        us = torch.tensor([uniform(r.seq.seed, pos + d, STREAM_SAMPLE) for d in depth], dtype=torch.float64, device=rows.device)
        choice = draw(rows, [r.seq.params] * len(depth), us).tolist()
    children: dict[int, dict[int, int]] = {}
    for j, (tok, p) in enumerate(zip(r.draft.tokens, parents)):
        children.setdefault(p + 1, {}).setdefault(tok, j)
    path, row = [], 0
    while (j := children.get(row, {}).get(choice[row])) is not None:
        path.append(j)
        row = j + 1
    return RoundResult(len(path), [r.draft.tokens[j] for j in path] + [choice[row]], path, row not in children)


def _verify_tree_with_q(r: Round, rows: torch.Tensor) -> RoundResult:
    """Recursive rejection sampling down a tree whose children were drawn from q without replacement.
    rows: the round's target probabilities, [k + 1, V]; r.draft.probs[j]: the q node j was drawn from."""
    tokens, q_rows = r.draft.tokens, r.draft.probs
    children: dict[int, list[int]] = {}
    for j, parent in enumerate(r.draft.parents):
        children.setdefault(parent + 1, []).append(j)
    pos = r.seq.num_output_tokens
    path, row = [], 0
    while True:
        depth = len(path)
        p = rows[row].double()
        accepted = None
        if row in children:
            q = q_rows[children[row][0]].double().clone()
            for i, j in enumerate(children[row]):
                x = tokens[j]
                p_sum, q_sum = float(p.sum()), float(q.sum())
                if p_sum <= 0 or q_sum <= 0:
                    break
                if uniform(r.seq.seed, pos + depth, STREAM_TREE_ACCEPT + i) * float(q[x]) / q_sum < float(p[x]) / p_sum:
                    accepted = j
                    break
                p = (p / p_sum - q / q_sum).clamp_(min=0)
                q[x] = 0.0
        if accepted is None:
            # Every child rejected (or a leaf: the bonus token). p == q leaves no residual mass, which
            # rejection then has probability zero of reaching; rounding can: fall back to p.
            if float(p.sum()) <= 0:
                p = rows[row].double()
            u = torch.tensor([uniform(r.seq.seed, pos + depth, STREAM_SAMPLE)], dtype=torch.float64)
            last = int(sample_from(p[None], u)[0])
            return RoundResult(len(path), [tokens[j] for j in path] + [last], path, row not in children)
        path.append(accepted)
        row = accepted + 1


def _verify_greedy(rounds: list[Round], logits: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """The target's argmax at every row, one kernel call per run of rounds whose rows lie one after another in a
    step's logits (all of a step's greedy rounds, unless sampled or masked rounds sit between them), then matched."""
    return _match(rounds, [argmax_rows(run) for run in _runs(logits)])


def _verify_one_hot(rounds: list[Round], logits: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """Draw y_i ~ p_i with the uniform of the output position it decides, accept while y_i == d_i.

    Only the rows the walk reaches are drawn: depth by depth, every round still matching draws its row at that
    depth, all of them in one call (each row's draw is its own: the same token as a draw of every row at once, or
    of that row alone, as plain decoding draws it). A round whose first draft is rejected computes one row's
    distribution, not k + 1 (at T=0.7 most rounds end within a draft or two)."""
    accepted, following = [0] * len(rounds), [0] * len(rounds)
    live, depth = list(range(len(rounds))), 0
    while live:
        rows = _stacked([logits[i][depth] for i in live])
        us = torch.tensor(
            [uniform(rounds[i].seq.seed, rounds[i].seq.num_output_tokens + depth, STREAM_SAMPLE) for i in live],
            dtype=torch.float64,
            device=rows.device,
        )
        going = []
        for i, y in zip(live, draw(rows, [rounds[i].seq.params for i in live], us).tolist()):
            draft = rounds[i].draft.tokens
            if depth < len(draft) and y == draft[depth]:
                accepted[i] += 1
                going.append(i)
            else:
                following[i] = y
        live, depth = going, depth + 1
    return accepted, following


def _runs(blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Row blocks [n_i, V] (each round's logits) joined into runs: a view over each maximal run of blocks that follow
    one another in one tensor's memory (as Engine._rounds splits a step's logits), a block alone where the next is
    elsewhere (a copy: penalized or grammar-masked rows). The runs hold the blocks' rows in order."""
    runs, start = [], 0
    for i in range(1, len(blocks) + 1):
        if i < len(blocks) and _follows(blocks[i - 1], blocks[i]):
            continue
        first, rows = blocks[start], sum(b.shape[0] for b in blocks[start:i])
        runs.append(first if i - start == 1 else first.as_strided((rows, first.shape[1]), first.stride()))
        start = i
    return runs


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether block b's rows start where block a's end, at a's row step, in the same memory."""
    return (
        a.dim() == b.dim() == 2
        and a.dtype == b.dtype
        and a.stride() == b.stride()
        and a.shape[1] == b.shape[1]
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and b.data_ptr() == a.data_ptr() + a.shape[0] * a.stride(0) * a.element_size()
    )


def _stacked(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows [V] as one tensor [len(rows), V]: a view where they lie at equal steps in one tensor's memory (the
    decoding sequences' rows of a step's logits, one after another, as plain decoding's are), else a copy."""
    first, size = rows[0], rows[0].element_size()
    step = rows[1].data_ptr() - first.data_ptr() if len(rows) > 1 else first.numel() * size
    base = first.untyped_storage().data_ptr()
    evenly = step >= first.numel() * size and step % size == 0 and all(
        r.shape == first.shape and r.stride() == (1,) and r.dtype == first.dtype
        and r.untyped_storage().data_ptr() == base and r.data_ptr() - first.data_ptr() == i * step
        for i, r in enumerate(rows)
    )
    return first.as_strided((len(rows), first.shape[0]), (step // size, 1)) if evenly else torch.stack(rows)


def _verify_with_q(rounds: list[Round], probs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    k = max(r.k for r in rounds)
    vocab, device = probs[0].shape[-1], probs[0].device
    p = torch.zeros((len(rounds), k + 1, vocab), device=device)
    q = torch.zeros((len(rounds), k, vocab), device=device)
    accept_u = torch.zeros((len(rounds), k), dtype=torch.float64, device=device)
    sample_u = torch.zeros((len(rounds), k + 1), dtype=torch.float64, device=device)
    for j, (r, probs_j) in enumerate(zip(rounds, probs)):
        p[j, : r.k + 1] = probs_j
        q[j, : r.k] = r.draft.probs[:, :vocab]
        accept_u[j, : r.k] = _uniforms(r.seq, r.k, STREAM_ACCEPT, device)
        # The recovered/bonus token uses the uniform of the position it lands on, so no
        # later round can draw with the same one.
        sample_u[j, : r.k + 1] = _uniforms(r.seq, r.k + 1, STREAM_SAMPLE, device)
    drafts, num_drafts = _drafts(rounds, k, device)
    return accept_rejection_sampling(p, q, drafts, num_drafts, accept_u.to(p.dtype), sample_u)


def _match(rounds: list[Round], choices: list[torch.Tensor]) -> tuple[list[int], list[int]]:
    """accept_by_match over rounds of different k: choices, joined, hold the target's token at every row of the
    rounds in order (round j's k_j + 1 rows, then round j + 1's). The choices are read back at once and matched in
    Python: a step's rounds hold a few dozen rows, fewer than padding them into tensors is worth, on every step,
    plain decoding's included."""
    flat, at = (choices[0] if len(choices) == 1 else torch.cat(choices)).tolist(), 0
    accepted, following = [], []
    for r in rounds:
        row, at = flat[at : at + r.k + 1], at + r.k + 1
        n = 0
        for draft, target in zip(r.draft.tokens, row):
            if draft != target:
                break
            n += 1
        accepted.append(n)
        following.append(row[n])
    return accepted, following


def _drafts(rounds: list[Round], k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts padded to k [B, k], and each round's number of drafts [B]."""
    out = torch.zeros((len(rounds), k), dtype=torch.long, device=device)
    for j, r in enumerate(rounds):
        if r.k:
            out[j, : r.k] = torch.tensor(r.draft.tokens, dtype=torch.long, device=device)
    return out, torch.tensor([r.k for r in rounds], device=device)


def _uniforms(seq: Sequence, n: int, stream: int, device) -> torch.Tensor:
    """The uniforms of the next n output positions of seq in one stream."""
    pos = seq.num_output_tokens
    return torch.tensor([uniform(seq.seed, pos + t, stream) for t in range(n)], dtype=torch.float64, device=device)
