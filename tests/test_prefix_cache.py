"""Prefix caching: cached KV changes no output (fp32 greedy), holds committed tokens only,
reference counts balance, eviction frees room under pressure, salts separate tenants."""

import random

import pytest
import torch

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.memory.kv import KVPool
from specstream.memory.blocks import NO_BLOCK, BlockAllocator
from specstream.memory.prefix_cache import PrefixCache, extend_digests
from specstream.model.runner import ForwardItem, ModelRunner
from specstream.sequence import Sequence

BLOCK = 16
# Token-id prompts (the tiny vocabulary has 384 ids): a long shared prefix, different tails.
SHARED = [(7 * i + 3) % 300 + 5 for i in range(70)]
PROMPTS = [SHARED + [11, 12, 13], SHARED + [40, 41], SHARED[:37] + [99, 98, 97, 96], [5, 6, 7, 8, 9] * 9]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def engine(model, caching=True, method="off", k=4, draft=None, **kw):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, adaptive=False, draft_model=draft and str(draft))
    config = EngineConfig(model=str(model), dtype="float32", speculative=spec, enable_prefix_caching=caching, **kw)
    return Engine(config, log=False)


@pytest.fixture(scope="module")
def uncached(tiny_model_dir):
    return engine(tiny_model_dir, caching=False)


@pytest.fixture(scope="module")
def expected(uncached):
    return [o.token_ids for o in uncached.generate(PROMPTS, GREEDY)]


def all_blocks_free(pool: KVPool) -> bool:
    return pool.num_free_blocks == pool.num_blocks and not any(pool.blocks.refs)


# ------------------------------------------------------------------ block allocator
def test_digests_chain_over_blocks_and_mix_in_the_salt():
    tokens = list(range(48))
    a, b, salted, changed = [], [], [], []
    extend_digests(a, tokens, BLOCK, None, 3)
    extend_digests(b, tokens[:32], BLOCK, None, 2)
    extend_digests(salted, tokens, BLOCK, "tenant", 3)
    extend_digests(changed, [1] + tokens[1:], BLOCK, None, 3)
    assert b == a[:2] and len(set(a)) == 3
    assert not set(salted) & set(a)
    assert not set(changed) & set(a)  # a change in block 0 changes every later digest


def test_freed_cached_block_stays_findable_until_plain_blocks_run_out():
    blocks = BlockAllocator(3)
    cached = blocks.allocate()
    blocks.publish(cached, b"d")
    blocks.release(cached)
    assert blocks.num_free == 3 and blocks.lookup(b"d") == cached
    first, second = blocks.allocate(), blocks.allocate()
    assert cached not in (first, second) and blocks.lookup(b"d") == cached
    assert blocks.allocate() == cached and blocks.lookup(b"d") is None


def test_eviction_takes_the_least_recently_freed_cached_block():
    blocks = BlockAllocator(2)
    old, new = blocks.allocate(), blocks.allocate()
    blocks.publish(old, b"old")
    blocks.publish(new, b"new")
    blocks.release(old)
    blocks.release(new)
    assert blocks.allocate() == old
    assert blocks.lookup(b"old") is None and blocks.lookup(b"new") == new


def test_releasing_a_block_more_often_than_taken_raises():
    blocks = BlockAllocator(1)
    b = blocks.allocate()
    blocks.release(b)
    with pytest.raises(RuntimeError):
        blocks.release(b)


def test_random_share_and_release_keep_counts_consistent():
    blocks, rng = BlockAllocator(12), random.Random(0)
    held: list[int] = []
    for step in range(3000):
        op = rng.random()
        if op < 0.4 and blocks.num_free:
            b = blocks.allocate()
            if rng.random() < 0.5:
                blocks.publish(b, step.to_bytes(4, "little"))
            held.append(b)
        elif op < 0.6 and held:
            found = blocks.lookup(blocks.digest_of[rng.choice(held)] or b"")
            if found is not None:
                blocks.share(found)
                held.append(found)
        elif held:
            blocks.release(held.pop(rng.randrange(len(held))))
        assert all(blocks.refs[b] == held.count(b) for b in range(12))
        assert blocks.num_free == sum(r == 0 for r in blocks.refs)
    for b in held:
        blocks.release(b)
    assert blocks.num_free == 12


# ------------------------------------------------------------------ engine: outputs
@pytest.mark.parametrize("method", ["off", "ngram", "draft"])
def test_greedy_output_identical_with_cache_on_and_off_alone_and_batched(
    tiny_model_dir, tiny_draft_dir, expected, method
):
    cached = engine(tiny_model_dir, method=method, draft=tiny_draft_dir if method == "draft" else None)
    alone = [cached.generate(p, GREEDY)[0] for p in PROMPTS]
    assert [o.token_ids for o in alone] == expected
    assert alone[1].usage.cached_tokens == 64 and alone[2].usage.cached_tokens == 32
    batched = cached.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in batched] == expected
    assert all(o.usage.cached_tokens > 0 for o in batched)
    if method != "off":
        assert sum(o.stats.drafted for o in alone + batched) > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_output_identical_across_preemption(tiny_model_dir, tiny_draft_dir, uncached, method):
    """A pool of 10 blocks cannot hold four growing sequences: the newest are preempted and
    resume from what the cache kept of them."""
    prompts = [SHARED[:40] + [i, i + 1] for i in (20, 30, 40, 50)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in uncached.generate(prompts, params)]
    small = engine(
        tiny_model_dir, method=method, draft=tiny_draft_dir if method == "draft" else None, kv_cache_tokens=10 * BLOCK
    )
    assert [o.token_ids for o in small.generate(prompts, params)] == want
    assert small.scheduler.num_preemptions > 0
    assert all_blocks_free(small.pool)


def test_next_turn_hits_the_generated_tokens(tiny_model_dir):
    cached = engine(tiny_model_dir)
    first = cached.generate(PROMPTS[0], GREEDY)[0]
    history = first.prompt_token_ids + first.token_ids
    second = cached.generate(history + [21, 22, 23], GREEDY)[0]
    # Every full block of the first turn's committed tokens (the last token has no KV).
    assert second.usage.cached_tokens == (len(history) - 1) // BLOCK * BLOCK > len(first.prompt_token_ids) - BLOCK


def test_chunked_prefill_with_a_partial_hit_matches_uncached(tiny_model_dir, uncached):
    prompt = SHARED[:50] + [200 + i % 50 for i in range(60)]
    want = uncached.generate(prompt, GREEDY)[0].token_ids
    chunked = engine(tiny_model_dir, max_num_batched_tokens=24)
    chunked.generate(SHARED, GREEDY)
    out = chunked.generate(prompt, GREEDY)[0]
    assert out.usage.cached_tokens == 48 and out.token_ids == want


def test_cache_salt_separates_tenants_with_the_same_prompt(tiny_model_dir, expected):
    cached = engine(tiny_model_dir)
    salted = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, cache_salt=s) for s in ("a", "b", "a")]
    outs = [cached.generate(PROMPTS[0], p)[0] for p in salted]
    assert [o.usage.cached_tokens for o in outs] == [0, 0, 64]
    assert cached.generate(PROMPTS[0], GREEDY)[0].usage.cached_tokens == 0  # no salt: a tenant of its own
    assert all(o.token_ids == expected[0] for o in outs)


def test_eviction_in_a_tiny_pool_under_pressure(tiny_model_dir, uncached):
    """Eight blocks: each request needs six, so each new prompt evicts what the last one left."""
    prompts = [[(i * 13 + j * 7) % 300 + 5 for j in range(70)] for i in range(3)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in uncached.generate(prompts, params)]
    tiny = engine(tiny_model_dir, kv_cache_tokens=8 * BLOCK, max_model_len=8 * BLOCK)
    first = tiny.generate(prompts[0], params)[0]
    again = tiny.generate(prompts[0], params)[0]
    assert again.usage.cached_tokens == 64 and again.token_ids == first.token_ids == want[0]
    for p, w in zip(prompts[1:], want[1:]):
        out = tiny.generate(p, params)[0]
        assert out.token_ids == w and out.usage.cached_tokens == 0
    evicted = tiny.generate(prompts[0], params)[0]
    assert evicted.usage.cached_tokens == 0 and evicted.token_ids == want[0]
    assert all_blocks_free(tiny.pool)


# ------------------------------------------------------------------ engine: what is cached
def assert_cached_blocks_hold_recomputed_kv(model, pool: KVPool, tokens: list[int], salt=None) -> int:
    """Every cached block of tokens' prefix chain holds the KV a fresh prefill computes."""
    ref_pool = KVPool(
        len(pool.keys),
        pool.keys[0].shape[1],
        pool.keys[0].shape[2],
        len(tokens) + BLOCK,
        BLOCK,
        pool.keys[0].dtype,
        "cpu",
    )
    table: list[int] = []
    ref_pool.reserve(table, len(tokens))
    ModelRunner(model, ref_pool).forward([ForwardItem(table, 0, tokens, 1)])
    digests: list[bytes] = []
    extend_digests(digests, tokens, BLOCK, salt, len(tokens) // BLOCK)
    checked = 0
    for i, digest in enumerate(digests):
        block = pool.blocks.lookup(digest)
        if block is None:
            continue
        ref = ref_pool.slots(table, i * BLOCK, (i + 1) * BLOCK)
        for layer in range(len(pool.keys)):
            got = pool.keys[layer][block * BLOCK : (block + 1) * BLOCK]
            torch.testing.assert_close(got, ref_pool.keys[layer][ref], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(
                pool.values[layer][block * BLOCK : (block + 1) * BLOCK],
                ref_pool.values[layer][ref],
                atol=1e-4,
                rtol=1e-4,
            )
        checked += 1
    return checked


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_rejected_drafts_never_leave_their_kv_in_a_cached_block(tiny_model_dir, tiny_draft_dir, method):
    spec = engine(tiny_model_dir, method=method, k=6, draft=tiny_draft_dir if method == "draft" else None)
    outs = spec.generate(PROMPTS, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    assert sum(o.stats.drafted - o.stats.accepted for o in outs) > 0
    for o in outs:
        tokens = o.prompt_token_ids + o.token_ids
        assert assert_cached_blocks_hold_recomputed_kv(spec.model, spec.pool, tokens) >= len(tokens) // BLOCK - 1
        if method == "draft":
            assert assert_cached_blocks_hold_recomputed_kv(spec.proposer.runner.model, spec.proposer.pool, tokens) > 0


def record_draft_passes(spec) -> list[int]:
    """Tokens fed by each of the draft model's passes from now on."""
    fed: list[int] = []
    forward = spec.proposer.runner.forward
    spec.proposer.runner.forward = lambda items: fed.append(sum(len(i.tokens) for i in items)) or forward(items)
    return fed


def evict_everything(blocks: BlockAllocator) -> None:
    """Fill the pool (evicting every cached block) and free it again."""
    taken = [blocks.allocate() for _ in range(blocks.num_free)]
    for block in taken:
        blocks.release(block)
    assert blocks.num_cached == 0


def test_draft_model_starts_past_its_own_cached_prefix(tiny_model_dir, tiny_draft_dir, expected):
    spec = engine(tiny_model_dir, method="draft", k=3, draft=tiny_draft_dir)
    spec.generate(PROMPTS[0], GREEDY)
    fed = record_draft_passes(spec)
    out = spec.generate(PROMPTS[1], GREEDY)[0]
    assert out.token_ids == expected[1]
    # The draft follows the target's prefill, which starts past the 64 cached tokens, as does its own KV.
    assert fed[0] == len(PROMPTS[1]) - 64


def test_draft_model_ahead_of_the_target_feeds_only_past_its_cached_prefix(tiny_model_dir, tiny_draft_dir, expected):
    spec = engine(tiny_model_dir, method="draft", k=3, draft=tiny_draft_dir, max_num_batched_tokens=BLOCK)
    spec.generate(PROMPTS[0], GREEDY)
    evict_everything(spec.pool.blocks)  # the target recomputes the prompt in 16-token chunks
    fed = record_draft_passes(spec)
    out = spec.generate(PROMPTS[1], GREEDY)[0]
    assert out.token_ids == expected[1] and out.usage.cached_tokens == 0
    # Chunks below the draft's 64 cached tokens feed it nothing; the last one feeds the rest.
    assert fed[0] == len(PROMPTS[1]) - 64


def test_draft_model_behind_the_target_catches_up_within_the_step_budget(tiny_model_dir, tiny_draft_dir, expected):
    spec = engine(tiny_model_dir, method="draft", k=3, draft=tiny_draft_dir, max_num_batched_tokens=BLOCK)
    spec.generate(PROMPTS[0], GREEDY)
    evict_everything(spec.proposer.pool.blocks)
    fed = record_draft_passes(spec)
    out = spec.generate(PROMPTS[1], GREEDY)[0]
    assert out.token_ids == expected[1] and out.usage.cached_tokens == 64
    # The target's one 8-token chunk finds the draft level with nothing, so it catches up in
    # pieces of at most one step's budget.
    assert max(fed) <= BLOCK and sum(fed) >= len(PROMPTS[1])


def test_every_block_returns_after_random_cancellations(tiny_model_dir):
    spec = engine(tiny_model_dir, method="ngram", k=4, kv_cache_tokens=40 * BLOCK, max_num_batched_tokens=64)
    rng = random.Random(0)
    live: list[str] = []
    cancelled = 0
    while cancelled < 200:
        while len(live) < 6:
            prompt = SHARED[: rng.randint(5, 70)] + [rng.randint(5, 300) for _ in range(rng.randint(1, 20))]
            params = SamplingParams(
                max_tokens=rng.randint(1, 40), temperature=rng.choice([0, 0.8]), seed=1, ignore_eos=True
            )
            live.append(spec.add_request(prompt, params))
        for chunk in spec.step():
            if chunk.finished:
                live.remove(chunk.request_id)
        for rid in rng.sample(live, rng.randint(0, 2)):
            spec.abort(rid)
            live.remove(rid)
            cancelled += 1
        assert min(spec.pool.blocks.refs) >= 0
        held = sorted(b for s in spec.scheduler.running + list(spec.scheduler.waiting) for b in s.block_table)
        assert sum(spec.pool.blocks.refs) == len(held)
    for rid in live:
        spec.abort(rid)
    assert all_blocks_free(spec.pool) and spec.pool.blocks.num_cached > 0


def test_usage_and_metrics_count_cached_prompt_tokens(tiny_model_dir):
    cached = engine(tiny_model_dir)
    cached.generate(PROMPTS[0], GREEDY)
    rid = cached.add_request(PROMPTS[1], GREEDY)
    last = None
    while cached.has_unfinished():
        last = next((c for c in cached.step() if c.request_id == rid and c.finished), last)
    assert last.usage.cached_tokens == 64 and last.usage.prompt_tokens == len(PROMPTS[1])
    registry = cached.metrics.registry
    assert registry.get_sample_value("specstream_prefix_cache_queries_total") == len(PROMPTS[0]) + len(PROMPTS[1])
    assert registry.get_sample_value("specstream_prefix_cache_hits_total") == 64


def test_caching_off_shares_nothing(tiny_model_dir, uncached, expected):
    outs = uncached.generate(PROMPTS, GREEDY)
    assert [o.usage.cached_tokens for o in outs] == [0] * len(PROMPTS)
    assert uncached.pool.blocks.num_cached == 0 and all_blocks_free(uncached.pool)


def test_gateway_passes_cache_salt_and_accepts_prompt_cache_key():
    from gateway.errors import APIError
    from gateway.protocol import ChatCompletionRequest, parse

    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "cache_salt": "tenant-1",
        "prompt_cache_key": "s1",
    }
    req = parse(ChatCompletionRequest, body)
    params = req.sampling_params(max_tokens=4, logprobs=None, seed_offset=0, engine_method="ngram")
    assert params.cache_salt == "tenant-1"
    with pytest.raises(APIError):
        parse(ChatCompletionRequest, {**body, "cache_salt": ""})


# ------------------------------------------------------------------ windowed layer groups
def windowed_seq(tokens):
    return Sequence("s", tokens, SamplingParams(), arrival=0)


def test_a_hit_needs_the_full_groups_prefix_and_the_windowed_groups_last_window():
    # Layer 0 attends an 8-token window, layer 1 everything; blocks of 4 positions.
    pool = KVPool(2, 2, 4, 256, 4, torch.float32, "cpu", windows=[8, None])
    cache = PrefixCache(pool)
    tokens = list(range(10, 40))
    a = windowed_seq(tokens)
    table = pool.new_table()
    assert pool.reserve(table, 28)
    cache.publish(table, a, 16, 0)  # blocks 0..3 committed
    assert pool.reserve(table, 28, start=27)  # the window moves on: windowed blocks 0..4 dropped, 4 unpublished
    cache.publish(table, a, 28, 4)  # full group: blocks 4..6; windowed group: 5, 6
    pool.free(table)

    # 29 tokens: a hit of 7 blocks (28 positions) reads windowed blocks 5 and 6 only: all cached.
    b = pool.new_table()
    assert cache.acquire(b, windowed_seq(tokens[:29])) == 28
    full, window = pool.tables(b)
    assert len(full) == 7 and window[:5] == [NO_BLOCK] * 5 and NO_BLOCK not in window[5:]
    pool.free(b)
    # 21 tokens: 5 blocks would read windowed blocks 3 and 4, and block 4 was never cached: 4 blocks.
    c = pool.new_table()
    assert cache.acquire(c, windowed_seq(tokens[:21])) == 16
    assert pool.tables(c)[1] == [NO_BLOCK, NO_BLOCK] + pool.tables(c)[1][2:] and len(pool.tables(c)[1]) == 4
    pool.free(c)
    assert all_blocks_free(pool)
