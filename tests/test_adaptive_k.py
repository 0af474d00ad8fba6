"""The k policy and its cost model."""

import pytest
import torch

from specstream.calibration import CostModel
from specstream.sequence import Acceptance
from specstream.spec_decode.policy import KPolicy, SharedAcceptance, acceptance_estimate, record_round, sampling_bucket
from specstream.sampling import SamplingParams
from specstream.sequence import Sequence


def seqs(n, accepted=0.0, rejected=0.0):
    out = []
    for i in range(n):
        s = Sequence(str(i), [1, 2, 3], SamplingParams(), i)
        s.acceptance = Acceptance(accepted, rejected)
        out.append(s)
    return out


def test_cost_model_interpolates_and_is_monotone():
    cm = CostModel([1, 8, 32], [0.05, 0.04, 0.08])
    assert cm.seconds == [0.05, 0.05, 0.08]
    assert abs(cm(20) - 0.065) < 1e-9 and cm(64) > cm(32)


def test_a_busy_spell_while_timing_does_not_price_one_step_size_high(monkeypatch):
    """Each repeat sweeps every size: a spell as long as three timings (here: 40x slower) slows at most one
    repeat of each size it spans, and the fastest repeat of every size is still a quiet one."""
    calls: list[int] = []
    clock = [0.0]

    def run(n: int) -> None:
        calls.append(n)
        clock[0] += 0.010 + 0.001 * n + (0.4 if 3 <= len(calls) <= 5 else 0.0)

    monkeypatch.setattr("specstream.calibration.time.perf_counter", lambda: clock[0])
    cost = CostModel.measure(run, [1, 2, 4], repeats=3)
    assert calls == [4] + [4, 2, 1] * 3  # a warm-up, then whole sweeps, largest first
    assert cost.seconds == pytest.approx([0.011, 0.012, 0.014])


def test_each_size_is_timed_after_one_of_about_its_size(monkeypatch):
    """A small step right after a much larger one runs slow (the caches hold the larger step's data): timed
    smallest first, the one-token step would follow the largest and be priced high, and each draft row low. The
    sweep runs largest first, so every size follows the next larger one and is timed as a steady run has it."""
    calls: list[int] = []
    clock = [0.0]

    def run(n: int) -> None:
        after_larger = bool(calls) and calls[-1] > 2 * n
        calls.append(n)
        clock[0] += 0.010 + 0.001 * n + (0.004 if after_larger else 0.0)

    monkeypatch.setattr("specstream.calibration.time.perf_counter", lambda: clock[0])
    cost = CostModel.measure(run, [1, 2, 4, 8], repeats=2)  # sizes at most twice apart, as calibration.plan's
    assert cost.seconds == pytest.approx([0.011, 0.012, 0.014, 0.018])


def test_steps_are_timed_as_verifications_with_every_rows_logits(tiny_model_dir):
    """A draft's row costs its pass through the layers and through the LM head: the curve's steps keep every
    row's logits, as a verification does (timed with one row's logits, as a prefill chunk keeps, 16 rows of
    the bundled model were priced at 2.5x a one-row step where verifying them cost 3.4x)."""
    from specstream import Engine, EngineConfig, calibration

    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32"), log=False)
    forward, fed = engine.runner.forward, []
    engine.runner.forward = lambda items, *a: fed.extend((len(i.tokens), i.num_logits) for i in items) or forward(items, *a)
    assert calibration.time_steps(engine.runner, [1, 2, 8], 16, repeats=1) is not None
    assert fed[0] == (16, 1)  # the context, a prefill
    assert fed[1:] == [(8, 8), (8, 8), (2, 2), (1, 1)]  # a warm-up, then each size with all its logits


def test_a_suspect_curve_keeps_each_sizes_faster_time():
    cost = CostModel([1, 2, 4, 8, 16], [0.010, 0.016, 0.017, 0.020, 0.030])
    assert cost.suspect()  # two tokens at 1.6x one: a fresh sequence's first draft never pays
    assert cost.refine(CostModel([1, 2, 4, 8], [0.011, 0.0112, 0.012, 0.021]))
    assert cost.seconds == pytest.approx([0.010, 0.0112, 0.012, 0.020, 0.030]) and not cost.suspect()
    assert not cost.refine(CostModel([1, 2], [0.012, 0.011]))  # nothing faster: nothing moves


def test_an_idle_engine_times_a_suspect_curves_small_sizes_again(tiny_model_dir, monkeypatch):
    """A curve that priced a second token at 3x a one-token step (a busy spell while it was timed) stops
    every first draft, so the steps that would correct it online never run. An idle engine times the
    curve's small sizes again and keeps each size's faster time; then not again for a while."""
    from specstream import Engine, EngineConfig, SpeculativeConfig, calibration

    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", speculative=SpeculativeConfig(method="ngram")), log=False)
    cost = engine.policy.target_cost
    two = cost.tokens.index(2)

    def spoil() -> None:
        cost.seconds[two] = 3 * cost.seconds[0]
        cost.seconds[two:] = [max(x, cost.seconds[two]) for x in cost.seconds[two:]]

    spoil()
    assert cost.suspect() and engine.policy.choose(seqs(1), 1, 8) == [0]
    timed: list[list[int]] = []
    time_steps, one = calibration.time_steps, cost.seconds[0]

    def quiet(runner, sizes, *a, **kw):
        # The sizes are timed on the engine's own runner, but what they measure on a shared test machine is
        # noise (a tiny model's two-token step has timed at 1.8x one); the curve handed back is what an
        # idle machine measures, so the test asserts what is kept of it, not this machine's timing.
        timed.append(sizes)
        assert time_steps(runner, sizes, *a, **kw) is not None
        return CostModel(sizes, [one * (1 + 0.05 * (n - 1)) for n in sizes])

    monkeypatch.setattr(calibration, "time_steps", quiet)
    engine.idle()
    assert timed == [[n for n in cost.tokens if n <= calibration.REFINE_UPTO]]
    assert cost.timed(2) == pytest.approx(1.05 * one) and not cost.suspect()
    assert engine.policy.choose(seqs(1), 1, 8)[0] > 0
    spoil()
    engine.idle()  # within REFINE_EVERY of the last: not timed again
    assert len(timed) == 1


def test_each_sequence_let_draft_is_charged_its_proposers_lookup_time():
    """A first draft accepted half the time pays for a 2 ms row on a 10 ms step, not for the row and 4 ms of
    lookups; a proposer learns its lookup time per drafting sequence from its own rounds."""
    from specstream.spec_decode.ngram import NgramProposer

    cost = CostModel([1, 2, 16], [0.010, 0.012, 0.040])
    assert KPolicy(4, True, cost, lambda n: 0.0).choose(seqs(1), 1, 8)[0] > 0
    assert KPolicy(4, True, cost, lambda n: 0.0, lambda: 0.004).choose(seqs(1), 1, 8) == [0]
    ngram = NgramProposer(1, 4)
    seq = Sequence("a", list(range(50)) * 4, SamplingParams(), 0)
    assert ngram.lookup_cost() == 0.0
    ngram.propose([seq, seq], [4, 0])
    assert 0 < ngram.lookup_cost() < 0.01


def test_a_proposers_hint_grants_a_long_copy_its_length_and_no_more():
    """A sequence whose record says 0.3 drafts a token or two; where its proposer holds a draft it expects
    accepted at 0.85 (auto: a long n-gram match), the k policy grants it that draft's length, not past it;
    a hint below the record changes nothing; a hint is not asked where the cap is 0."""
    from specstream.spec_decode.auto import LONG_MATCH, AutoProposer
    from specstream.spec_decode.ngram import NgramProposer

    cost = CostModel([1, 2, 9, 17], [0.010, 0.0105, 0.013, 0.020])
    record = dict(accepted=3.0, rejected=7.0)
    plain = KPolicy(16, True, cost, lambda n: 0.0).choose(seqs(1, **record), 1, 32)[0]
    assert plain <= 2
    asked = []
    hinted = KPolicy(16, True, cost, lambda n: 0.0, draft_hint=lambda s: asked.append(s) or (0.85, 6))
    assert hinted.choose(seqs(1, **record), 1, 32) == [6]
    low = KPolicy(16, True, cost, lambda n: 0.0, draft_hint=lambda s: (0.1, 6))
    assert low.choose(seqs(1, **record), 1, 32)[0] == plain
    capped = seqs(1, **record)[0]
    capped.params = SamplingParams(num_speculative_tokens=0)
    asked.clear()
    assert hinted.choose([capped], 1, 32) == [0] and not asked

    # auto's hint: a greedy request's match of LONG_MATCH tokens or more, at what such matches were accepted
    # lately, up to the match's length; the step's propose drafts the same match. None for a sampled request.
    auto = AutoProposer(None, NgramProposer(1, 4), k_max=16)
    text = list(range(100, 130))
    greedy = SamplingParams(temperature=0.0)
    copying = Sequence("c", text + [7] + text[:LONG_MATCH], greedy, 0)
    a, length = auto.draft_hint(copying)
    assert length == 16 and a >= 0.5
    short = Sequence("s", text + [7] + [999, text[0]], greedy, 0)  # a one-token match
    assert auto.draft_hint(short) is None
    looked, match = [], auto.ngram.match  # the hint keeps its matches as a sequence grows: no whole lookup a step
    auto.ngram.match = lambda tokens, k: looked.append(k) or match(tokens, k)
    short.token_ids.append(text[1])
    assert auto.draft_hint(short) is None and auto.draft_hint(copying)[1] == 16 and not looked
    auto.ngram.match = match
    assert auto.draft_hint(Sequence("t", copying.token_ids, SamplingParams(temperature=0.7), 0)) is None
    auto.shared.record("ngram3", sampling_bucket(copying.params), 1.0, 30.0)  # matches of 3 were lately rejected: the hint says so
    assert auto.draft_hint(copying)[0] < 0.2
    (draft,) = auto.propose([copying], [5])
    assert draft.tokens == text[LONG_MATCH : LONG_MATCH + 5] and draft.method == "ngram"


def test_free_verification_and_good_acceptance_drafts_long():
    policy = KPolicy(8, True, CostModel([1, 64], [0.05, 0.0501]), lambda n: 0.0)
    assert policy.choose(seqs(1, accepted=20.0), base_tokens=1, budget=100) == [8]


def test_expensive_verification_or_poor_acceptance_drafts_nothing():
    steep = KPolicy(8, True, CostModel([1, 64], [0.05, 3.2]), lambda n: 0.0)
    assert steep.choose(seqs(2, accepted=5.0, rejected=1.0), base_tokens=2, budget=100) == [0, 0]
    # Like this project's CPU: verifying 9 tokens costs ~20% more than decoding 1.
    cpu = KPolicy(8, True, CostModel([1, 9], [0.05, 0.06]), lambda n: 0.0)
    poor = seqs(1, rejected=30.0)
    assert acceptance_estimate(poor[0]) < 0.05
    assert cpu.choose(poor, base_tokens=1, budget=100) == [0]


def test_bigger_batches_get_shorter_drafts_on_a_saturating_device():
    # Cost grows linearly past 8 tokens: a batch of 16 pays for every draft token.
    policy = KPolicy(8, True, CostModel([1, 8, 256], [0.05, 0.05, 1.6]), lambda n: 0.0)
    one = policy.choose(seqs(1, accepted=3.0, rejected=1.0), base_tokens=1, budget=500)
    many = policy.choose(seqs(16, accepted=3.0, rejected=1.0), base_tokens=16, budget=500)
    assert one[0] >= 4 and max(many) < one[0]


def test_a_prefill_chunk_beside_the_decoders_does_not_make_a_poor_draft_pay():
    """Drafts beside a prompt's chunk cost what they add to that step, and must beat the decoding rows' own rate
    (8 tokens per 13 ms here), not the whole step's (8 tokens per 0.3 s, which a draft of any acceptance beats)."""
    from specstream.spec_decode.policy import ChainJudge, StepBase

    curve = CostModel([1, 8, 32, 288], [0.010, 0.013, 0.030, 0.300])  # about 1 ms a row past 32: bound by arithmetic
    policy = KPolicy(8, True, curve, lambda n: 0.0)
    poor, good = seqs(8, accepted=3.0, rejected=7.0), seqs(8, accepted=40.0, rejected=1.0)
    assert policy.choose(poor, base_tokens=8 + 256, budget=500) == [0] * 8
    assert policy.choose(poor, base_tokens=8, budget=500) == [0] * 8  # as in a step of the decoders alone
    assert sum(policy.choose(good, base_tokens=8 + 256, budget=500)) > 0  # a draft kept 9 times in 10 still pays
    judge = ChainJudge(curve, None, 8, StepBase(8 + 256, 8.0, 256))
    assert not judge.worth(0.3) and judge.worth(0.95)


def test_acceptance_history_fades_toward_the_prior_when_idle():
    s = seqs(1, rejected=10.0)[0]
    low = acceptance_estimate(s)
    for _ in range(100):
        record_round(s, 0, 0)
    assert acceptance_estimate(s) > low + 0.2


def test_request_cap_limits_k():
    s = seqs(1, accepted=50.0)[0]
    s.params = SamplingParams(num_speculative_tokens=2)
    policy = KPolicy(8, True, CostModel([1, 64], [0.05, 0.0501]), lambda n: 0.0)
    assert policy.choose([s], base_tokens=1, budget=100) == [2]


def test_cost_model_round_trips_and_a_bad_file_reads_as_none(tmp_path):
    cost = CostModel([1, 8, 64], [0.02, 0.022, 0.05])
    cost.save(tmp_path / "c.json")
    back = CostModel.load(tmp_path / "c.json")
    assert back is not None and back.tokens == cost.tokens and back.seconds == cost.seconds
    for text in ("", "{", '{"tokens": [1], "seconds": []}', '{"tokens": [1], "seconds": [0]}', '{"tokens": [8, 1], "seconds": [1, 2]}'):
        (tmp_path / "bad.json").write_text(text)
        assert CostModel.load(tmp_path / "bad.json") is None
    assert CostModel.load(tmp_path / "missing.json") is None


def test_a_second_start_of_a_cached_model_reads_its_calibration(default_model_source, monkeypatch):
    """The bundled model lives in specstream's content-keyed cache, so the forward-time curve
    measured by one start is read by the next instead of measured again (the second start of a
    GGUF model is about 3.5 s faster for Gemma 3 270M)."""
    from specstream import Engine, EngineConfig, calibration
    from specstream.kernels import routes

    first = Engine(EngineConfig(dtype="float32"), log=False)
    path = first.calibration_file
    assert path is not None and CostModel.load(path) is not None
    del first

    def measure(*args, **kwargs):
        raise AssertionError("measured again")

    time_steps = calibration.time_steps

    def probe_only(runner, sizes, context, repeats=3):
        if sizes != [1]:
            measure()
        return time_steps(runner, sizes, context, repeats)

    # The target's forward is not timed again, only probed with a one-token step (the draft head's
    # step is: its timing is not kept).
    monkeypatch.setattr(calibration, "time_steps", probe_only)
    monkeypatch.setattr(routes, "_faster_packed", measure)  # the kernel routes are read back too
    # The probe is checked against the curve (next test); here any timing agrees with it.
    monkeypatch.setattr(calibration, "TOLERANCE", 1e9)
    second = Engine(EngineConfig(dtype="float32"), log=False)
    assert second.calibration_file == path
    assert second.policy.target_cost.tokens == CostModel.load(path).tokens
    del second
    # Another build of specstream's kernels (a changed source, compiler or CPU) is timed again: the
    # routes and the curve an earlier build measured do not speak for it.
    from specstream.kernels import cpu as cpu_kernels

    if cpu_kernels.loaded():
        timed = []
        monkeypatch.setattr(cpu_kernels, "build_key", lambda: "another build")
        monkeypatch.setattr(routes, "_faster_packed", lambda *args, **kwargs: timed.append(args) or True)
        monkeypatch.setattr(calibration, "time_steps", time_steps)
        third = Engine(EngineConfig(dtype="float32"), log=False)
        assert third.calibration_file != path and timed
        del third
    # A model outside the cache (a plain directory) is measured each time: nothing names its weights.
    outside = type(default_model_source)("x", "/nonexistent")
    assert calibration.cache_file("forward", outside, torch.float32, torch.device("cpu"), ["dense"]) is None


def test_a_cached_calibration_that_no_longer_fits_is_measured_again(default_model_source):
    """A curve kept by an earlier start that a one-token step timed now contradicts (measured while
    the machine was busy, or before a kernel changed) is measured and kept again."""
    from specstream import Engine, EngineConfig

    first = Engine(EngineConfig(dtype="float32"), log=False)
    path = first.calibration_file
    kept = CostModel.load(path)
    del first
    CostModel(kept.tokens, [s * 4 for s in kept.seconds]).save(path)  # four times too slow
    second = Engine(EngineConfig(dtype="float32"), log=False)
    again = CostModel.load(path)
    assert again.seconds[0] < 3 * kept.seconds[0], (kept.seconds[0], again.seconds[0])  # kept at 4x: measured again
    assert second.policy.target_cost.seconds == again.seconds


def test_a_server_scales_a_contradicted_calibration_and_measures_it_again_once_idle(default_model_source):
    """A server (compile_in_background) starts serving on a kept curve that a step timed now contradicts,
    scaled to that step, and measures the curve again at its first idle moment (Engine.idle)."""
    from specstream import Engine, EngineConfig

    config = EngineConfig(dtype="float32", compile=False, compile_in_background=True)
    first = Engine(config, log=False)
    path = first.calibration_file
    kept = CostModel.load(path)
    del first
    CostModel(kept.tokens, [s * 4 for s in kept.seconds]).save(path)  # four times too slow
    second = Engine(config, log=False)
    scaled = second.policy.target_cost
    assert scaled.stale and not second.priced and CostModel.load(path).seconds[0] == 4 * kept.seconds[0]
    second.idle()
    again = CostModel.load(path)
    assert second.priced and not second.policy.target_cost.stale and second.policy.target_cost.seconds == again.seconds
    assert again.seconds[0] < 3 * kept.seconds[0], (kept.seconds[0], again.seconds[0])  # kept at 4x: measured again


def test_a_timing_kept_on_another_cpu_is_never_read(default_model_source, monkeypatch, tmp_path):
    """Kept timings are named by the processor (and threads, torch, dtype, weights): a cache volume moved
    to another CPU has none for it, so that CPU measures its own."""
    import torch

    from specstream import calibration

    converted = calibration.converted_source(default_model_source)
    here = calibration.cache_file("forward", converted, torch.bfloat16, torch.device("cpu"), ["dense"])
    monkeypatch.setattr(calibration, "processor_name", lambda device: "Another CPU @ 2.0GHz")
    there = calibration.cache_file("forward", converted, torch.bfloat16, torch.device("cpu"), ["dense"])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    more_threads = calibration.cache_file("forward", converted, torch.bfloat16, torch.device("cpu"), ["dense"])
    assert here is not None and len({here, there, more_threads}) == 3 and here.parent == there.parent


def test_new_sequences_start_from_what_drafts_like_theirs_were_accepted_lately():
    """At a high temperature drafts are accepted far less often than the fixed prior says: once other
    requests' rounds showed it, a new request there starts from their record and drafts nothing on a CPU-like
    curve, while a new greedy request still starts from the fixed prior and drafts."""
    policy = KPolicy(8, True, CostModel([1, 9], [0.05, 0.08]), lambda n: 0.0)
    hot, cold = SamplingParams(temperature=1.0), SamplingParams(temperature=0)
    assert sampling_bucket(hot) == "T1" and sampling_bucket(cold) == "greedy"
    assert sampling_bucket(SamplingParams(temperature=0.7)) == sampling_bucket(SamplingParams(temperature=0.8)) == "T0.75"
    fresh = lambda params: Sequence("new", [1, 2, 3], params, 0)  # noqa: E731
    assert policy.choose([fresh(hot)], 1, 100)[0] > 0  # nothing recorded yet: the fixed prior
    for i in range(60):
        policy.record(Sequence(str(i), [1, 2, 3], hot, i), 4, 0)  # every draft rejected at once
    assert policy.estimate(fresh(hot)) < 0.1
    assert policy.choose([fresh(hot)], 1, 100) == [0]
    assert policy.choose([fresh(cold)], 1, 100)[0] > 0


def test_the_shared_record_fades_back_to_the_fixed_prior_as_rounds_pass():
    """A kind of draft found poor is tried again later: its shared record fades with every round recorded."""
    shared = SharedAcceptance(weight=4.0, decay=0.99)
    for _ in range(50):
        shared.record("ngram", "T1", 0.0, 1.0)
    assert shared.prior("ngram", "T1", 0.5) < 0.1
    assert shared.prior("ngram", "greedy", 0.5) == 0.5 and shared.prior("head", "T1", 0.6) == 0.6
    for _ in range(1000):
        shared.tick()
    assert shared.prior("ngram", "T1", 0.5) > 0.45


def test_the_forward_curve_is_timed_on_both_sides_of_each_jump_in_a_steps_cost():
    """A step's cost jumps past each 16 rows (the AMX tiles) and past the compiled steps' limit: timed at 32 and 48
    alone, the curve priced a 33rd row on a step of 32 streams like the 32nd, where it costs a tile's work. The
    curve is timed on both sides of each, up to 64 rows, and of the compiled limit where steps are compiled;
    nothing past the budget."""
    from types import SimpleNamespace

    from specstream import calibration

    sizes, _ = calibration.plan(512, 100_000, compiled=24)
    assert {16, 17, 24, 25, 32, 33, 48, 49, 64, 65, 96, 128} <= set(sizes) and sizes == sorted(sizes)
    assert 25 not in calibration.plan(512, 100_000)[0] and 81 not in sizes  # no compiled steps; tiles up to 64 only
    assert calibration.plan(16, 100_000, compiled=24)[0][-1] == 16  # the budget stops at 16: nothing past it
    eager = SimpleNamespace(fast=SimpleNamespace(compiled_rows=24, steps=None))
    compiled = SimpleNamespace(fast=SimpleNamespace(compiled_rows=24, steps=object()))
    assert calibration.compiled_rows(eager) == 0 and calibration.compiled_rows(compiled) == 24
    assert calibration.compiled_rows(SimpleNamespace(fast=None)) == 0  # a model on transformers' modules


def test_steps_past_one_sequences_compiled_run_are_timed_as_several_sequences_short_runs(tiny_model_dir):
    """Steps of more than 16 rows are batches of streams, compiled up to their limit: timed as one sequence's
    long run, they ran eager over one context. They are timed as sequences of two rows each (at most 32 of them),
    and as one sequence's run where the pool cannot hold that many tables."""
    from specstream import Engine, EngineConfig, calibration
    from specstream.model.fast_llama import COMPILED_MAX_RUN

    tables = [[i] for i in range(calibration.WIDE_SEQS)]
    assert [len(it.tokens) for it in calibration.step_items(tables, 8, COMPILED_MAX_RUN)] == [COMPILED_MAX_RUN]
    wide = calibration.step_items(tables, 8, 33)
    assert [len(it.tokens) for it in wide] == [2] * 16 + [1] and [it.num_logits for it in wide] == [2] * 16 + [1]
    assert {it.start for it in wide} == {8} and len({tuple(it.table) for it in wide}) == 17
    assert [len(it.tokens) for it in calibration.step_items(tables, 8, 100)] == [4] * 4 + [3] * 28
    assert [len(it.tokens) for it in calibration.step_items(tables[:3], 8, 33)] == [33]  # too few tables
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32"), log=False)
    forward, fed = engine.runner.forward, []
    engine.runner.forward = lambda items, *a: fed.append([len(i.tokens) for i in items]) or forward(items, *a)
    free = engine.runner.pool.num_free_blocks
    assert calibration.time_steps(engine.runner, [1, 16, 33], 16, repeats=1) is not None
    assert fed[:3] == [[16] * 8, [16] * 8, [16]]  # the 17 tables' contexts, 8 a forward
    assert fed[3:] == [[2] * 16 + [1], [2] * 16 + [1], [16], [1]]  # a warm-up, then each size
    assert engine.runner.pool.num_free_blocks == free  # timing keeps no KV


def test_the_k_policy_grants_no_run_longer_than_the_longest_compiled_one():
    """Drafts that are always accepted, on a flat curve, pay whatever their number: k_max 16 would make one
    sequence's run 17 rows, past the compiled steps' 16, which runs the step eager at a cost the curve (timed past
    16 rows on several sequences' short runs) does not show; granted 15. Not adaptive, k_max as asked."""
    from types import SimpleNamespace

    cost = CostModel([1, 64], [0.010, 0.0101])
    seq = SimpleNamespace(params=SamplingParams(), acceptance=Acceptance(100.0, 0.0), draft_room=None)
    assert KPolicy(16, True, cost, lambda n: 0.0, longest_run=16).choose([seq], 1, 64) == [15]
    assert KPolicy(16, True, cost, lambda n: 0.0).choose([seq], 1, 64) == [16]
    assert KPolicy(16, False, cost, lambda n: 0.0, longest_run=16).choose([seq], 1, 64) == [16]


def test_what_drafting_adds_to_a_step_beyond_its_rows_price_is_measured_per_batch_and_charged_once_a_step():
    """Plain steps of 8 sequences take 0.4 ms beyond what the curve prices their rows at, steps where any of them
    drafts 1.4 ms (host work, and a forward that verifies every sequence once one drafts): a step's drafting is
    then charged 1 ms, once. A first draft that paid for its row alone no longer does; drafts kept 9 times in 10
    on every sequence still pay for it together. One sequence's steps are measured apart."""
    cost = CostModel([8, 16], [0.020, 0.030])  # a row: 1.25 ms on a step of 8 tokens in 20 ms
    policy = KPolicy(4, True, cost, lambda n: 0.0)
    batch = seqs(8, accepted=30.0, rejected=10.0)  # drafts kept about 3 times in 4
    assert sum(policy.choose(batch, 8, 32)) > 0
    one = seqs(1, accepted=30.0, rejected=10.0)
    before = policy.choose(one, 1, 32)
    for _ in range(200):
        policy.surcharge.observe(8, 0, 0.0004, 0.020)
        policy.surcharge.observe(8, 1 + _ % 4, 0.0014, 0.022)
    assert policy.surcharge.plain[8] == pytest.approx(0.0004) and policy.surcharge(8) == pytest.approx(0.001, rel=0.02)
    assert policy.surcharge(1) == 0.0 and policy.choose(one, 1, 32) == before
    assert sum(policy.choose(batch, 8, 32)) == 0  # one draft each before
    assert all(k > 0 for k in policy.choose(seqs(8, accepted=90.0, rejected=10.0), 8, 32))
    policy.surcharge.observe(8, 1, float("nan"), 0.022)  # tells nothing
    policy.surcharge.observe(8, 1, 0.001, 0.0)  # nor does a step without a price
    policy.surcharge.observe(8, 1, 10.0, 0.022)  # a descheduled step counts for its price at most
    assert policy.surcharge(8) == pytest.approx(0.001 + 0.05 * (0.022 - 0.001), rel=0.02)
    for _ in range(700):  # plain steps forget the charge, half of it in about 700
        policy.surcharge.observe(8, 0, 0.0004, 0.020)
    assert policy.surcharge(8) == pytest.approx(0.5 * (0.001 + 0.05 * (0.022 - 0.001)), rel=0.02)
    policy.surcharge.observe(2, 0, 0.05, 0.011)  # a slow first step of its size is averaged away, not kept
    policy.surcharge.observe(2, 1, 0.06, 0.012)  # nor is a drafting step measured against fewer than a few plain ones
    for _ in range(150):
        policy.surcharge.observe(2, 0, 0.0004, 0.011)
    assert policy.surcharge.plain[2] == pytest.approx(0.0004, rel=0.05) and policy.surcharge(2) == 0.0


def test_a_curve_that_prices_plain_steps_high_still_shows_what_drafting_adds():
    """The curve prices rows, not a step's shape: where plain steps of 8 come in 1 ms under its price and a step
    where one sequence drafts 4 ms over (every sequence verified, padded), the surcharge is the 5 ms between them.
    Drafting steps that come in under the plain steps' mark add nothing."""
    policy = KPolicy(4, True, CostModel([8, 16], [0.020, 0.030]), lambda n: 0.0)
    for _ in range(300):
        policy.surcharge.observe(8, 0, -0.001, 0.020)
        policy.surcharge.observe(8, 1, 0.004, 0.021)
    assert policy.surcharge(8) == pytest.approx(0.005, rel=0.02)
    assert sum(policy.choose(seqs(8, accepted=30.0, rejected=10.0), 8, 32)) == 0
    for _ in range(300):
        policy.surcharge.observe(8, 1, -0.003, 0.021)
    assert policy.surcharge(8) < 1e-6


def test_the_engine_reports_each_steps_time_beyond_its_price(tiny_model_dir):
    from specstream import Engine, EngineConfig, SpeculativeConfig

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    e = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", speculative=spec), log=False)
    while not e.priced:  # the forward-time curve its rows are priced from
        e.idle()
    seen = []
    e.policy.surcharge.observe = lambda *a: seen.append(a)
    e.generate([list(range(5, 25)) * 3], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert seen and all(n == 1 and drafting in (0, 1) and -1.0 < beyond < 1.0 and priced > 0 for n, drafting, beyond, priced in seen)
    assert any(drafting for _, drafting, _, _ in seen) and len(seen) <= 29  # every step but the prefill's


def test_a_step_being_priced_reads_the_curve_once_per_size():
    """auto prices every sequence's every method at every length on one step (dozens of sizes, thousands of
    reads at 32 streams): each size is read from the curve once while the step is built, and priced the same."""
    from specstream.spec_decode.policy import StepBase, StepPrice, best_length

    cost = CostModel([1, 8, 16, 17, 32, 33], [0.010, 0.012, 0.014, 0.020, 0.030, 0.036])
    reads = []
    counted = lambda n: reads.append(n) or cost(n)  # noqa: E731
    price = StepPrice(counted, StepBase(24, 24.0))
    first = [best_length(a, 12, price) for a in (0.3, 0.6, 0.9)]
    assert first == [best_length(a, 12, StepPrice(cost, StepBase(24, 24.0))) for a in (0.3, 0.6, 0.9)]
    assert sorted(reads) == sorted(set(reads)) and len(reads) == 13  # 24 rows, then 25..36
    price.add(1.0, 9)  # past the 33rd row: the sizes read before are read no more
    best_length(0.6, 12, price)
    assert len(reads) == 13 + 9 and price.rate() == pytest.approx(25.0 / cost(33))


def test_the_online_correction_keeps_the_curve_monotone():
    """Steps near 33 tokens that ran slow (a prefill chunk among them) and steps near 48 that ran fast raise one size
    and lower the other: corrected apart, 33 tokens were priced above 48, and a draft taking a step from 33 rows to
    48 cost less than nothing. The sizes stay in order, whatever the steps observed."""
    cost = CostModel([1, 16, 32, 33, 48, 64], [0.008, 0.014, 0.034, 0.040, 0.046, 0.052])
    for _ in range(400):
        cost.observe(33, 0.120)
        cost.observe(48, 0.030)
        cost.observe(1, 0.008)
    points = [cost(n) for n in cost.tokens]
    assert points == sorted(points)
    assert cost(48) >= cost(33) > cost(32)


def test_a_size_no_step_came_near_keeps_the_timed_jump_above_the_sizes_run():
    """32 sequences decoding without drafts: hundreds of 32-row steps, slower than timed (the curve times 16
    sequences' runs of 2 rows), and none of 33. The 33rd row starts another pass of the tiled kernels: the curve
    prices it at its timed jump scaled as the 32-row step is, not at nothing (floored at the 32-row step's
    price, it looked free). Once 33-row steps run, the size learns its own correction from there."""
    cost = CostModel([1, 16, 32, 33, 48], [0.008, 0.014, 0.025, 0.0295, 0.035])
    for _ in range(300):
        cost.observe(32, 0.040)
        cost.observe(1, 0.008)
    assert cost(32) == pytest.approx(0.040, rel=0.05) and cost(1) == pytest.approx(0.008, rel=0.05)
    assert cost(33) - cost(32) == pytest.approx(0.0045 * cost(32) / 0.025, rel=0.05)
    assert cost(48) / cost(33) == pytest.approx(0.035 / 0.0295)
    for _ in range(300):
        cost.observe(33, 0.042)
        cost.observe(32, 0.040)
    assert cost(33) == pytest.approx(0.042, rel=0.05) and cost(32) == pytest.approx(0.040, rel=0.05)


def test_auto_prices_its_picked_drafts_at_what_such_drafts_kept_of_their_price():
    """The gain trust: a fresh bucket trusts the estimates (1); once auto's picked drafts keep 3/4 of the tokens they
    were priced to add, the trust is 3/4 (the record holds the price before the trust, so it does not
    compound), held at 0.5 however poor, one kind's (a match length's, the suffix's) or bucket's record not
    another's; a match whose estimate only just beats plain decoding is drafted at a trust of 1 and not at
    0.5."""
    from specstream.spec_decode.auto import NGRAM_PRIOR, TRUST_RANGE, AutoProposer, Calibration
    from specstream.spec_decode.ngram import NgramProposer
    from specstream.spec_decode.policy import StepBase, StepPrice, best_length, expected_tokens

    steep = CostModel([1, 2, 17], [0.010, 0.0125, 0.03])
    price = StepPrice(steep, StepBase.alone(1))
    assert best_length(0.35, 4, price)[0] > price.rate() > best_length(0.35, 4, price, trust=0.5)[0]

    sampled = SamplingParams(temperature=0.7)
    bucket = sampling_bucket(sampled)
    auto = AutoProposer(None, NgramProposer(1, 4), k_max=8)
    assert auto.gain_trust("ngram2", bucket) == auto.gain_trust("suffix", bucket) == 1.0
    text = list(range(100, 130))
    seq = Sequence("r", text + [7] + text[:2], sampled, 0)  # a two-token match, drafting text[2:]
    owed = 0.0
    for _ in range(600):
        (draft,) = auto.propose([seq], [4])
        assert draft.method == "ngram" and draft.tokens
        # What the draft is made to keep: 3/4 of its price before the trust (at the fixed prior of two-token
        # matches, the shared record and the sequence's own being emptied every round).
        owed += 0.75 * (expected_tokens(NGRAM_PRIOR[2], len(draft.tokens)) - 1.0)
        kept = min(int(owed), len(draft.tokens))
        owed -= kept
        seq.stats.drafted += len(draft.tokens)
        seq.stats.accepted += kept
        auto.on_commit(seq)
        auto.shared = type(auto.shared)()  # the shared record held at its prior: every match drafts whole
        auto._seqs["r"].ngram.clear()
    assert abs(auto.gain_trust("ngram2", bucket) - 0.75) < 0.05
    assert auto.gain_trust("ngram2", "greedy") == auto.gain_trust("suffix", bucket) == auto.gain_trust("ngram1", bucket) == 1.0
    auto.trust["ngram2", bucket] = Calibration(accepted=0.0, expected=1e4)
    assert auto.gain_trust("ngram2", bucket) == TRUST_RANGE[0] == 0.5

    # At the margin: the shared record of two-token matches knows them (at about their prior), so a match is
    # drafted only where its price pays.
    def judged(trust_record):
        auto = AutoProposer(None, NgramProposer(1, 4), k_max=8)
        auto.calibrate(steep, 64)
        for _ in range(20):
            auto.shared.record("ngram2", bucket, 0.35, 0.65)
        if trust_record is not None:
            auto.trust["ngram2", bucket] = trust_record
        auto.begin_step(StepBase.alone(1))
        return auto.propose([Sequence("m", text + [7] + text[:2], sampled, 0)], [4])[0].tokens

    assert judged(None) and not judged(Calibration(accepted=0.0, expected=1e4))


def test_a_sequence_near_its_limit_gets_no_more_drafts_than_it_can_keep_and_the_budget_goes_to_others():
    """A round emits its kept drafts and one token more: with 3 tokens left to max_tokens a sequence drafts at
    most 2, adaptive or not, and the step's budget it cannot use is granted to the sequence beside it."""
    cost = CostModel([1, 64], [0.010, 0.0101])  # rows nearly free: drafts kept 99 times in 100 pay at any k
    near, far = seqs(2, accepted=99.0, rejected=1.0)
    near.max_tokens = near.num_output_tokens + 3
    assert near.draft_room == 2 and far.draft_room == far.max_tokens - 1
    for adaptive in (True, False):
        assert KPolicy(8, adaptive, cost, lambda n: 0.0).choose([near, far], base_tokens=2, budget=10) == [2, 8]
    near.max_tokens = near.num_output_tokens + 1  # its last token: no room for a draft
    assert KPolicy(8, True, cost, lambda n: 0.0).choose([near, far], base_tokens=2, budget=10) == [0, 8]
