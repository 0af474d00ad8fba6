"""Structured outputs in the engine: grammar masks on every verified row, forced drafts,
lossless constrained decoding with every proposer, logit bias, and failures that stay
inside one request."""

from __future__ import annotations

import json

import pytest
import torch

from specstream import Engine, EngineConfig, InvalidRequestError, SamplingParams, SpeculativeConfig
from specstream.spec_decode.proposer import Draft
from specstream.sequence import Sequence
from specstream.sampling import StructuredOutput
from specstream.structured.decoding import proposer_share
from specstream.spec_decode.verify import Round

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "n", "ok", "color", "tags"],
    "additionalProperties": False,
}


def engine(model, method="off", k=4, forced=True, **kw):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, adaptive=False, forced_drafts=forced, **kw.pop("spec", {}))
    return Engine(EngineConfig(model=str(model), dtype="float32", speculative=spec, **kw), log=False)


def schema_params(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 160)
    return SamplingParams(temperature=0, structured=StructuredOutput(json_schema=SCHEMA), **kw)


def check_schema_output(text: str) -> dict:
    data = json.loads(text)
    assert set(data) == set(SCHEMA["properties"])
    assert len(data["name"]) <= 6 and 0 <= data["n"] <= 99 and isinstance(data["ok"], bool)
    assert data["color"] in ("red", "green", "blue") and len(data["tags"]) <= 2
    return data


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return engine(tiny_model_dir, forced=False)


def test_schema_output_is_identical_across_speculation_modes_and_validates(tiny_model_dir, tiny_draft_dir, plain):
    prompts = [PROMPT, "Paris", [{"role": "user", "content": "Hello! How can I help you today?"}]]
    want = plain.generate(prompts, schema_params())
    for out in want:
        assert out.finish_reason == "stop"
        check_schema_output(out.text)
    modes = {
        "forced": engine(tiny_model_dir),
        "ngram": engine(tiny_model_dir, "ngram", forced=False),
        "ngram+forced": engine(tiny_model_dir, "ngram"),
        "draft+forced": engine(tiny_model_dir, "draft", k=3, spec={"draft_model": str(tiny_draft_dir)}),
    }
    for name, e in modes.items():
        got = e.generate(prompts, schema_params())
        assert [o.token_ids for o in got] == [o.token_ids for o in want], name
    forced = modes["forced"].generate(prompts, schema_params())
    assert all(o.stats.forced > 0 for o in forced)
    assert sum(o.stats.forced for o in want) == 0


def test_forced_drafts_take_fewer_rounds(tiny_model_dir, plain):
    with_forced = engine(tiny_model_dir).generate(PROMPT, schema_params())[0]
    without = plain.generate(PROMPT, schema_params())[0]
    assert with_forced.token_ids == without.token_ids
    assert with_forced.stats.rounds < without.stats.rounds
    assert with_forced.stats.accepted >= with_forced.stats.forced * 0.8


def test_forced_drafts_stop_where_the_completion_must_end(tiny_model_dir, plain):
    """A round emits its kept drafts and one token more, so forced drafts, like the proposer's, number at most the
    tokens left less one: a forced row past max_tokens would be verified and thrown away."""
    e = engine(tiny_model_dir)
    seen = []
    drafts = e.structured.drafts

    def recorded(seqs, ks, *args):
        out = drafts(seqs, ks, *args)
        seen.extend((len(d.tokens), d.num_forced, s.max_tokens - s.num_output_tokens) for s, d in zip(seqs, out))
        return out

    e.structured.drafts = recorded
    for max_tokens in (3, 7, 12):
        got = e.generate(PROMPT, schema_params(max_tokens=max_tokens))[0]
        assert got.token_ids == plain.generate(PROMPT, schema_params(max_tokens=max_tokens))[0].token_ids
    assert any(forced for _, forced, _ in seen)
    assert all(n <= left - 1 for n, _, left in seen), seen


def test_every_verified_row_is_masked_to_what_the_grammar_allows_after_the_drafts_before_it(plain):
    spec = StructuredOutput(json_schema=SCHEMA)
    seq = plain.prepare(PROMPT, SamplingParams(structured=spec))
    draft = plain.tokenizer.encode('{"name": "ab')
    assert seq.constraint.valid_prefix(draft) == len(draft)
    rows = torch.zeros(len(draft) + 1, plain.vocab_size)
    (masked,) = [r.logits for r in plain.structured.mask_rounds([Round(seq, Draft(draft), rows)])]
    probe = plain.structured.compiler.compile(spec)
    for i in range(len(draft) + 1):
        allowed = {t for t in range(plain.vocab_size) if probe.validate_tokens(draft[:i] + [t]) == i + 1}
        assert {t for t in range(plain.vocab_size) if masked[i, t] == 0} == allowed
        assert (masked[i] == float("-inf")).sum() == plain.vocab_size - len(allowed)
    assert seq.constraint.matcher.validate_tokens(draft) == len(draft)  # the matcher ends where it started


def test_seeded_constrained_sampling_is_unchanged_by_one_hot_drafts(tiny_model_dir, plain):
    params = [schema_params(seed=s) for s in range(2)]
    for p in params:
        p.temperature = 0.8
    want = [o.token_ids for o in plain.generate([PROMPT] * 2, params)]
    assert [o.token_ids for o in engine(tiny_model_dir, "ngram").generate([PROMPT] * 2, params)] == want


def _frequencies(e, n: int, structured) -> tuple[dict[str, float], list]:
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=s, structured=structured) for s in range(n)]
    # In waves whose prompts are prefilled in one step: a step that feeds a prompt drafts nothing.
    outs = [o for i in range(0, n, 200) for o in e.generate([PROMPT] * len(params[i : i + 200]), params[i : i + 200])]
    assert all(len(o.text) == 2 and set(o.text) <= set("abcd") for o in outs)
    counts: dict[str, float] = {}
    for o in outs:
        counts[o.text] = counts.get(o.text, 0) + 1 / n
    return counts, outs


def _assert_same_distribution(tiny_model_dir, drafting, n: int = 1000) -> None:
    """The frequencies of each allowed output over many seeds match those of plain constrained
    sampling (5 sigma), and drafts were really offered."""
    structured = StructuredOutput(regex="[a-d]{2}")
    got, outs = _frequencies(drafting, n, structured)
    want, _ = _frequencies(engine(tiny_model_dir, forced=False, max_num_seqs=256, max_num_batched_tokens=2048), n, structured)
    assert sum(o.stats.drafted - o.stats.forced for o in outs) >= n // 2
    for text in set(got) | set(want):
        p, q = want.get(text, 0.0), got.get(text, 0.0)
        sd = (2 * max(p, 1 / n) * (1 - p) / n) ** 0.5
        assert abs(p - q) <= 5 * sd + 2 / n, (text, p, q)


def test_constrained_sampling_with_a_draft_model_matches_constrained_sampling_without(tiny_model_dir, tiny_draft_dir, plain):
    """Rejection sampling against the masked target with the masked draft q."""
    spec = {"draft_model": str(tiny_draft_dir)}
    _assert_same_distribution(tiny_model_dir, engine(tiny_model_dir, "draft", k=3, spec=spec, max_num_seqs=256, max_num_batched_tokens=2048))


def test_constrained_sampling_with_a_draft_head_matches_constrained_sampling_without(tiny_model_dir, plain, tmp_path):
    """The same with an EAGLE head over a reduced draft vocabulary: its q is masked by the
    grammar too, so its drafts are valid and get verified (with its drafts only cut to the
    grammar, 7 of 1000 requests here kept any) while the outputs keep the distribution."""
    from specstream.spec_decode.draft_head import DraftHead, HeadConfig, save_head

    target = plain.model
    cfg = HeadConfig.for_target(target.config, 256)
    head = DraftHead(cfg, target.get_input_embeddings().weight)
    head.set_vocabulary(torch.arange(256))
    head.init_from_target(target.model.norm.weight, target.lm_head.weight)
    head_dir = save_head(head, tmp_path / "head")
    spec = {"draft_model": str(head_dir)}
    _assert_same_distribution(tiny_model_dir, engine(tiny_model_dir, "eagle", k=3, spec=spec, max_num_seqs=256, max_num_batched_tokens=2048))


def test_grammar_completion_finishes_with_stop_and_choice_holds(plain):
    out = plain.generate(PROMPT, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, structured=StructuredOutput(choice=["yes", "no way"])))[0]
    assert out.text in ("yes", "no way") and out.finish_reason == "stop"


def assert_only_bad_failed(plain, error: str) -> None:
    """Run the engine dry: request "bad" ended with an error naming `error`, request "good"
    finished valid, and every KV block came back."""
    chunks = []
    while plain.has_unfinished():
        chunks += plain.step()
    last = {c.request_id: c for c in chunks if c.finished}
    assert last["bad"].finish_reason == "error" and error in last["bad"].error
    assert last["good"].finish_reason == "stop"
    check_schema_output("".join(c.text for c in chunks if c.request_id == "good"))
    assert plain.pool.num_free_blocks == plain.pool.num_blocks


def test_a_matcher_refusing_a_committed_token_fails_only_its_request(plain):
    bad = plain.prepare(PROMPT, schema_params(), request_id="bad")
    # A token the grammar cannot take puts the matcher in its error state, as a grammar bug
    # would: from then on it refuses everything (its mask allows only EOS, which it refuses too).
    assert not bad.constraint.matcher.consume_token(plain.tokenizer.encode("x")[0])
    plain.submit(bad)
    plain.add_request(PROMPT, schema_params(), request_id="good")
    assert_only_bad_failed(plain, "GrammarViolation")


@pytest.mark.parametrize(
    "spec, words",
    [
        (StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
        (StructuredOutput(json_schema={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (StructuredOutput(regex="[a-"), "regex"),
        (StructuredOutput(grammar="start: missing_rule"), "missing_rule"),
    ],
)
def test_bad_or_unsupported_grammars_are_refused_before_admission(plain, spec, words):
    with pytest.raises(InvalidRequestError, match=words) as info:
        plain.add_request(PROMPT, SamplingParams(structured=spec))
    assert info.value.param == "structured"
    assert not plain.has_unfinished()


@pytest.mark.parametrize(
    "kw",
    [{}, {"json_object": True, "regex": "a"}, {"json_schema": "not a dict"}, {"choice": []}, {"choice": ["a", ""]}, {"json_object": 1}],
)
def test_structured_output_needs_exactly_one_well_typed_kind(kw):
    with pytest.raises(InvalidRequestError):
        StructuredOutput(**kw)


def test_logit_bias_steers_greedy_decoding_and_is_bounded(plain):
    base = plain.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    pushed = plain.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={"42": 100}))[0]
    assert pushed.token_ids == [42] * 6
    banned = plain.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={base[0]: -100}))[0]
    assert banned.token_ids[0] != base[0]
    for bad in ({"1": 101}, {"x": 1}, {"-1": 1}, {str(i): 1 for i in range(301)}, {"1": True}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(logit_bias=bad)
    with pytest.raises(InvalidRequestError, match="below"):
        plain.add_request(PROMPT, SamplingParams(logit_bias={plain.vocab_size: 1}))


def test_forced_drafts_stay_out_of_the_k_policy_history():
    assert proposer_share(num_drafted=6, num_accepted=5, num_forced=4) == (2, 1)
    assert proposer_share(num_drafted=6, num_accepted=2, num_forced=4) == (0, 0)
    assert proposer_share(num_drafted=3, num_accepted=3, num_forced=0) == (3, 3)


def test_draft_model_logits_are_masked_like_the_targets(plain):
    seq = plain.prepare(PROMPT, SamplingParams(structured=StructuredOutput(choice=["yes", "no"])))
    logits = torch.zeros(1, plain.vocab_size)
    masked = plain.structured.mask_draft_logits(logits, [seq], [[]])
    allowed = torch.isfinite(masked[0]).nonzero().flatten().tolist()
    assert allowed and all(plain.tokenizer.decode([t]) in ("y", "ye", "yes", "n", "no") for t in allowed)
    other = Sequence("x", [1, 2], SamplingParams(), 0)
    assert torch.equal(plain.structured.mask_draft_logits(logits, [other], [[]]), logits)


def test_a_mask_that_raises_fails_only_its_request(plain, monkeypatch):
    bad = plain.prepare(PROMPT, schema_params(), request_id="bad")
    plain.submit(bad)
    plain.add_request(PROMPT, schema_params(), request_id="good")
    masks = plain.structured._masks

    def failing(items):
        if any(matcher is bad.constraint.matcher for matcher, _ in items):
            raise RuntimeError("mask failed")
        return masks(items)

    monkeypatch.setattr(plain.structured, "_masks", failing)
    assert_only_bad_failed(plain, "RuntimeError")
