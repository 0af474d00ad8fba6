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
"""

from __future__ import annotations

import torch

from specstream.sampling import STREAM_ACCEPT, STREAM_SAMPLE, apply_penalties, probabilities_for, sample_from, uniform


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


def _pad(rows: list[list[int]], width: int, device) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long, device=device)
    return out


def verify_round(rounds: list) -> list[tuple[int, list[int]]]:
    """Accept or reject each sequence's drafts for one round.

    rounds: (sequence, draft, logits [len(draft.tokens) + 1, V]) per sequence. Returns, per
    sequence, (number of drafts accepted, tokens to emit = accepted drafts + one more).
    """
    results: list[tuple[int, list[int]] | None] = [None] * len(rounds)
    if not rounds:
        return []
    device = rounds[0][2].device
    logits = []
    for seq, draft, rows in rounds:
        p = seq.params
        if p.has_penalties:
            vocab = rows.shape[-1]
            counts = torch.bincount(torch.tensor(seq.output_ids, dtype=torch.long), minlength=vocab)[:vocab]
            counts = counts.to(device=device, dtype=rows.dtype).expand(len(draft.tokens) + 1, -1).clone()
            for i, tok in enumerate(draft.tokens):
                counts[i + 1 :, tok] += 1
            n = rows.shape[0]
            rows = apply_penalties(rows, counts, torch.full((n,), p.presence_penalty, device=device), torch.full((n,), p.frequency_penalty, device=device))
        logits.append(rows)

    def store(idx: list[int], acc: torch.Tensor, nxt: torch.Tensor) -> None:
        for j, i in enumerate(idx):
            a = int(acc[j])
            results[i] = (a, rounds[i][1].tokens[:a] + [int(nxt[j])])

    def by_match(idx: list[int], choices: list[torch.Tensor]) -> None:
        k = max(len(rounds[i][1].tokens) for i in idx)
        targets = torch.stack([torch.nn.functional.pad(c, (0, k + 1 - len(c))) for c in choices])
        drafts = _pad([rounds[i][1].tokens for i in idx], k, device)
        num = torch.tensor([len(rounds[i][1].tokens) for i in idx], device=device)
        store(idx, *accept_by_match(targets, drafts, num))

    greedy = [i for i, (s, _, _) in enumerate(rounds) if s.params.greedy]
    if greedy:
        by_match(greedy, [logits[i].argmax(-1) for i in greedy])
    sampled = [i for i, (s, _, _) in enumerate(rounds) if not s.params.greedy]
    if not sampled:
        return results
    sizes = [logits[i].shape[0] for i in sampled]
    row_params = [rounds[i][0].params for i, n in zip(sampled, sizes) for _ in range(n)]
    probs = dict(zip(sampled, probabilities_for(torch.cat([logits[i] for i in sampled]), row_params).split(sizes)))
    with_q = [i for i in sampled if rounds[i][1].probs is not None and rounds[i][1].tokens]
    one_hot = [i for i in sampled if i not in with_q]
    if one_hot:
        choices = []
        for i in one_hot:
            seq = rounds[i][0]
            pos = seq.num_output_tokens
            us = torch.tensor([uniform(seq.seed, pos + j, STREAM_SAMPLE) for j in range(probs[i].shape[0])], dtype=torch.float64, device=device)
            choices.append(sample_from(probs[i], us))
        by_match(one_hot, choices)
    if with_q:
        k = max(len(rounds[i][1].tokens) for i in with_q)
        vocab = probs[with_q[0]].shape[-1]
        p = torch.zeros((len(with_q), k + 1, vocab), device=device)
        q = torch.zeros((len(with_q), k, vocab), device=device)
        acc_u = torch.zeros((len(with_q), k), dtype=torch.float64, device=device)
        smp_u = torch.zeros((len(with_q), k + 1), dtype=torch.float64, device=device)
        for j, i in enumerate(with_q):
            seq, draft = rounds[i][0], rounds[i][1]
            n, pos = len(draft.tokens), seq.num_output_tokens
            p[j, : n + 1] = probs[i]
            q[j, :n] = draft.probs[:, :vocab]
            acc_u[j, :n] = torch.tensor([uniform(seq.seed, pos + t, STREAM_ACCEPT) for t in range(n)], dtype=torch.float64)
            # The recovered/bonus token uses the uniform of the position it lands on, so no
            # later round can draw with the same one.
            smp_u[j, : n + 1] = torch.tensor([uniform(seq.seed, pos + t, STREAM_SAMPLE) for t in range(n + 1)], dtype=torch.float64)
        drafts = _pad([rounds[i][1].tokens for i in with_q], k, device)
        num = torch.tensor([len(rounds[i][1].tokens) for i in with_q], device=device)
        store(with_q, *accept_rejection_sampling(p, q, drafts, num, acc_u.to(p.dtype), smp_u))
    return results
