"""benchmarks/step_yield.py: its per-step record of an engine and its table."""

from __future__ import annotations

import pytest
from benchmark_module import load

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.spec_decode import policy

step_yield = load("step_yield")
Step = step_yield.Step


def test_drafting_steps_are_set_against_plain_steps_of_their_batch():
    """A batch's drafting steps are compared with the median of its plain steps; steps beside a prefill, and
    batches with too few plain steps to measure by, are left out."""
    steps = [Step(1, 0, False, 1, 0.0, 0.010)] * 5 + [Step(1, 0, False, 1, 0.0, 0.030)]  # median 10 ms
    steps += [Step(1, 2, False, 2, 0.8, 0.015)] * 4 + [Step(1, 7, False, 6, 4.0, 0.025)]
    steps += [Step(1, 3, True, 4, 1.0, 0.050), Step(2, 2, False, 3, 1.0, 0.020)]  # a prefill beside; no plain batch of 2
    rows, total = step_yield.summarize(steps)
    assert [(r["batch"], r["drafted"], r["steps"]) for r in rows] == [(1, "2", 4), (1, "5-8", 1)]
    assert rows[0]["vs_plain"] == pytest.approx(2 / 1.5) and rows[0]["extra"] == 4 and rows[0]["expected"] == pytest.approx(3.2)
    assert rows[1]["vs_plain"] == pytest.approx(6 / 2.5) and rows[1]["plain_ms"] == pytest.approx(10.0)
    assert total["drafting_steps"] == 5 and total["steps"] == 12
    assert total["vs_plain"] == pytest.approx(14 / 8.5) and total["extra"] == 9 and total["expected"] == pytest.approx(7.2)
    assert total["time_share"] == pytest.approx(0.085 / (0.085 + 0.080))


def test_every_step_an_engine_runs_is_recorded(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(policy.StepPrice, "add", policy.StepPrice.add)  # record() wraps it: put it back after
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", speculative=spec), log=False)
    steps = step_yield.record(engine)
    (out,) = engine.generate([list(range(5, 25)) * 3], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    assert steps[0].prefill and all(not s.prefill for s in steps[1:])
    assert sum(s.tokens for s in steps) == len(out.token_ids) - 1 == 29  # the first token: the prefill step's round
    assert any(s.drafted for s in steps) and all(s.batch == 1 and s.seconds > 0 for s in steps[1:])
