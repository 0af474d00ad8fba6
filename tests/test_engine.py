"""Engine: speculative output equals plain output (fp32 greedy), seeded sampling is
reproducible, speculative sampling keeps the target's distribution, limits hold."""

import pytest
import torch

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.spec_decode.policy import StepBase

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef add(",
    "Paris",
    "Speculative decoding lets a small proposer guess tokens. Speculative decoding lets a small proposer guess tokens that a large model verifies. Speculative",
    [{"role": "user", "content": "Hello! How can I help you today?"}],
]


def engine(model, method="off", k=4, adaptive=False, **kw):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, adaptive=adaptive, **kw.pop("spec", {}))
    return Engine(EngineConfig(model=str(model), dtype="float32", speculative=spec, **kw), log=False)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return engine(tiny_model_dir)


GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def test_ngram_greedy_equals_plain_alone_and_batched(tiny_model_dir, plain):
    spec = engine(tiny_model_dir, "ngram", k=5)
    expected = [plain.generate(p, GREEDY)[0].token_ids for p in PROMPTS]
    assert [spec.generate(p, GREEDY)[0].token_ids for p in PROMPTS] == expected
    batched = spec.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in batched] == expected
    assert sum(o.stats.drafted for o in batched) > 0 and sum(o.stats.accepted for o in batched) > 0


def test_draft_model_greedy_equals_plain_alone_and_batched(tiny_model_dir, tiny_draft_dir, plain):
    spec = engine(tiny_model_dir, "draft", k=3, spec={"draft_model": str(tiny_draft_dir)})
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert [spec.generate(p, GREEDY)[0].token_ids for p in PROMPTS] == expected
    batched = spec.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in batched] == expected
    stats = batched[0].stats
    assert stats.drafted > 0 and stats.drafted_per_position[0] >= stats.drafted_per_position[-1]


def test_draft_identical_to_target_is_always_accepted(tiny_model_dir):
    spec = engine(tiny_model_dir, "draft", k=4, spec={"draft_model": str(tiny_model_dir)})
    out = spec.generate(PROMPTS[0], GREEDY)[0]
    assert out.stats.accepted == out.stats.drafted > 0


def test_adaptive_k_greedy_equals_plain(tiny_model_dir, plain):
    spec = engine(tiny_model_dir, "ngram", k=8, adaptive=True)
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


def test_penalties_apply_identically_with_and_without_speculation(tiny_model_dir, plain):
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, presence_penalty=0.7, frequency_penalty=0.4)
    spec = engine(tiny_model_dir, "ngram", k=4)
    got, want = spec.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert want[0].token_ids != plain.generate(PROMPTS[0], GREEDY)[0].token_ids[:30]


def test_repetition_penalty_and_min_p_apply_identically_with_and_without_speculation(tiny_model_dir, plain):
    """vLLM's repetition_penalty (over the prompt and output, each verified row counting the drafts before it) and
    min_p change the output, and speculation does not change it: greedy, and seeded sampling."""
    spec = engine(tiny_model_dir, "ngram", k=4)
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=1.8)
    want = plain.generate(PROMPTS, greedy)
    assert [o.token_ids for o in spec.generate(PROMPTS, greedy)] == [o.token_ids for o in want]
    assert want[0].token_ids != plain.generate(PROMPTS[0], GREEDY)[0].token_ids[:30]
    sampled = [
        SamplingParams(max_tokens=30, temperature=1.2, min_p=0.1, repetition_penalty=1.3, seed=s, ignore_eos=True)
        for s in range(len(PROMPTS))
    ]
    first = [o.token_ids for o in plain.generate(PROMPTS, sampled)]
    assert [o.token_ids for o in spec.generate(PROMPTS, sampled)] == first
    free = [SamplingParams(max_tokens=30, temperature=1.2, seed=s, ignore_eos=True) for s in range(len(PROMPTS))]
    assert [o.token_ids for o in plain.generate(PROMPTS, free)] != first


def test_min_tokens_holds_back_every_end_and_speculation_does_not_change_the_output(tiny_model_dir, plain):
    """vLLM's min_tokens: before it, no stop token (nor EOS) is drawn and no stop string ends the output; after
    it, they end it as before. The same tokens with drafts (every verified row holds the ends by its position)."""
    spec = engine(tiny_model_dir, "ngram", k=4)
    free = plain.generate(PROMPTS, GREEDY)
    for out, prompt in zip(free, PROMPTS):
        stop_token = out.token_ids[2]
        params = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_token], min_tokens=12)
        got = plain.generate(prompt, params)[0]
        assert len(got.token_ids) >= 12 and stop_token not in got.token_ids[:11]
        assert spec.generate(prompt, params)[0].token_ids == got.token_ids
        stop_text = out.text[: max(1, len(out.text) // 8)]  # the output's start: it would stop at once
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop_text], min_tokens=10)
        got = plain.generate(prompt, params)[0]
        assert len(got.token_ids) >= 10 and spec.generate(prompt, params)[0].token_ids == got.token_ids
    sampled = [SamplingParams(max_tokens=20, temperature=1.0, min_tokens=15, seed=s) for s in range(len(PROMPTS))]
    want = [o.token_ids for o in plain.generate(PROMPTS, sampled)]
    assert all(len(t) >= 15 for t in want) and [o.token_ids for o in spec.generate(PROMPTS, sampled)] == want


def test_seeded_sampling_is_reproducible_and_ngram_does_not_change_it(tiny_model_dir, plain):
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, top_k=50, seed=s, ignore_eos=True) for s in range(len(PROMPTS))]
    first = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert [o.token_ids for o in plain.generate(PROMPTS, params)] == first
    spec = engine(tiny_model_dir, "ngram", k=4)
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == first


@pytest.mark.parametrize(
    "extra", [{}, {"min_p": 0.05, "repetition_penalty": 1.5}], ids=["plain", "min_p-and-repetition-penalty"]
)
def test_draft_model_sampling_keeps_target_distribution(tiny_model_dir, tiny_draft_dir, extra):
    """The second output token passes through the rejection sampler (its draft comes from
    the draft model); its frequencies over many seeds must match the exact marginal
    sum_t1 p(t1) p(t2 | t1) computed from the target model, within 5 standard deviations. With min_p and
    repetition_penalty, p is the distribution they define (the second row penalizing the first token too)."""
    from specstream.model.loader import load_model, resolve_model
    from specstream.sampling import apply_repetition_penalty, probabilities

    prompt = [5, 40, 7, 99, 12]
    n = 3000
    spec = engine(tiny_model_dir, "draft", k=3, spec={"draft_model": str(tiny_draft_dir)}, max_num_seqs=256, max_num_batched_tokens=2048)
    # max_tokens=3: a draft is verified only where it can be kept (one draft here, the round's bonus token beside
    # it); in waves whose prompts are prefilled in one step, as a step that feeds a prompt drafts nothing
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True, **extra) for s in range(n)]
    outs = [o for i in range(0, n, 250) for o in spec.generate([prompt] * len(params[i : i + 250]), params[i : i + 250])]
    assert sum(o.stats.drafted for o in outs) >= n
    second = torch.tensor([o.token_ids[1] for o in outs])

    ref = load_model(resolve_model(str(tiny_model_dir)))
    def dist(logits: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        if not extra:
            return logits.softmax(-1)
        logits = apply_repetition_penalty(logits, seen, extra["repetition_penalty"])
        rows = logits.shape[0]
        ones, none = torch.ones(rows), torch.zeros(rows, dtype=torch.long)
        return probabilities(logits, ones, none, ones, torch.full((rows,), extra["min_p"]))

    with torch.inference_mode():
        logits1 = ref(torch.tensor([prompt])).logits[0, -1:].float()
        vocab = logits1.shape[-1]
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[prompt] = True
        p1 = dist(logits1, seen[None])[0]
        batch = torch.cat([torch.tensor([prompt]).expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        seen2 = seen[None].repeat(vocab, 1)
        seen2[torch.arange(vocab), torch.arange(vocab)] = True  # the first token, as output before the second
        p2 = dist(ref(batch).logits[:, -1].float(), seen2)
    marginal = (p1[:, None] * p2).sum(0).double()
    freq = torch.bincount(second, minlength=vocab).double() / n
    bound = 5 * torch.sqrt(marginal * (1 - marginal) / n) + 1.0 / n
    assert ((freq - marginal).abs() <= bound).all()


def test_stop_string_and_max_tokens(tiny_model_dir, plain):
    full = plain.generate(PROMPTS[0], GREEDY)[0]
    stop = full.text[10:14]
    out = plain.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(stop)]
    short = plain.generate(PROMPTS[0], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 7


def test_no_round_drafts_past_what_the_completion_may_still_hold(tiny_model_dir):
    """A round emits its kept drafts and one token more: a sequence with r tokens left drafts at most r - 1, so no
    row is verified whose token could never be kept."""
    spec = engine(tiny_model_dir, "ngram", k=8)
    seen = []
    schedule = spec.scheduler.schedule

    def recorded():
        plan = schedule()
        seen.extend((k, s.max_tokens - s.num_output_tokens) for s, k in zip(plan.decodes, plan.ks))
        return plan

    spec.scheduler.schedule = recorded
    out = spec.generate(PROMPTS[3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and seen and all(k <= left - 1 for k, left in seen)
    assert seen[0] == (4, 5) and out.stats.drafted > 0  # k=8 asked: 5 tokens left after the prefill's


def test_speculation_never_overshoots_max_tokens_or_stop(tiny_model_dir, plain):
    spec = engine(tiny_model_dir, "ngram", k=8)
    for max_tokens in (1, 2, 5, 9):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        assert spec.generate(PROMPTS[0], params)[0].token_ids == plain.generate(PROMPTS[0], params)[0].token_ids


def test_eos_finishes_with_stop(tiny_model_dir, plain):
    eos = plain.tokenizer.eos_token_id
    out = plain.generate(PROMPTS[2], SamplingParams(max_tokens=50, temperature=0, stop_token_ids=[], ignore_eos=False))[0]
    assert out.finish_reason in ("stop", "length")
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == eos


def test_small_kv_pool_preempts_and_still_matches(tiny_model_dir, plain):
    tight = engine(tiny_model_dir, "ngram", k=4, kv_cache_tokens=192, kv_block_size=8, max_model_len=160)
    got = tight.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert tight.scheduler.num_preemptions > 0
    assert tight.pool.num_free_blocks == tight.pool.num_blocks


def test_chunked_prefill_matches_unchunked(tiny_model_dir, plain):
    chunked = engine(tiny_model_dir, "ngram", k=4, max_num_batched_tokens=8)
    assert [o.token_ids for o in chunked.generate(PROMPTS, GREEDY)] == [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]


def test_pool_is_empty_after_generate_and_abort(tiny_model_dir):
    e = engine(tiny_model_dir, "ngram", k=4)
    e.generate(PROMPTS, GREEDY)
    rid = e.add_request(PROMPTS[0], GREEDY)
    e.step()
    e.step()
    assert e.pool.num_free_blocks < e.pool.num_blocks
    assert e.abort(rid) and not e.has_unfinished()
    assert e.pool.num_free_blocks == e.pool.num_blocks


def test_prompt_longer_than_context_is_refused(tiny_model_dir):
    e = engine(tiny_model_dir, max_model_len=32)
    with pytest.raises(ValueError, match="context is 32 tokens"):
        e.add_request(list(range(40)), GREEDY)


@pytest.mark.parametrize("bad", ["", [], [{"role": "user"}], [10**9], 3.5])
def test_bad_prompts_are_refused(plain, bad):
    with pytest.raises(ValueError):
        plain.add_request(bad, GREEDY)


def test_draft_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from conftest import build_tiny_model

    other = build_tiny_model(tmp_path / "other-vocab", seed=2, vocab_size=300)
    with pytest.raises(ValueError, match="does not share the target's vocabulary"):
        engine(tiny_model_dir, "draft", spec={"draft_model": str(other)})


def test_default_model_ngram_greedy_equals_plain_batched():
    prompts = [
        [{"role": "user", "content": "Rewrite in the past tense: The cat sits on the mat and the dog runs in the garden."}],
        [{"role": "user", "content": "What is the capital of France?"}],
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    ]
    params = SamplingParams(max_tokens=24, temperature=0)
    # The weight-only kernels: in float32, decode and verification steps then differ by float32 rounding only.
    # a8 rounds each projection's input to 8 bits, which can turn such a last-bit difference into a step of one
    # code; its losslessness is tested where the steps compute a row alike (tests/test_a8.py).
    config = dict(dtype="float32", quantization="int4")
    plain = Engine(EngineConfig(**config, speculative=SpeculativeConfig(method="off")), log=False)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=6, adaptive=False)
    spec = Engine(EngineConfig(**config, speculative=ngram), log=False)
    want = [plain.generate(p, params)[0].token_ids for p in prompts]
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert "Paris" in got[1].text
    assert sum(o.stats.accepted for o in got) > 0
    # Suffix decoding's trees through the compiled steps: the second time, the global cache drafts whole answers.
    suffix = SpeculativeConfig(method="suffix", num_speculative_tokens=8, adaptive=False, suffix_min_token_prob=0.0)
    trees = Engine(EngineConfig(**config, speculative=suffix), log=False)
    assert trees.proposer.trees
    for _ in range(2):
        got = trees.generate(prompts, params)
        assert [o.token_ids for o in got] == want
    assert sum(o.stats.accepted for o in got) > 0.7 * sum(len(o.token_ids) for o in got)


def test_logprobs_match_the_reference_model_with_and_without_speculation(tiny_model_dir, plain):
    from specstream.model.loader import load_model, resolve_model

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    prompt = PROMPTS[0]
    ids = plain.processor.encode(prompt)
    spec = engine(tiny_model_dir, "ngram", k=4)
    chunks = []
    spec.add_request(prompt, params, request_id="lp")
    while spec.has_unfinished():
        chunks += [c for c in spec.step() if c.request_id == "lp"]
    lps = [lp for c in chunks for lp in c.logprobs]
    out = [t for c in chunks for t in c.token_ids]
    ref = load_model(resolve_model(str(tiny_model_dir)))
    with torch.inference_mode():
        logp = ref(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1].log_softmax(-1)
    assert [lp.token_id for lp in lps] == out
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in lps]), logp.gather(1, torch.tensor(out)[:, None]).squeeze(1), atol=1e-4, rtol=1e-4)
    assert all(len(lp.top) == 3 and lp.top[0][0] == t for lp, t in zip(lps, out))  # greedy: top-1 is the token


def test_per_request_speculation_cap(tiny_model_dir):
    spec = engine(tiny_model_dir, "ngram", k=4)
    off = spec.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, num_speculative_tokens=0))[0]
    two = spec.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, num_speculative_tokens=2))[0]
    assert off.stats.drafted == 0
    assert 0 < two.stats.drafted and len(two.stats.drafted_per_position) <= 2
    assert off.token_ids == two.token_ids


def test_max_tokens_beyond_context_is_refused_and_none_means_up_to_context(tiny_model_dir):
    e = engine(tiny_model_dir, max_model_len=40)
    with pytest.raises(ValueError, match="lower max_tokens"):
        e.add_request([1, 2, 3], SamplingParams(max_tokens=38))
    out = e.generate([1, 2, 3], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 37 and out.finish_reason == "length"


def test_requests_sharing_params_without_seed_sample_independently(plain):
    outs = plain.generate(["Hello world"] * 4, SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_recovered_tokens_do_not_reuse_a_later_rounds_uniform():
    """Two consecutive rejections must draw their recovered tokens independently: with a
    fixed p and a draft that always proposes token 0, the recovered tokens of rounds that
    start one position apart must not always agree."""
    from specstream.spec_decode.proposer import Draft
    from specstream.sequence import Sequence
    from specstream.spec_decode.verify import Round, verify_round

    p = torch.tensor([0.4, 0.3, 0.3]).log()
    same = both = 0
    for seed in range(400):
        seq = Sequence("r", [1], SamplingParams(max_tokens=10, temperature=1.0, seed=seed), 0)
        q = torch.tensor([[1.0, 0.0, 0.0]] * 2)
        first = verify_round([Round(seq, Draft([0, 0], q), p.expand(3, -1).clone())])[0]
        if first.num_accepted != 0:
            continue
        seq.token_ids += first.tokens
        second = verify_round([Round(seq, Draft([0], q[:1]), p.expand(2, -1).clone())])[0]
        if second.num_accepted == 0:
            both += 1
            same += first.tokens[-1] == second.tokens[-1]
    assert both > 50 and same < both * 0.8


def test_top_k_beyond_the_vocabulary_is_refused_and_the_engine_goes_on(plain):
    from specstream.errors import InvalidRequestError

    for temperature in (1.0, 0.0):
        with pytest.raises(InvalidRequestError) as refused:
            plain.add_request(PROMPTS[0], SamplingParams(temperature=temperature, top_k=2**70))
        assert refused.value.param == "top_k"
    assert not plain.has_unfinished()
    out = plain.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=1.0, top_k=plain.vocab_size, seed=1))[0]
    assert len(out.token_ids) == 5


def run_all(e: Engine, requests: dict[str, tuple]) -> dict[str, list]:
    """Submit prepared requests; step until done; chunks by request id."""
    chunks: dict[str, list] = {rid: [] for rid in requests}
    for rid, (prompt, params, spoil) in requests.items():
        seq = e.prepare(prompt, params, rid)
        spoil(seq)
        e.submit(seq)
    while e.has_unfinished():
        for c in e.step():
            chunks[c.request_id].append(c)
    return chunks


def break_top_k(seq):
    # Past validation, as a bug elsewhere might: this overflows when sampling tensors are built.
    seq.params.top_k = 2**70


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_request_that_raises_inside_the_step_fails_alone(tiny_model_dir, tiny_draft_dir, plain, method):
    """With n-gram drafts the bad request breaks batched verification; with a draft model, the
    batched proposal. Either way it ends with an error chunk and the others finish: as they
    would alone, except that sampled requests beside a draft model may draw other (equally
    distributed) tokens, since the retry restarts the draft model's cache."""
    e = engine(tiny_model_dir, method, k=3, spec={"draft_model": str(tiny_draft_dir)} if method == "draft" else {})
    sampled = lambda s: SamplingParams(max_tokens=20, temperature=0.9, seed=s, ignore_eos=True)  # noqa: E731
    keep = lambda seq: None  # noqa: E731
    good = {f"good{i}": (PROMPTS[i], sampled(i) if i % 2 else GREEDY, keep) for i in range(4)}
    chunks = run_all(e, {**good, "bad": (PROMPTS[0], sampled(9), break_top_k)})
    assert chunks["bad"][-1].finish_reason == "error" and chunks["bad"][-1].error
    for rid, (prompt, params, _) in good.items():
        tokens = [t for c in chunks[rid] for t in c.token_ids]
        assert chunks[rid][-1].finish_reason == "length" and len(tokens) == params.max_tokens
        if method == "ngram" or params.greedy:
            assert tokens == plain.generate(prompt, params)[0].token_ids[: params.max_tokens]
    assert e.pool.num_free_blocks == e.pool.num_blocks


def _break_forced_tokens(seq):
    def forced(limit):
        raise RuntimeError("a grammar matcher that fails to force tokens")

    seq.constraint.forced = forced


def test_a_request_whose_grammar_drafts_raise_fails_alone(tiny_model_dir, plain):
    """The grammar's drafts (forced tokens, cutting) are built for every decoding sequence in one call;
    one sequence's failure there ends that request alone."""
    from specstream import StructuredOutput

    e = engine(tiny_model_dir, "ngram", k=3)
    keep = lambda seq: None  # noqa: E731
    structured = SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutput(json_object=True))
    good = {f"good{i}": (PROMPTS[i], GREEDY, keep) for i in range(3)}
    chunks = run_all(e, {**good, "bad": (PROMPTS[3], structured, _break_forced_tokens)})
    assert chunks["bad"][-1].finish_reason == "error" and chunks["bad"][-1].error
    for rid, (prompt, params, _) in good.items():
        assert [t for c in chunks[rid] for t in c.token_ids] == plain.generate(prompt, params)[0].token_ids
    assert e.pool.num_free_blocks == e.pool.num_blocks


def test_a_proposer_whose_prefill_raises_drops_its_state_and_the_requests_go_on(
    tiny_model_dir, tiny_draft_dir, plain, monkeypatch
):
    """A draft model follows the target's prefill chunks; when that fails, its state for those
    sequences is dropped (it catches up when they next draft) and no request fails."""
    e = engine(tiny_model_dir, "draft", k=3, spec={"draft_model": str(tiny_draft_dir)})
    follow, failures = e.proposer.prefill, []

    def fails_once(chunks):
        if chunks and not failures:
            failures.append(len(chunks))
            raise RuntimeError("a draft pass that fails")
        follow(chunks)

    monkeypatch.setattr(e.proposer, "prefill", fails_once)
    outs = e.generate(PROMPTS[:3], GREEDY)
    assert failures and [o.finish_reason for o in outs] == ["length"] * 3
    assert [o.token_ids for o in outs] == [plain.generate(p, GREEDY)[0].token_ids for p in PROMPTS[:3]]
    assert e.pool.num_free_blocks == e.pool.num_blocks


def test_accepted_drafts_cut_by_a_limit_or_a_stop_do_not_count(tiny_model_dir):
    """A draft identical to the target has every draft accepted; a round drafts no more than max_tokens leaves
    room for, and tokens accepted past a stop token are never emitted, so they must not count."""
    spec = engine(tiny_model_dir, "draft", k=4, spec={"draft_model": str(tiny_model_dir)})
    full = spec.generate(PROMPTS[0], GREEDY)[0].token_ids
    cut = spec.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    # Round 1 (the prompt) emits one token; round 2 may emit only 2: it drafts one, accepted, and its bonus token.
    assert cut.token_ids == full[:3] and cut.stats.accepted == 1 and cut.stats.drafted == 1
    stop_at = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[full[2]])
    stop = spec.generate(PROMPTS[0], stop_at)[0]
    first_stop = full.index(full[2])
    assert stop.token_ids == full[: first_stop + 1] and stop.stats.accepted <= first_stop
    fresh = engine(tiny_model_dir, "draft", k=4, spec={"draft_model": str(tiny_model_dir)})
    fresh.generate(PROMPTS[0], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert fresh.metrics.registry.get_sample_value("specstream_spec_decode_num_accepted_tokens_total") == 1


def test_unseeded_requests_follow_the_engine_seed_not_the_global_random(tiny_model_dir):
    import random

    params = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    outs = []
    for engine_seed, global_seed in ((7, 0), (7, 1), (8, 0)):
        random.seed(global_seed)
        e = engine(tiny_model_dir, seed=engine_seed)
        outs.append([o.token_ids for o in e.generate(PROMPTS[:3], params)])
    assert outs[0] == outs[1] != outs[2]


def test_gauges_are_fresh_after_submit_and_abort_without_a_step(tiny_model_dir):
    e = engine(tiny_model_dir)
    names = ("specstream_num_requests_running", "specstream_num_requests_waiting", "specstream_kv_cache_usage_perc")
    gauges = lambda: tuple(e.metrics.registry.get_sample_value(n) for n in names)  # noqa: E731
    rid = e.add_request(PROMPTS[0], GREEDY)
    assert gauges() == (0, 1, 0.0)
    e.step()
    assert gauges()[:2] == (1, 0) and gauges()[2] > 0
    e.abort(rid)
    assert gauges() == (0, 0, 0.0)


def test_the_draft_model_follows_the_targets_prefill_chunks(tiny_model_dir, tiny_draft_dir, plain):
    e = engine(tiny_model_dir, "draft", k=3, max_num_batched_tokens=16, spec={"draft_model": str(tiny_draft_dir)})
    fed = []
    real = e.proposer.runner.forward
    e.proposer.runner.forward = lambda items: (fed.append(sum(len(i.tokens) for i in items)), real(items))[1]
    prompt = list(range(20, 140))  # 120 tokens: eight chunks
    assert e.generate(prompt, GREEDY)[0].token_ids == plain.generate(prompt, GREEDY)[0].token_ids
    assert max(fed) <= 16 and sum(fed) >= len(prompt)


def test_a_draft_model_catches_up_within_the_step_budget(tiny_model_dir, tiny_draft_dir):
    """A sequence the draft model has not seen (k = 0 rounds feed it nothing) catches up by at
    most max_num_batched_tokens per step and drafts once level."""
    e = engine(tiny_model_dir, "draft", k=3, max_num_batched_tokens=8, spec={"draft_model": str(tiny_draft_dir)})
    fed = []
    real = e.proposer.runner.forward
    e.proposer.runner.forward = lambda items: (fed.append(sum(len(i.tokens) for i in items)), real(items))[1]
    seq = e.prepare(list(range(5, 45)), GREEDY, "lagging")  # 40 tokens never fed to the draft model
    drafted = []
    for _ in range(6):
        drafted.append(len(e.proposer.propose([seq], [3])[0].tokens))
        e.proposer.on_commit(seq)  # a round that accepted nothing
    assert drafted == [0, 0, 0, 0, 3, 3]
    assert max(fed) <= 8
    e.proposer.release(seq)


def test_the_draft_models_cost_curve_follows_what_its_passes_take(tiny_model_dir, tiny_draft_dir):
    """Each draft pass (its forward and its choice of tokens) corrects the draft model's cost curve, timed once at
    start-up: a pass that runs slower than timed is priced as it runs."""
    from specstream.calibration import CostModel

    e = engine(tiny_model_dir, "draft", k=3, spec={"draft_model": str(tiny_draft_dir)})
    e.proposer.cost = CostModel([1, 2, 4], [1e-6, 2e-6, 3e-6])  # far below what a pass takes
    passes = []
    propose = e.proposer.propose

    def counted(seqs, ks):  # the forwards a round runs (prefill's, following the target's chunks, are not passes)
        real = e.proposer.runner.forward
        e.proposer.runner.forward = lambda items: (passes.append(len(items)), real(items))[1]
        try:
            return propose(seqs, ks)
        finally:
            e.proposer.runner.forward = real

    e.proposer.propose = counted
    out = e.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert out.stats.drafted > 0
    assert e.proposer.cost.observed == len(passes) > 0  # every drafting pass
    assert e.proposer.cost(1) > 5 * 1e-6


def test_the_proposer_is_told_the_step_its_drafts_join(tiny_model_dir):
    """Each drafting step, before propose(), the proposer learns the step's rows before drafts (every decoding
    sequence's next token) and the tokens it emits without drafts; a step that feeds a prompt drafts nothing."""
    e = engine(tiny_model_dir, "ngram", k=3)
    bases = []
    e.proposer.begin_step = bases.append
    e.add_request(list(range(5, 25)) * 2, GREEDY)
    for _ in range(3):
        e.step()
    e.add_request(list(range(60, 90)), GREEDY)  # its prompt is prefilled beside the first one's decoding
    e.step()
    while e.has_unfinished():
        e.step()
    assert bases and bases[0] == StepBase(1, 1.0)
    assert all(b.prefill_rows == 0 for b in bases)  # the step that fed the second prompt drafted nothing
    assert StepBase(2, 2.0) in bases


def test_drafts_never_ride_beside_a_prefill_chunk(tiny_model_dir):
    """While a prompt is prefilled, the decoding sequence beside it drafts nothing and the prompt takes all the rest
    of the step's budget, chunk after chunk; once the prompt is fed, both draft. (Beside a chunk a step runs eager
    and long: at 32 agent streams `auto`'s draft rows there cost more than they gave.)"""
    eng = engine(tiny_model_dir, "ngram", k=8, max_num_batched_tokens=64)
    eng.add_request(PROMPTS[3], GREEDY)
    while not any(s.is_decoding for s in eng.scheduler.running):
        eng.step()
    eng.add_request("word " * 80, GREEDY)  # longer than two steps' budget
    plans = []
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    while len(eng.scheduler.running) < 2 or not all(s.is_decoding for s in eng.scheduler.running):
        eng.step()
    eng.step()
    chunked = [p for p in plans if p.prefills]
    assert len(chunked) >= 2 and all(len(p.decodes) == 1 and p.ks == [0] for p in chunked)
    assert [n for p in chunked[:-1] for _, n in p.prefills] == [64 - 1] * (len(chunked) - 1)  # all the rest
    assert plans[-1].ks == [8, 8]
