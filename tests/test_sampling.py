"""Sampling parameters, logits processing and counter-based randomness."""

import math

import pytest
import torch

from specstream.sampling import SamplingParams, apply_penalties, probabilities, uniform


def test_uniform_is_a_pure_function_of_seed_position_and_stream():
    assert uniform(7, 3, 0) == uniform(7, 3, 0)
    values = {uniform(7, pos, stream) for pos in range(50) for stream in range(3)}
    assert len(values) == 150 and all(0 <= v < 1 for v in values)
    assert abs(sum(uniform(1, i, 0) for i in range(20000)) / 20000 - 0.5) < 0.01


def test_top_k_keeps_only_k_most_likely():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    probs = probabilities(logits, torch.tensor([1.0]), torch.tensor([2]), torch.tensor([1.0]))
    assert (probs[0] > 0).tolist() == [False, True, True, False]
    assert math.isclose(probs.sum().item(), 1.0, rel_tol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    probs = probabilities(probs_in.log(), torch.tensor([1.0]), torch.tensor([0]), torch.tensor([0.75]))
    assert (probs[0] > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(probs[0, :2], torch.tensor([0.625, 0.375]))


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 2.0]])
    hot = probabilities(logits, torch.tensor([2.0]), torch.tensor([0]), torch.tensor([1.0]))
    cold = probabilities(logits, torch.tensor([0.5]), torch.tensor([0]), torch.tensor([1.0]))
    assert cold[0, 1] > hot[0, 1]


def test_penalties_subtract_frequency_and_presence():
    logits = torch.zeros(1, 3)
    counts = torch.tensor([[0.0, 1.0, 3.0]])
    out = apply_penalties(logits, counts, torch.tensor([0.5]), torch.tensor([0.25]))
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.75, -1.25]]))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -5},
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"presence_penalty": 3.0},
        {"frequency_penalty": float("inf")},
        {"stop": [""]},
    ],
)
def test_bad_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_stop_string_becomes_list():
    assert SamplingParams(stop="END").stop == ["END"]


def test_top_p_of_one_keeps_every_token_even_beside_a_top_p_row():
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0)) * 3
    probs = probabilities(logits, torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1.0, 0.9]))
    assert (probs[0] > 0).all() and (probs[1] == 0).any()
