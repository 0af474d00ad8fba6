"""Draft trees: one forward verifies every branch (each row sees the prefix and its own ancestors), the walk
accepts the longest path the target agrees with (greedy, and sampled: exactly plain decoding's draws), the
accepted path's KV is moved into place, and the engine's output equals plain decoding's."""

import pytest
import torch

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.memory.kv import KVPool
from specstream.model.attention import ATTN_IMPLEMENTATION, model_geometry
from specstream.model.loader import load_model, resolve_model
from specstream.model.runner import ForwardItem, ModelRunner
from specstream.sampling import STREAM_SAMPLE, sample_from, uniform
from specstream.sequence import Sequence
from specstream.spec_decode.proposer import Draft, Proposer
from specstream.spec_decode.verify import Round, _penalize, draft_depths, verify_round

# A tree over the root r (the sequence's last token): r -> 11 -> 12 -> 13, r -> 11 -> 14, r -> 15 -> 16.
TOKENS = [11, 15, 12, 14, 16, 13]
PARENTS = [-1, -1, 0, 0, 1, 2]
PATHS = {0: [0], 1: [1], 2: [0, 2], 3: [0, 3], 4: [1, 4], 5: [0, 2, 5]}  # each draft's path from the root


def runner_for(model_dir, tile=0, fast=True):
    source = resolve_model(str(model_dir))
    model = load_model(source, attn_implementation=ATTN_IMPLEMENTATION)
    pool = KVPool(*model_geometry(model.config), 512, 8, torch.float32, "cpu")
    return ModelRunner(model, pool, fast=fast, tile=tile), pool


def test_draft_validation_and_helpers():
    with pytest.raises(ValueError, match="parents"):
        Draft([1, 2], parents=[-1, 1])
    assert Draft([1, 2, 3], parents=[-1, 0, 1]).parents is None  # a chain is not a tree
    tree = Draft(TOKENS, parents=PARENTS, chances=[0.9, 0.5, 0.6, 0.3, 0.4, 0.2])
    assert tree.is_tree
    assert tree.main_chain().tokens == [11, 12, 13] and tree.main_chain().chances == [0.9, 0.6, 0.2]
    cut = tree.cut(3)
    assert cut.tokens == TOKENS[:3] and cut.parents == PARENTS[:3]
    assert draft_depths(PARENTS) == [1, 1, 2, 2, 2, 3]


@pytest.mark.parametrize(
    "tile,fast", [(0, True), (16, True), (0, False)], ids=["packed", "invariant-tiles", "transformers-modules"]
)
def test_each_tree_row_equals_the_plain_forward_of_its_path(tiny_model_dir, tile, fast):
    runner, pool = runner_for(tiny_model_dir, tile, fast)
    prompt = [5, 17, 42, 9, 100, 7, 33]
    other = [8, 9, 10, 11, 12]
    table, neighbour = [], []
    pool.reserve(table, len(prompt) + 1 + len(TOKENS))
    pool.reserve(neighbour, len(other) + 3)
    runner.forward([ForwardItem(table, 0, prompt, 0), ForwardItem(neighbour, 0, other, 0)])
    root = 21
    rows = runner.forward(
        [
            ForwardItem(table, len(prompt), [root] + TOKENS, 1 + len(TOKENS), [-1] + [p + 1 for p in PARENTS]),
            ForwardItem(neighbour, len(other), [1, 2, 3], 3),  # a chain beside it, in the same step
        ]
    )
    for j, path in PATHS.items():
        fresh = []
        ids = prompt + [root] + [TOKENS[i] for i in path]
        pool.reserve(fresh, len(ids))
        want = runner.forward([ForwardItem(fresh, 0, ids, 1)])[0]
        torch.testing.assert_close(rows[j + 1], want, atol=1e-4, rtol=1e-4)
        pool.free(fresh)
    root_alone = runner.forward([ForwardItem(_fresh(pool, prompt + [root]), 0, prompt + [root], 1)])[0]
    torch.testing.assert_close(rows[0], root_alone, atol=1e-4, rtol=1e-4)


def _fresh(pool, ids):
    table = []
    pool.reserve(table, len(ids))
    return table


def test_moved_kv_of_an_accepted_branch_equals_the_kv_of_its_plain_prefill(tiny_model_dir):
    runner, pool = runner_for(tiny_model_dir)
    prompt, root = [5, 17, 42, 9], 21
    table = _fresh(pool, prompt + [root] + TOKENS)
    runner.forward([ForwardItem(table, 0, prompt, 0)])
    runner.forward([ForwardItem(table, len(prompt), [root] + TOKENS, 1, [-1] + [p + 1 for p in PARENTS])])
    path = PATHS[4]  # r -> 15 -> 16: drafts 1 and 4, at positions start + 2 and start + 5
    start = len(prompt) + 1
    pool.move(table, [start + j for j in path], list(range(start, start + len(path))))
    length = start + len(path)
    after = runner.forward([ForwardItem(table, length, [77], 1)])
    ids = prompt + [root] + [TOKENS[j] for j in path] + [77]
    rebuilt = runner.forward([ForwardItem(_fresh(pool, ids), 0, ids, 1)])
    torch.testing.assert_close(after, rebuilt, atol=1e-4, rtol=1e-4)


def _seq(params: SamplingParams, outputs: int = 3) -> Sequence:
    seq = Sequence("r", [1, 2, 3, 4], params, 0, seed=7)
    seq.token_ids += [5] * outputs
    return seq


def _logits_picking(choices: dict[int, int], rows: int, vocab: int = 32) -> torch.Tensor:
    logits = torch.zeros(rows, vocab)
    for row, tok in choices.items():
        logits[row, tok] = 10.0
    return logits


def test_greedy_walk_takes_the_branch_the_target_agrees_with():
    seq = _seq(SamplingParams(temperature=0))
    # The target: after r, 15 (the second branch); after 15, 16; after 16, 30 (no draft): accept [15, 16] + 30.
    logits = _logits_picking({0: 15, 2: 16, 5: 30}, 1 + len(TOKENS))
    (result,) = verify_round([Round(seq, Draft(TOKENS, parents=PARENTS), logits)])
    assert result.path == [1, 4] and result.tokens == [15, 16, 30] and result.num_accepted == 2
    assert result.rows() == [0, 2, 5]
    # No branch agrees: the target's token alone.
    (result,) = verify_round([Round(seq, Draft(TOKENS, parents=PARENTS), _logits_picking({0: 3}, 1 + len(TOKENS)))])
    assert result.path == [] and result.tokens == [3]


def test_sampled_walk_emits_exactly_the_plain_draws():
    """At each output position the walk draws from p with that position's uniform: the draws plain decoding
    (and a chain) makes, so a seeded request's tokens do not depend on the tree offered."""
    g = torch.Generator().manual_seed(3)
    vocab = 24
    for trial in range(40):
        params = SamplingParams(temperature=1.0, seed=trial)
        seq = _seq(params)
        logits = torch.randn(1 + len(TOKENS), vocab, generator=g) * 3
        # Make the drafts likely, so that walks go deep.
        for j, tok in enumerate(TOKENS):
            parent_row = PARENTS[j] + 1
            logits[parent_row, tok % vocab] += 4.0
        tokens = [t % vocab for t in TOKENS]
        (result,) = verify_round([Round(seq, Draft(tokens, parents=PARENTS), logits)])
        pos = seq.num_output_tokens
        rows = result.rows()
        for depth, (row, tok) in enumerate(zip(rows, result.tokens)):
            p = torch.softmax(logits[row].double(), -1)[None]
            u = torch.tensor([uniform(seq.seed, pos + depth, STREAM_SAMPLE)], dtype=torch.float64)
            assert sample_from(p, u).item() == tok


def test_sampled_walk_emits_the_target_distribution():
    # The statistical check, as for chains: the first emitted token follows p at row 0, whatever the tree.
    g = torch.Generator().manual_seed(11)
    vocab, n = 6, 3000
    logits = torch.randn(1 + len(TOKENS), vocab, generator=g)
    tokens = [1, 2, 3, 4, 5, 0]
    firsts = []
    for s in range(n):
        (result,) = verify_round([Round(_seq(SamplingParams(temperature=1.0, seed=s)), Draft(tokens, parents=PARENTS), logits)])
        firsts.append(result.tokens[0])
    freq = torch.bincount(torch.tensor(firsts), minlength=vocab).double() / n
    p = torch.softmax(logits[0].double(), -1)
    assert ((freq - p).abs() <= 5 * torch.sqrt(p * (1 - p) / n) + 1 / n).all()


@pytest.mark.parametrize("spread", [0.3, 3.0], ids=["q-near-p", "q-far-from-p"])
def test_sampled_tree_with_q_emits_the_target_distribution_and_accepts_more_than_one_hot(spread):
    """Recursive rejection sampling over children drawn from q without replacement: the first emitted token
    follows p at row 0, the second (where one is emitted after an accepted draft) follows p at that draft's
    row, whatever q; and with q near p it accepts more than the one-hot walk of the same trees."""
    g = torch.Generator().manual_seed(5)
    vocab, n, width = 6, 4000, 3
    target = torch.randn(vocab + 1, vocab, generator=g)  # row t < vocab: the target after token t; last: the root's
    q_all = torch.softmax(target + spread * torch.randn(vocab + 1, vocab, generator=g), -1)
    rounds, one_hot = [], []
    for s in range(n):
        tokens, parents, probs = [], [], []
        for a in torch.multinomial(q_all[vocab], width, replacement=False, generator=g).tolist():
            tokens.append(a), parents.append(-1), probs.append(q_all[vocab])
        for i, a in enumerate(list(tokens)):
            for b in torch.multinomial(q_all[a], 2, replacement=False, generator=g).tolist():
                tokens.append(b), parents.append(i), probs.append(q_all[a])
        logits = torch.stack([target[vocab]] + [target[t] for t in tokens])
        seq = _seq(SamplingParams(temperature=1.0, seed=s))
        rounds.append(Round(seq, Draft(tokens, torch.stack(probs), parents=parents), logits))
        one_hot.append(Round(seq, Draft(tokens, parents=parents), logits))
    results = verify_round(rounds)
    p = torch.softmax(target.double(), -1)

    def close(tokens: list[int], dist: torch.Tensor) -> bool:
        freq = torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)
        return bool(((freq - dist).abs() <= 5 * torch.sqrt(dist * (1 - dist) / len(tokens)) + 1 / len(tokens)).all())

    assert close([r.tokens[0] for r in results], p[vocab])
    after = [r.tokens[:2] for r in results if r.num_accepted >= 1]
    top = max(range(vocab), key=lambda t: sum(1 for a in after if a[0] == t))
    seconds = [a[1] for a in after if a[0] == top]
    assert len(seconds) > 300 and close(seconds, p[top])
    if spread < 1:
        accepted = sum(r.num_accepted for r in results)
        assert accepted > 1.2 * sum(r.num_accepted for r in verify_round(one_hot)), accepted


@pytest.mark.parametrize(
    "penalties",
    [{"presence_penalty": 1.5, "frequency_penalty": 0.5}, {"repetition_penalty": 1.7}],
    ids=["presence-frequency", "repetition"],
)
def test_penalties_count_each_rows_own_ancestors(penalties):
    params = SamplingParams(temperature=0, **penalties)
    seq = _seq(params)
    logits = torch.ones(1 + len(TOKENS), 32)
    tree = _penalize(Round(seq, Draft(TOKENS, parents=PARENTS), logits))
    for j, path in PATHS.items():
        chain = _penalize(Round(seq, Draft([TOKENS[i] for i in path]), torch.ones(1 + len(path), 32)))
        torch.testing.assert_close(tree[j + 1], chain[-1])
    torch.testing.assert_close(tree[0], _penalize(Round(seq, Draft([]), torch.ones(1, 32)))[0])
    assert not torch.equal(tree[-1], tree[0])  # the drafts before a row count


def test_min_tokens_holds_the_ends_on_each_row_by_its_own_depth():
    """With 3 tokens out and min_tokens 5, the rows deciding output positions 3 and 4 (row 0, and the rows after
    the depth-1 drafts) may not draw EOS or a stop token; the rows after deeper drafts may."""
    from specstream.spec_decode.verify import _hold_ends

    seq = _seq(SamplingParams(temperature=0, min_tokens=5, max_tokens=20, stop_token_ids=[7]))
    seq.held_ends = [2, 7]
    held = _hold_ends(Round(seq, Draft(TOKENS, parents=PARENTS), torch.zeros(1 + len(TOKENS), 32)))
    depths = [0] + [len(PATHS[j]) for j in range(len(TOKENS))]
    for row, depth in enumerate(depths):
        ends = held[row, [2, 7]]
        assert bool(torch.isinf(ends).all()) == (depth < 2), (row, depth)
        assert torch.isfinite(held[row, :2]).all() and torch.isfinite(held[row, 8:]).all()
    chain = _hold_ends(Round(seq, Draft([11, 12, 13]), torch.zeros(4, 32)))
    assert [bool(torch.isinf(chain[row, 7])) for row in range(4)] == [True, True, False, False]


class TreeProposer(Proposer):
    """Offers, each round, a tree whose second branch is the plain greedy continuation (known from a
    reference run) and whose first branch is wrong: every accepted path is a non-first branch, so the
    accepted KV is always moved."""

    def __init__(self, reference: dict[int, list[int]]) -> None:
        self.reference = reference  # prompt length -> the plain run's whole token list

    def propose(self, seqs, ks):
        out = []
        for seq, k in zip(seqs, ks):
            full = self.reference[seq.num_prompt_tokens]
            n = len(seq.token_ids)
            right = full[n : n + 3]
            if k < 2 or not right:
                out.append(Draft([]))
                continue
            wrong = (right[0] + 1) % 300
            tokens = [wrong, right[0], (wrong + 1) % 300] + right[1:]
            parents = [-1, -1, 0] + [1, 3][: len(right) - 1]
            m = min(k, len(tokens))
            out.append(Draft(tokens, parents=parents, method="test").cut(m))
        return out


def test_engine_output_equals_plain_when_the_accepted_paths_are_side_branches(tiny_model_dir, monkeypatch):
    config = dict(model=str(tiny_model_dir), dtype="float32")
    plain = Engine(EngineConfig(**config, speculative=SpeculativeConfig(method="off")), log=False)
    prompts = [[5, 17, 42, 9, 100, 7, 33], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [o.prompt_token_ids + o.token_ids for o in plain.generate(prompts, params)]
    spec = Engine(EngineConfig(**config, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=6, adaptive=False)), log=False)
    spec.proposer = TreeProposer({len(p): e for p, e in zip(prompts, expected)})
    spec.proposer.lookup = None
    out = spec.generate(prompts, params)
    assert [o.prompt_token_ids + o.token_ids for o in out] == expected
    assert all(o.stats.accepted > o.stats.rounds for o in out)  # side branches were accepted, more than one a round
    assert spec.pool.num_free_blocks == spec.pool.num_blocks


def test_suffix_trees_through_the_engine_equal_plain_greedy_and_seeded(tiny_model_dir):
    config = dict(model=str(tiny_model_dir), dtype="float32")
    plain = Engine(EngineConfig(**config, speculative=SpeculativeConfig(method="off")), log=False)
    spec_cfg = SpeculativeConfig(method="suffix", num_speculative_tokens=8, adaptive=False, suffix_min_token_prob=0.0,
                                 suffix_max_spec_factor=4.0)
    spec = Engine(EngineConfig(**config, speculative=spec_cfg), log=False)
    assert spec.proposer.trees
    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "def add(a, b):\n    return a + b\n\ndef add("]
    for params in (SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
                   [SamplingParams(max_tokens=32, temperature=0.9, seed=s, ignore_eos=True) for s in range(2)]):
        expected = [o.token_ids for o in plain.generate(prompts, params)]
        for _ in range(2):  # the second time, the global cache holds the first answers: deep trees
            assert [o.token_ids for o in spec.generate(prompts, params)] == expected


def test_ngram_trees_through_the_engine_equal_plain_greedy_and_seeded(tiny_model_dir):
    config = dict(model=str(tiny_model_dir), dtype="float32")
    plain = Engine(EngineConfig(**config, speculative=SpeculativeConfig(method="off")), log=False)
    spec = Engine(EngineConfig(**config, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=6, adaptive=False)),
                  log=False)
    assert spec.proposer.trees
    trees = []
    propose = spec.proposer.propose

    def counting(seqs, ks):
        drafts = propose(seqs, ks)
        trees.extend(d for d in drafts if d.is_tree)
        return drafts

    spec.proposer.propose = counting
    # Repeated pairs with different continuations: several occurrences disagree, so drafts branch.
    prompts = [[5, 17, 42, 9, 5, 17, 8, 11, 5, 17, 42, 3, 5, 17], [7, 8, 9, 1, 7, 8, 2, 7, 8, 9, 4, 7, 8]]
    for params in (SamplingParams(max_tokens=32, temperature=0, ignore_eos=True),
                   [SamplingParams(max_tokens=32, temperature=0.9, seed=s, ignore_eos=True) for s in range(2)]):
        expected = [o.token_ids for o in plain.generate(prompts, params)]
        assert [o.token_ids for o in spec.generate(prompts, params)] == expected
    assert trees
    assert spec.pool.num_free_blocks == spec.pool.num_blocks


def test_walk_to_a_leaf_is_no_rejection_for_the_k_policy(tiny_model_dir):
    """A tree whose accepted path ends at a leaf left only side branches behind: the k policy's acceptance
    (geometric along one path) sees every draft on the path accepted and no rejection."""
    config = dict(model=str(tiny_model_dir), dtype="float32")
    plain = Engine(EngineConfig(**config, speculative=SpeculativeConfig(method="off")), log=False)
    prompt = [5, 17, 42, 9, 100, 7, 33]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    full = prompt + plain.generate([prompt], params)[0].token_ids
    seen = []

    class Siblings(Proposer):
        def propose(self, seqs, ks):
            seen.extend((s.acceptance.accepted, s.acceptance.rejected) for s in seqs)
            out = []
            for seq in seqs:
                right = full[len(seq.token_ids)]
                out.append(Draft([(right + 1) % 300, right], parents=[-1, -1], method="test"))
            return out

    spec = Engine(EngineConfig(**config, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2, adaptive=False)),
                  log=False)
    spec.proposer = Siblings()
    spec.proposer.lookup = None
    out = spec.generate([prompt], params)[0]
    assert prompt + out.token_ids == full
    assert out.stats.drafted == 2 * out.stats.accepted > 0  # one of each two siblings accepted, every round
    assert seen[-1][0] > 0 and all(rejected == 0 for _, rejected in seen)
    (tree,) = verify_round([Round(_seq(SamplingParams(temperature=0)), Draft([1, 2], parents=[-1, -1]), _logits_picking({0: 1}, 3))])
    assert tree.path == [0] and tree.at_leaf
    (chain,) = verify_round([Round(_seq(SamplingParams(temperature=0)), Draft([1, 2, 3], parents=[-1, 0, 0]),
                                   _logits_picking({0: 1, 1: 7}, 4))])
    assert chain.path == [0] and not chain.at_leaf  # row 1 has children (2, 3) and wanted 1
