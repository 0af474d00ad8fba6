"""Predicted outputs (SamplingParams.prediction, OpenAI's `prediction`): the prediction's tokens are drafted where the
output follows it, found again after an edit, counted in usage, and never change the output."""

import pytest

from specstream import Engine, EngineConfig, InvalidRequestError, SamplingParams, SpeculativeConfig
from specstream.calibration import CostModel
from specstream.spec_decode.policy import DraftingSurcharge
from specstream.spec_decode.prediction import ALIGN, FLOOR, NEAR, PRIOR, Prediction

PROMPT = "def add(a, b):\n    return a + b\n\ndef add("


class FixedCost(CostModel):
    def observe(self, n: int, seconds: float) -> None:
        pass


class NoSurcharge(DraftingSurcharge):
    def __call__(self, num_seqs: int) -> float:
        return 0.0


def engine(model, method="ngram", k=8, adaptive=False):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, adaptive=adaptive)
    return Engine(EngineConfig(model=str(model), dtype="float32", speculative=spec), log=False)


def params(prediction=None, **kw):
    kw = {"max_tokens": 48, "temperature": 0, "ignore_eos": True} | kw
    return SamplingParams(prediction=prediction, **kw)


SAMPLED = {"temperature": 1.0, "seed": 3}  # seeded: the same tokens with and without drafts, and no long repeats


@pytest.fixture(scope="module")
def plain_ids(tiny_model_dir):
    return engine(tiny_model_dir, "off").generate(PROMPT, params())[0].token_ids


@pytest.fixture(scope="module")
def sampled_ids(tiny_model_dir):
    ids = engine(tiny_model_dir, "off").generate(PROMPT, params(**SAMPLED))[0].token_ids
    assert len(set(ids)) > 40  # the tiny model's greedy answer repeats a token; this one does not
    return ids


# ------------------------------------------------------------------ the place in the prediction


def test_the_place_moves_with_the_output_is_lost_at_an_edit_and_found_again():
    p = Prediction([10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
    assert p.draft(3) == [10, 11, 12]
    p.follow([10, 11, 99])  # two drafts kept, the third replaced
    assert p.position is None and p.draft(4) == []  # 99 is nowhere in the prediction
    p.follow([10, 11, 99, 13])
    assert p.position is None  # one token is not enough to find the place
    p.follow([10, 11, 99, 13, 14])  # the output goes on as the prediction did, just after where it left it
    assert p.position == 5 and p.draft(2) == [15, 16]
    assert p.edits == {11: [((12,), (99,))]}  # 12 became 99 after 11
    p.follow([10, 11, 99, 13, 14, 15, 16, 17])  # both kept and the round's own token followed too
    assert p.position == 8
    p.follow([10, 11, 99, 13, 14, 15, 16, 17, 18, 19])
    assert p.available() == 0 and p.draft(4) == []  # spent


def test_the_agreement_follows_the_last_tokens_and_below_the_floor_the_prediction_drafts_nothing():
    p = Prediction(list(range(100, 160)))
    assert p.acceptance() == PRIOR and p.usable()
    p.follow(list(range(100, 120)))
    assert p.acceptance() > 0.95
    output = list(range(100, 120)) + [7, 8, 9, 7, 8, 9, 7, 8]  # the output goes its own way
    p.follow(output)
    assert p.position is None and p.acceptance() < FLOOR and not p.usable()
    output += list(range(122, 124))  # back on the prediction, two tokens on: found, but not trusted yet
    p.follow(output)
    assert p.position == 124 - 100 and not p.usable() and p.draft(0) == []
    output += list(range(124, 132))
    p.follow(output)
    assert p.usable()  # followed again lately


def test_an_edit_the_output_made_is_replayed_where_the_same_token_comes_again_and_forgotten_when_refused():
    # a rename: the output puts 77 after each 50 (say "text" becoming "text_in")
    p = Prediction([1, 50, 2, 3, 50, 4, 5, 50, 6, 7, 8])
    p.follow([1, 50, 77, 2])
    assert p.position is None
    p.follow([1, 50, 77, 2, 3])  # back on the prediction: the edit (nothing removed, 77 inserted after 50) is learned
    assert p.position == 4 and p.edits == {50: [((), (77,))]}
    assert p.draft(8) == [50, 77, 4, 5, 50, 77, 6, 7]
    p.follow([1, 50, 77, 2, 3, 50, 77, 4, 5, 50, 77, 6, 7, 8])  # all kept, and the round's own token
    assert p.position == 11 and p.available() == 0
    # refused: the output keeps the prediction's token after 50 this time
    q = Prediction([1, 50, 2, 3, 50, 4, 5])
    q.follow([1, 50, 77, 2, 3])
    assert q.draft(4) == [50, 77, 4, 5]
    q.follow([1, 50, 77, 2, 3, 50, 4])  # 77 refused: 4 came instead, as the prediction had it
    assert q.edits == {50: []} and q.position == 6 and q.draft(2) == [5]


def test_far_from_where_the_output_left_it_the_place_needs_align_tokens():
    tokens = list(range(100, 100 + 3 * NEAR))
    p = Prediction(tokens)
    p.follow([100, 101])
    assert p.left == 2
    far = tokens[2 * NEAR : 2 * NEAR + ALIGN]  # a deletion: the output skips more than NEAR tokens
    p.follow([100, 101] + far[:1])
    assert p.position is None
    p.follow([100, 101] + far)
    assert p.position == 2 * NEAR + ALIGN and p.draft(1) == [tokens[2 * NEAR + ALIGN]]


def test_a_lost_place_is_found_after_where_the_output_left_the_prediction():
    # the same three tokens twice: the place is the occurrence after the output's last, not the first
    p = Prediction([1, 2, 3, 50, 51, 1, 2, 3, 60, 61])
    p.follow([1, 2, 3, 50, 51])
    assert p.left == 5
    p.follow([1, 2, 3, 50, 51, 7, 1, 2, 3])  # (near: its last 2 tokens first occur after where the output left it)
    assert p.position == 8 and p.draft(2) == [60, 61]
    # with no occurrence at or after it, the latest one before
    q = Prediction([1, 2, 3] + list(range(200, 200 + NEAR)))
    q.follow(q.tokens)
    q.follow(q.tokens + [9, 1, 2, 3])
    assert q.position == 3


def test_a_short_output_waits_for_align_tokens_before_searching():
    p = Prediction([5, 6, 7, 8])
    p.follow([9])
    assert p.position is None and ALIGN > 1


# ------------------------------------------------------------------ through the engine


def test_a_prediction_equal_to_the_answer_is_drafted_and_kept(tiny_model_dir, plain_ids):
    e = engine(tiny_model_dir)
    out = e.generate(PROMPT, params(plain_ids))[0]
    assert out.token_ids == plain_ids
    assert out.stats.prediction_drafted > 0
    assert out.stats.prediction_accepted == out.stats.prediction_drafted
    assert out.stats.rounds <= len(plain_ids) // 8 + 1  # k=8 drafts a round, all kept
    rounds = e.metrics.registry.get_sample_value("specstream_spec_decode_rounds_total", {"method": "prediction"})
    assert rounds and rounds >= out.stats.rounds - 1  # /metrics names the method (the prompt's round drafts nothing)


@pytest.mark.parametrize("adaptive", [False, True])
def test_an_edited_prediction_is_followed_after_the_edit_and_the_output_is_the_models(
    tiny_model_dir, sampled_ids, adaptive
):
    edited = sampled_ids[:10] + [(t + 1) % 300 for t in sampled_ids[10:13]] + sampled_ids[13:]
    e = engine(tiny_model_dir, adaptive=adaptive)
    if adaptive:  # priced at a fixed curve: the tiny model's measured steps are mostly host noise
        e.policy.target_cost, e.policy.surcharge = FixedCost([1, 16], [0.010, 0.012]), NoSurcharge()
    out = e.generate(PROMPT, params(edited, **SAMPLED))[0]
    assert out.token_ids == sampled_ids
    accepted, rejected = out.stats.prediction_usage
    assert rejected > 0  # the edited tokens were drafted and refused
    assert accepted >= 10 + 20  # the place was found again 3 tokens past the edit, and followed


def test_a_prediction_does_not_change_seeded_sampling(tiny_model_dir, sampled_ids):
    e = engine(tiny_model_dir)
    out = e.generate(PROMPT, params(sampled_ids, **SAMPLED))[0]
    assert out.token_ids == sampled_ids and out.stats.prediction_accepted > 0
    wrong = e.generate(PROMPT, params(sampled_ids[:1] + [(t + 5) % 300 for t in sampled_ids[1:]], **SAMPLED))[0]
    assert wrong.token_ids == sampled_ids and wrong.stats.prediction_drafted > 0


def test_without_speculation_a_prediction_is_accepted_and_not_used(tiny_model_dir, plain_ids):
    off = engine(tiny_model_dir, "off").generate(PROMPT, params(plain_ids))[0]
    capped = engine(tiny_model_dir).generate(PROMPT, params(plain_ids, num_speculative_tokens=0))[0]
    for out in (off, capped):
        assert out.token_ids == plain_ids and out.stats.drafted == 0 and out.stats.prediction_usage == (0, 0)


def test_usage_counts_the_predictions_accepted_and_rejected_tokens(tiny_model_dir, sampled_ids):
    e = engine(tiny_model_dir)
    e.add_request(PROMPT, params(sampled_ids[:20] + [(t + 1) % 300 for t in sampled_ids[20:]], **SAMPLED), request_id="r")
    usage = None
    while e.has_unfinished():
        for chunk in e.step():
            usage = chunk.usage or usage
    # the first token is the prompt's, each round's last the target's own: 17 of the first 20 were drafts
    assert 16 <= usage.accepted_prediction_tokens < 20 and usage.rejected_prediction_tokens > 0


def test_a_text_prediction_is_tokenized_without_special_tokens(tiny_model_dir):
    e = engine(tiny_model_dir)
    seq = e.prepare(PROMPT, params("    return a + b"))
    assert seq.prediction.tokens == e.processor.tokenizer.encode("    return a + b", add_special_tokens=False)


@pytest.mark.parametrize(
    "prediction, message",
    [
        ([1, "2"], "string or a list of token ids"),
        ([1, True], "string or a list of token ids"),
        ({"type": "content"}, "string or a list of token ids"),
        ([10**9], "must be in [0,"),
        ("x" * 10**7, "more than"),
        ("\ud800", "lone surrogate"),
    ],
)
def test_bad_predictions_are_refused(tiny_model_dir, prediction, message):
    e = engine(tiny_model_dir)
    with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[")) as err:
        e.prepare(PROMPT, params(prediction))
    assert err.value.param == "prediction"
    assert e.generate(PROMPT, params())[0].token_ids  # the engine goes on


def test_a_prediction_longer_than_the_context_is_refused(tiny_model_dir):
    e = engine(tiny_model_dir)
    with pytest.raises(InvalidRequestError, match="context"):
        e.prepare(PROMPT, params([1] * (e.max_model_len + 1)))
