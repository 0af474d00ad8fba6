"""Suffix decoding: the C++ suffix tree against a counting reference, the global cache's bounds and salts,
the proposer through the engine (greedy output equals plain; later requests draft from earlier outputs),
auto's pricing of suffix drafts, the forward-time curve learned online, and rounds by method in the chunks."""

import itertools
import math
import random

import pytest

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.calibration import ONLINE_CLIP, SHAPE_BOUND, CostModel
from specstream.kernels import suffix_tree
from specstream.spec_decode.auto import Calibration
from specstream.spec_decode.policy import StepBase, StepPrice, best_cut

pytestmark = pytest.mark.skipif(
    not suffix_tree.available(), reason=f"the suffix tree could not be built: {suffix_tree.unavailable_reason()}"
)

from specstream.kernels.suffix_tree import SuffixTree  # noqa: E402
from specstream.sequence import Sequence  # noqa: E402
from specstream.spec_decode.suffix import GlobalSuffixCache, SuffixProposer  # noqa: E402


def reference_count(seqs: list[list[int]], pattern: list[int], depth: int) -> int:
    if len(pattern) > depth:
        return 0
    n = len(pattern)
    return sum(1 for s in seqs for i in range(len(s) - n + 1) if s[i : i + n] == pattern)


def reference_draft(seqs, context, length, max_tokens, factor, min_prob, depth):
    """SuffixDecoding's rule at one match length, by brute force: follow the most frequent continuation
    (the smallest token on ties) while the chance stays at min_prob or above; None where the context's
    last `length` tokens never occur."""
    path = context[-length:]
    if reference_count(seqs, path, depth) == 0:
        return None
    cap = min(max_tokens, int(length * factor + 1e-6))
    tokens, chances, prob = [], [], 1.0
    vocab = sorted(set(x for s in seqs for x in s))
    while len(tokens) < cap:
        here = path + tokens
        total = reference_count(seqs, here, depth)
        nexts = {t: c for t in vocab if (c := reference_count(seqs, here + [t], depth))}
        if not nexts or total == 0:
            break
        tok = min(nexts, key=lambda t: (-nexts[t], t))
        prob *= nexts[tok] / total
        if prob < min_prob:
            break
        tokens.append(tok)
        chances.append(prob)
    return tokens, chances


def test_counts_match_a_reference_through_adds_and_removes():
    rng = random.Random(0)
    depth = 5
    seqs = {i: [rng.randrange(6) for _ in range(rng.randrange(1, 40))] for i in range(6)}
    tree = SuffixTree(depth)
    for i, s in seqs.items():
        # In pieces, as a running request grows.
        tree.extend(i, s[:7])
        tree.extend(i, s[7:])
    for removed in (None, 2, 4):
        if removed is not None:
            assert tree.remove(removed) and not tree.remove(removed)
            del seqs[removed]
        held = list(seqs.values())
        for _ in range(200):
            pattern = [rng.randrange(6) for _ in range(rng.randrange(1, depth + 2))]
            assert tree.count(pattern) == reference_count(held, pattern, depth)
    for i in list(seqs):
        tree.remove(i)
    assert tree.num_nodes == 1  # the root alone: every node was freed


def test_speculation_matches_the_reference_rule():
    rng = random.Random(1)
    depth = 6
    seqs = [[rng.randrange(5) for _ in range(60)] for _ in range(3)]
    tree = SuffixTree(depth)
    for i, s in enumerate(seqs):
        tree.extend(i, s)
    for _ in range(60):
        context = [rng.randrange(5) for _ in range(rng.randrange(1, 10))]
        for factor, min_prob in ((1.0, 0.1), (3.0, 0.0), (0.5, 0.3)):
            tokens, chances, match = tree.speculate(context, 8, factor, min_prob)
            drafts = [reference_draft(seqs, context, n, 8, factor, min_prob, depth) for n in range(1, min(len(context), depth) + 1)]
            best = max((sum(d[1]) for d in drafts if d is not None and d[0]), default=0.0)
            if not tokens:
                assert best == 0.0
                continue
            # The draft is the reference's at its match length, and no length scores more (float ties aside).
            assert (tokens, pytest.approx(chances, rel=1e-5)) == reference_draft(seqs, context, match, 8, factor, min_prob, depth)
            assert sum(chances) == pytest.approx(best, rel=1e-5)


def test_a_held_sequence_drafts_as_its_own_last_tokens_would():
    """speculate_held takes a held sequence's suffixes from its own nodes: the same drafts, paths and trees, as
    walking its last tokens from the root, at every length it has grown to and past the tree's depth."""
    rng = random.Random(3)
    depth = 6
    tree = SuffixTree(depth)
    tree.extend(7, [rng.randrange(4) for _ in range(300)])  # another sequence's text matches too (past the kept buffer)
    own: list[int] = []
    for _ in range(50):
        piece = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
        tree.extend(0, piece)
        own += piece
        for factor, min_prob in ((1.0, 0.1), (3.0, 0.0), (0.5, 0.3)):
            assert tree.speculate_held(0, 8, factor, min_prob, tree=True) == tree.speculate_tree(own, 8, factor, min_prob)
            tokens, parents, chances, match = tree.speculate_held(0, 8, factor, min_prob)
            assert (tokens, chances, match) == tree.speculate(own, 8, factor, min_prob)
            assert parents == list(range(-1, len(tokens) - 1))
    assert tree.speculate_held(99, 8, 1.0, 0.0) == ([], [], [], 0)  # a sequence not held drafts nothing


def test_a_repeated_text_drafts_its_continuation_with_its_chance():
    tree = SuffixTree(8)
    tree.extend(0, [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3])
    tokens, chances, match = tree.speculate([9, 1, 2, 3], 4, 2.0, 0.0)
    # [1, 2, 3] occurred three times: followed by 4 twice, and once by nothing yet (the context itself).
    assert tokens[:1] == [4] and chances[0] == pytest.approx(2 / 3) and match == 3
    # An unseen context drafts nothing.
    assert tree.speculate([42], 4, 2.0, 0.0) == ([], [], 0)


def test_the_global_cache_keeps_the_newest_requests_and_keeps_salts_apart():
    cache = GlobalSuffixCache(max_depth=8, max_requests=2, max_tokens=100)
    cache.add(None, [1, 2, 3, 4, 5])
    cache.add("tenant-b", [1, 2, 3, 7, 7])
    assert cache.speculate(None, [1, 2, 3], 2, 1.0, 0.0)[0] == [4, 5]
    assert cache.speculate("tenant-b", [1, 2, 3], 2, 1.0, 0.0)[0] == [7, 7]
    assert cache.speculate("tenant-c", [1, 2, 3], 2, 1.0, 0.0)[0] == []
    cache.add(None, [8, 9, 10])  # the third request drops the oldest (salt None's first)
    assert len(cache) == 2
    assert cache.speculate(None, [1, 2, 3], 2, 1.0, 0.0)[0] == []
    assert cache.speculate(None, [8, 9], 1, 1.0, 0.0)[0] == [10]
    nodes = cache.num_nodes
    cache.add("tenant-b", [11, 12])
    cache.add("tenant-b", [13, 14])  # both earlier ones dropped; salt None's tree is freed whole
    assert len(cache) == 2 and cache.num_nodes < nodes + 10
    assert GlobalSuffixCache(8, 0, 100).add(None, [1, 2]) is None  # 0 keeps nothing


def test_a_draft_names_the_sequence_that_last_wrote_its_first_token():
    tree = SuffixTree(8)
    tree.extend(3, [1, 2, 3, 4, 5])
    tree.extend(7, [9, 2, 3, 6])
    assert tree.speculate([1, 2, 3], 4, 1.0, 0.1)[0] == [4, 5] and tree.source() == 3
    assert tree.speculate_tree([9, 2, 3], 4, 1.0, 0.1)[0] == [6] and tree.source() == 7
    tree.extend(11, [1, 2, 3, 4])  # a later writer of the same text takes its nodes
    assert tree.speculate([1, 2, 3], 4, 1.0, 0.1)[0][:1] == [4] and tree.source() == 11
    assert tree.speculate([42], 4, 1.0, 0.1) == ([], [], 0) and tree.source() == -1
    tree.extend(2**40 + 5, [20, 21, 22])  # ids are named by their low 31 bits
    assert tree.speculate([20, 21], 4, 1.0, 0.1)[0] == [22] and tree.source() == (2**40 + 5) & 0x7FFFFFFF


def test_the_global_cache_keeps_what_drafts_come_from_through_a_burst_and_lets_it_fade_after():
    """A request whose text a taken draft continues gains credit: a burst of other requests drops the ones no
    draft came from, oldest first (before, the oldest went, however often drafts came from it); once no draft
    comes from it, its credit fades and it goes too."""
    from specstream.spec_decode.suffix import CREDIT_FADE

    cache = GlobalSuffixCache(max_depth=8, max_requests=2, max_tokens=100)
    cache.add(None, [1, 2, 3, 4, 5])
    cache.add(None, [6, 7, 8, 9])
    for _ in range(3):
        assert cache.speculate(None, [1, 2, 3], 2, 1.0, 0.0)[0] == [4, 5]
        cache.used()
    cache.add(None, [10, 11, 12])  # drops [6, 7, 8, 9]: no draft came from it
    assert cache.speculate(None, [1, 2, 3], 2, 1.0, 0.0)[0] == [4, 5]
    assert cache.speculate(None, [6, 7, 8], 1, 1.0, 0.0)[0] == []
    cache.used()  # the latest speculate drafted nothing: nothing gains
    burst = 0
    while cache.speculate(None, [1, 2, 3], 2, 1.0, 0.0)[0]:  # a burst no draft comes from
        cache.add(None, [100 + burst, 200 + burst])
        burst += 1
        assert len(cache) == 2 and cache.speculate(None, [100 + burst - 1], 1, 1.0, 0.0)[0] == [200 + burst - 1]
    # Its credit (1 faded once as [6, 7, 8, 9] joined, then 3 drafts) goes below the last newcomer's (faded once
    # by the next) after n more joins: (fade + 3) * fade^(n + 1) < fade.
    assert burst == math.ceil(math.log(CREDIT_FADE + 3) / -math.log(CREDIT_FADE))

    # The proposer marks the cache's draft used where it takes it over the request's own tree's.
    proposer = SuffixProposer(max_depth=8, max_cached_requests=2)
    proposer.cache.add(None, [1, 2, 3, 4, 5])
    proposer.cache.add(None, [6, 7, 8, 9])
    seq = Sequence("s", [30, 1, 2, 3], SamplingParams(temperature=0), 0)
    assert proposer.draft(seq, 2).tokens == [4, 5]
    proposer.cache.add(None, [10, 11, 12])
    assert proposer.draft(seq, 2).tokens == [4, 5]


def test_the_global_cache_never_gives_a_held_requests_id_to_another():
    from specstream.spec_decode.suffix import ID_MASK

    cache = GlobalSuffixCache(max_depth=8, max_requests=3, max_tokens=100)
    cache.add(None, [1, 2, 3])  # id 0
    cache._ids = itertools.count(ID_MASK)
    cache.add(None, [4, 5, 6])  # id ID_MASK
    cache.add(None, [7, 8, 9])  # 2^31 is id 0 in the tree's 31 bits, still held: the next one
    assert sorted(cache._salt) == [0, 1, ID_MASK]
    assert [cache.speculate(None, [a, a + 1], 1, 1.0, 0.0)[0] for a in (1, 4, 7)] == [[3], [6], [9]]


def engine(model, method, **kw):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=6, adaptive=kw.pop("adaptive", False), **kw.pop("spec", {}))
    return Engine(EngineConfig(model=str(model), dtype="float32", speculative=spec, **kw), log=False)


PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef add(",
    [{"role": "user", "content": "Hello! How can I help you today?"}],
]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return engine(tiny_model_dir, "off")


@pytest.mark.parametrize("method", ["suffix", "auto"])
def test_suffix_greedy_equals_plain_and_later_requests_draft_from_earlier_outputs(tiny_model_dir, plain, method, monkeypatch):
    # auto prices drafts from the forward-time curve: timed here, a busy machine could make drafts look
    # dear enough that none is made (a fresh clone's CI run once drafted nothing). A fixed curve, nearly flat
    # as the tiny model's forward is (its steps cost their fixed overhead), keeps this test about drafting.
    from specstream import calibration

    monkeypatch.setattr(
        calibration, "forward_cost", lambda *args, **kwargs: CostModel([1, 8, 16, 32], [0.010, 0.011, 0.012, 0.014])
    )
    spec = engine(tiny_model_dir, method, adaptive=method == "auto")
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    first = spec.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in first] == expected
    # The same requests again: the global cache holds their outputs, so the whole answers are drafted.
    again = spec.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in again] == expected
    drafted = sum(o.stats.drafted for o in again)
    accepted = sum(o.stats.accepted for o in again)
    assert accepted > 0.8 * sum(len(o.token_ids) for o in again) - 3 * len(PROMPTS)
    assert accepted >= sum(o.stats.accepted for o in first) and drafted > 0
    assert spec.pool.num_free_blocks == spec.pool.num_blocks


def test_suffix_sampling_is_the_seeded_plain_sampling(tiny_model_dir, plain):
    """Suffix drafts are one-hot proposals: a seeded sampled request draws the same tokens with them."""
    spec = engine(tiny_model_dir, "suffix")
    params = [SamplingParams(max_tokens=32, temperature=0.8, seed=s, ignore_eos=True) for s in range(3)]
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    spec.generate(PROMPTS, params)  # warm the cache with the same answers
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == expected


def test_rounds_name_the_method_that_drafted_them(tiny_model_dir):
    spec = engine(tiny_model_dir, "suffix")
    spec.generate(PROMPTS[0], GREEDY)
    spec.add_request(PROMPTS[0], GREEDY, request_id="again")
    chunks = []
    while spec.has_unfinished():
        chunks += spec.step()
    drafted = [c for c in chunks if c.num_drafted]
    assert drafted and all(c.method == "suffix" for c in drafted)
    assert all(c.method == "" for c in chunks if not c.num_drafted)
    from prometheus_client import generate_latest

    text = generate_latest(spec.metrics.registry).decode()
    assert 'specstream_spec_decode_rounds_total{method="suffix"}' in text
    assert 'specstream_spec_decode_rounds_total{method="none"}' in text
    assert 'specstream_spec_decode_num_draft_tokens_per_pos_total{method="suffix",position="0"}' in text


def test_suffix_is_refused_clearly_where_its_tree_cannot_be_built(monkeypatch):
    from specstream.spec_decode import suffix as suffix_module

    monkeypatch.setattr(suffix_module, "available", lambda: False)
    with pytest.raises(suffix_module.SuffixUnavailable, match="C\\+\\+ suffix tree"):
        SuffixProposer()


def test_auto_cuts_a_suffix_draft_where_its_rows_stop_paying():
    # Verification grows steeply with rows: only the first, likely drafts pay.
    steep = CostModel([1, 2, 3, 4, 8], [1.0, 1.1, 1.2, 2.4, 4.8])
    alone = StepBase.alone(1)
    rate, m = best_cut([0.95, 0.9, 0.4, 0.2, 0.1], 1.0, StepPrice(steep, alone))
    assert m == 2 and rate == pytest.approx((1 + 0.95 + 0.9) / steep(3))
    # Free verification: every draft pays.
    flat = CostModel([1, 8], [1.0, 1.0])
    assert best_cut([0.95, 0.9, 0.4, 0.2, 0.1], 1.0, StepPrice(flat, alone))[1] == 5
    # Chances that overstated acceptance are scaled down by the sequence's own record.
    cal = Calibration()
    assert cal.factor() == 1.0  # no record yet: the chances as they are
    for _ in range(20):
        cal.record(expected=4.0, accepted=1)
    assert cal.factor() == pytest.approx(0.25, abs=0.05)
    for _ in range(20):
        cal.record(expected=4.0, accepted=0)
    assert cal.factor() < 0.1
    assert best_cut([0.95, 0.9, 0.4], cal.factor(), StepPrice(steep, alone))[0] < 1 / steep(1)  # plain decoding wins


def test_the_forward_time_curve_follows_the_steps_the_engine_runs():
    cost = CostModel([1, 8, 16], [0.010, 0.020, 0.030])
    assert cost(8) == pytest.approx(0.020)
    # The machine is now twice as slow (a noisy neighbour); the curve learns it from steps.
    for _ in range(60):
        cost.observe(8, 0.040)
        cost.observe(1, 0.020)
    assert cost(8) == pytest.approx(0.040, rel=0.05) and cost(1) == pytest.approx(0.020, rel=0.05)
    assert cost.timed(8) == pytest.approx(0.020)  # what was timed is kept apart
    # A curve timed while the machine was busy (100x too dear) comes back down within a few dozen steps.
    busy = CostModel([1, 8], [1.0, 2.0])
    for _ in range(60):
        busy.observe(1, 0.01)
    assert busy(1) < 0.05
    # One step that compiled a new shape moves it by a bounded amount.
    calm = CostModel([1, 8], [0.01, 0.02])
    calm.observe(1, 30.0)
    assert calm(1) <= 0.01 * math.exp(0.14 * ONLINE_CLIP) + 1e-12
    # Steps of one size that keep stalling change the curve's shape by at most SHAPE_BOUND: the policy never
    # prices verification so dear that drafting stops for good (and no larger step is seen to correct it).
    stalls = CostModel([1, 8], [0.01, 0.02])
    for _ in range(200):
        stalls.observe(8, 0.2)
        stalls.observe(1, 0.01)
    assert stalls(8) / stalls(1) <= 2.0 * math.exp(2 * SHAPE_BOUND) + 1e-9
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        calm.observe(1, bad)
    assert calm.observed == 1


def test_the_engine_feeds_its_steps_to_the_curve(tiny_model_dir):
    spec = engine(tiny_model_dir, "suffix", adaptive=True)
    cost = spec.policy.target_cost
    assert cost is not None
    before = cost.observed
    spec.generate(PROMPTS[0], GREEDY)
    assert cost.observed > before
    from prometheus_client import generate_latest

    text = generate_latest(spec.metrics.registry).decode()
    assert f'specstream_forward_cost_seconds{{tokens="{cost.tokens[0]}"}}' in text
