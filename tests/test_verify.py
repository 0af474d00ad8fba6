"""Acceptance: greedy prefix matching and lossless rejection sampling.

Statistical tests draw many rounds in one batched call with fixed seeds; each frequency must
lie within 5 standard deviations of its exact probability (sqrt(p(1-p)/N)), a bound that a
correct sampler misses with probability below 1e-6 per cell, and the seeds are fixed, so the
tests cannot flake."""

import torch

from specstream.sampling import sample_from
from specstream.spec_decode.verify import accept_by_match, accept_rejection_sampling, accepted_prefix


def within_bounds(samples: torch.Tensor, probs: torch.Tensor) -> None:
    n = samples.numel()
    freq = torch.bincount(samples, minlength=probs.numel()).double() / n
    p = probs.double()
    bound = 5 * torch.sqrt(p * (1 - p) / n) + 1.0 / n
    assert n >= 500
    assert ((freq - p).abs() <= bound).all(), f"freq {freq.tolist()} vs p {p.tolist()}"


def test_accepted_prefix_stops_at_first_mismatch_and_at_num_drafts():
    matches = torch.tensor([[True, True, False, True], [True, True, True, True], [False, True, True, True]])
    assert accepted_prefix(matches, torch.tensor([4, 2, 4])).tolist() == [2, 2, 0]


def test_greedy_accepts_matching_prefix_plus_target_token():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    drafts = torch.tensor([[5, 6, 9], [5, 6, 7], [0, 0, 0]])
    num_accepted, nxt = accept_by_match(target, drafts, torch.tensor([3, 3, 0]))
    assert num_accepted.tolist() == [2, 3, 0]
    assert nxt.tolist() == [7, 8, 1]  # correction, bonus, plain next token


def test_a_steps_rounds_of_any_k_match_as_the_batched_tensor_rule_does():
    """verify_round matches each round's drafts in Python over one read-back of the target's tokens; on rounds of
    k 0 to 5 (plain decoding's included) it agrees with accept_by_match over the padded batch."""
    from specstream.spec_decode.proposer import Draft
    from specstream.spec_decode.verify import Round, _match

    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        ks = torch.randint(0, 6, (6,), generator=g).tolist()
        choices = [torch.randint(0, 3, (k + 1,), generator=g) for k in ks]
        rounds = [Round(None, Draft(torch.randint(0, 3, (k,), generator=g).tolist()), None) for k in ks]
        k = max(ks)
        targets = torch.stack([torch.nn.functional.pad(c, (0, k + 1 - len(c))) for c in choices])
        drafts = torch.zeros((len(ks), k), dtype=torch.long)
        for j, r in enumerate(rounds):
            drafts[j, : r.k] = torch.tensor(r.draft.tokens, dtype=torch.long)
        expected = accept_by_match(targets, drafts, torch.tensor(ks))
        assert _match(rounds, choices) == (expected[0].tolist(), expected[1].tolist())


def test_inverse_cdf_sampling_matches_distribution_and_skips_zero_mass():
    g = torch.Generator().manual_seed(1)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3])
    n = 40000
    samples = sample_from(probs.expand(n, -1), torch.rand(n, generator=g, dtype=torch.float64))
    within_bounds(samples, probs)
    assert sample_from(probs[None], torch.zeros(1, dtype=torch.float64)).item() == 1


def random_dist(g, *shape, peak=2.0):
    return (torch.randn(*shape, generator=g) * peak).softmax(-1)


def test_rejection_sampling_emits_target_distribution():
    g = torch.Generator().manual_seed(0)
    n, k, vocab = 60000, 3, 6
    p = random_dist(g, k + 1, vocab)
    q = random_dist(g, k, vocab)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], dim=1)
    num_accepted, nxt = accept_rejection_sampling(
        p.expand(n, -1, -1),
        q.expand(n, -1, -1),
        drafts,
        torch.full((n,), k),
        torch.rand(n, k, generator=g),
        torch.rand(n, k + 1, generator=g, dtype=torch.float64),
    )
    first = torch.where(num_accepted > 0, drafts[:, 0], nxt)
    within_bounds(first, p[0])
    # Given the first draft was accepted, the second emitted token follows p_2.
    took_first = num_accepted > 0
    second = torch.where(num_accepted[took_first] > 1, drafts[took_first, 1], nxt[took_first])
    within_bounds(second, p[1])
    # All accepted: the bonus token follows p_{k+1}.
    within_bounds(nxt[num_accepted == k], p[k])


def test_rejection_sampling_with_identical_draft_accepts_everything():
    g = torch.Generator().manual_seed(3)
    p = random_dist(g, 3, 5)
    drafts = torch.tensor([[1, 2]])
    num_accepted, _ = accept_rejection_sampling(p[None], p[None, :2], drafts, torch.tensor([2]), torch.rand(1, 2, generator=g), torch.rand(1, 3, dtype=torch.float64))
    assert num_accepted.item() == 2


def test_one_hot_proposal_by_matching_samples_emits_target_distribution():
    # A deterministic proposer always drafts token 2; matching it against y ~ p must still
    # emit tokens distributed as p.
    g = torch.Generator().manual_seed(5)
    n, vocab = 40000, 5
    p = random_dist(g, 2, vocab)
    ys = torch.stack([sample_from(p[i].expand(n, -1), torch.rand(n, generator=g, dtype=torch.float64)) for i in range(2)], dim=1)
    num_accepted, nxt = accept_by_match(ys, torch.full((n, 1), 2), torch.full((n,), 1))
    first = torch.where(num_accepted > 0, torch.full_like(nxt, 2), nxt)
    within_bounds(first, p[0])


def test_one_hot_rounds_draw_the_rows_their_walk_reaches_and_the_same_tokens_as_every_row_at_once(monkeypatch):
    """A sampled one-hot round draws row i + 1 only once draft i is accepted: depth by depth, the rounds still
    matching draw together. Each draw is the one a draw of all the round's rows at once makes (the same
    distribution and the same uniform), so the emitted tokens are those; and the rows computed are the rows
    reached, one per round and accepted draft."""
    import specstream.spec_decode.verify as verify
    from specstream.sampling import STREAM_SAMPLE, SamplingParams, draw, uniform
    from specstream.sequence import Sequence
    from specstream.spec_decode.proposer import Draft

    computed = []

    def counting(rows, params, us):
        computed.append(rows.shape[0])
        return draw(rows, params, us)

    monkeypatch.setattr(verify, "draw", counting)
    g = torch.Generator().manual_seed(11)
    vocab = 12
    for trial in range(40):
        rounds = []
        for j in range(5):
            params = SamplingParams(temperature=[0.3, 0.7, 1.0][j % 3], top_p=0.9 if j == 4 else 1.0, seed=100 * trial + j)
            seq = Sequence(f"r{j}", [1, 2, 3], params, 0, seed=100 * trial + j)
            seq.token_ids += [4] * j
            k = int(torch.randint(0, 5, (1,), generator=g))
            logits = torch.randn(k + 1, vocab, generator=g) * 3
            # Drafts that are often the likeliest token, so that walks go deep.
            tokens = [int(logits[i].argmax()) if torch.rand(1, generator=g) < 0.7 else int(torch.randint(0, vocab, (1,), generator=g)) for i in range(k)]
            rounds.append(verify.Round(seq, Draft(tokens), logits))
        computed.clear()
        results = verify.verify_round(rounds)
        for r, res in zip(rounds, results):
            us = torch.tensor([uniform(r.seq.seed, r.seq.num_output_tokens + i, STREAM_SAMPLE) for i in range(r.k + 1)], dtype=torch.float64)
            every_row = draw(r.logits, [r.seq.params] * (r.k + 1), us).tolist()
            n = 0
            while n < r.k and every_row[n] == r.draft.tokens[n]:
                n += 1
            assert (res.num_accepted, res.tokens) == (n, r.draft.tokens[:n] + [every_row[n]])
        assert sum(computed) == sum(res.num_accepted + 1 for res in results)


def test_rows_at_equal_steps_of_one_step_are_drawn_from_a_view_and_draw_the_tokens_a_copy_draws():
    """Plain decoding's rows of a sampled step lie one after another in the step's logits: the one-hot walk draws
    them from a view of that memory (no copy of every row a step), and the tokens are those of rows copied out.
    Rows that do not lie at equal steps (rounds with drafts, rows of separate tensors) are copied as before."""
    import specstream.spec_decode.verify as verify
    from specstream.sampling import SamplingParams
    from specstream.sequence import Sequence
    from specstream.spec_decode.proposer import Draft

    g = torch.Generator().manual_seed(5)
    step = torch.randn(7, 300, generator=g) * 3
    rows = list(step.split([1] * 7))
    view = verify._stacked([r[0] for r in rows])
    assert view.data_ptr() == step.data_ptr() and torch.equal(view, step)
    assert verify._stacked([rows[2][0]]).data_ptr() == step[2].data_ptr()
    every_other = verify._stacked([step[0], step[2], step[4]])
    assert every_other.data_ptr() == step.data_ptr() and torch.equal(every_other, step[::2][:3])
    uneven = verify._stacked([step[0], step[1], step[3]])
    assert uneven.data_ptr() != step.data_ptr() and torch.equal(uneven, step[[0, 1, 3]])
    apart = [torch.randn(300, generator=g) for _ in range(3)]
    assert torch.equal(verify._stacked(apart), torch.stack(apart))

    def rounds_of(logits):
        out = []
        for j, row in enumerate(logits):
            params = SamplingParams(temperature=[0.5, 1.0][j % 2], seed=j)
            out.append(verify.Round(Sequence(f"r{j}", [1, 2, 3], params, 0, seed=j), Draft([]), row))
        return out

    shared = verify.verify_round(rounds_of(rows))
    copied = verify.verify_round(rounds_of([r.clone() for r in rows]))
    assert [r.tokens for r in shared] == [r.tokens for r in copied]


def test_greedy_rounds_lying_one_after_another_take_one_argmax_call_and_match_as_each_alone(monkeypatch):
    """A step's greedy rounds (plain rows and drafted chains) split from one logits tensor are one run: a single
    argmax call over a view of the step's memory, no copy. A round whose rows are elsewhere (a penalized or masked
    copy) splits the runs around it. Either way each round accepts what verifying it alone accepts."""
    import specstream.spec_decode.verify as verify
    from specstream.sampling import SamplingParams
    from specstream.sequence import Sequence
    from specstream.spec_decode.proposer import Draft

    g = torch.Generator().manual_seed(11)
    ks = [0, 3, 0, 2, 5, 0, 1]
    step = torch.randn(sum(k + 1 for k in ks), 400, generator=g) * 3
    blocks = list(step.split([k + 1 for k in ks]))
    best = step.argmax(-1).tolist()

    def rounds_of(logits):
        out, at = [], 0
        for j, (k, rows) in enumerate(zip(ks, logits)):
            # drafts the target keeps for j // 2 rows, then one it does not: every length of acceptance comes up
            keep = min(j // 2, k)
            tokens = best[at : at + keep] + [(best[at + keep] + 1) % 400] * (k - keep)
            out.append(verify.Round(Sequence(f"g{j}", [1, 2, 3], SamplingParams(temperature=0), 0), Draft(tokens), rows))
            at += k + 1
        return out

    runs = verify._runs(blocks)
    assert len(runs) == 1 and runs[0].data_ptr() == step.data_ptr() and torch.equal(runs[0], step)
    moved = blocks[:3] + [blocks[3].clone()] + blocks[4:]
    split = verify._runs(moved)
    assert [r.shape[0] for r in split] == [1 + 4 + 1, 3, 6 + 1 + 2] and torch.equal(torch.cat(split), step)
    assert split[0].data_ptr() == step.data_ptr() and split[2].data_ptr() == blocks[4].data_ptr()

    calls = []
    real = verify.argmax_rows
    monkeypatch.setattr(verify, "argmax_rows", lambda x: calls.append(x.shape[0]) or real(x))
    together = verify.verify_round(rounds_of(blocks))
    assert calls == [len(step)]
    calls.clear()
    around = verify.verify_round(rounds_of(moved))
    assert calls == [6, 3, 9]
    alone = [verify.verify_round([r])[0] for r in rounds_of([b.clone() for b in blocks])]
    expected = [(r.num_accepted, r.tokens) for r in alone]
    assert [(r.num_accepted, r.tokens) for r in together] == expected == [(r.num_accepted, r.tokens) for r in around]
    assert [r.num_accepted for r in together] == [min(j // 2, k) for j, k in enumerate(ks)]
