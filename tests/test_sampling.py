"""Sampling parameters, logits processing and counter-based randomness."""

import math

import pytest
import torch

from specstream.errors import InvalidRequestError
from specstream.sampling import (
    SamplingParams,
    StructuredOutput,
    apply_penalties,
    apply_repetition_penalty,
    probabilities,
    reduce_seed,
    uniform,
)


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


def test_min_p_keeps_the_tokens_at_least_that_share_of_the_likeliest():
    probs_in = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    min_p = torch.tensor([0.25, 0.0])
    probs = probabilities(probs_in.log(), torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0]), min_p)
    assert (probs[0] > 0).tolist() == [True, True, True, False]  # 0.15 >= 0.25 * 0.5; 0.05 is not
    torch.testing.assert_close(probs[0, :3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)
    torch.testing.assert_close(probs[1], probs_in[0])  # min_p 0 drops nothing
    # after temperature, before top-p: at T=2 the tail is within the share, and top-p cuts what is left
    hot = probabilities(probs_in[:1].log(), torch.tensor([2.0]), torch.tensor([0]), torch.tensor([0.6]), min_p[:1])
    assert (hot[0] > 0).tolist() == [True, True, False, False]


def test_repetition_penalty_divides_positive_logits_and_multiplies_negative_ones():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]


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
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": 2.5},
        {"min_tokens": -1},
        {"min_tokens": 5, "max_tokens": 4},
        {"stop": [""]},
    ],
)
def test_bad_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": -(2**70)}, "top_k"),
        ({"seed": 1.0}, "seed"),
        ({"seed": True}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": ["x" * 257]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [1.0]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
        ({"presence_penalty": 2**70}, "presence_penalty"),
        ({"frequency_penalty": "0"}, "frequency_penalty"),
        ({"min_p": float("nan")}, "min_p"),
        ({"repetition_penalty": "1.1"}, "repetition_penalty"),
        ({"min_tokens": 1.0}, "min_tokens"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"min_tokens": 2, "structured": StructuredOutput(regex="[ab]+")}, "min_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": 2.0}, "logprobs"),
        ({"num_speculative_tokens": 65}, "num_speculative_tokens"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens"),
    ],
)
def test_every_field_is_bounded_and_the_error_names_it(kwargs, param):
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**kwargs)
    assert refused.value.param == param


def test_any_integer_seed_is_accepted_and_reduced_to_64_bits():
    assert reduce_seed(2**70 + 5) == 5 and reduce_seed(-1) == 2**64 - 1
    assert uniform(reduce_seed(-1), 3, 0) == uniform(-1, 3, 0)
    assert SamplingParams(seed=-(2**200)).seed == -(2**200)


def test_integer_temperatures_and_penalties_become_floats():
    params = SamplingParams(temperature=1, presence_penalty=-2, top_p=1)
    assert isinstance(params.temperature, float) and isinstance(params.presence_penalty, float) and isinstance(params.top_p, float)


def test_stop_string_becomes_list():
    assert SamplingParams(stop="END").stop == ["END"]


def test_top_p_of_one_keeps_every_token_even_beside_a_top_p_row():
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0)) * 3
    probs = probabilities(logits, torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1.0, 0.9]))
    assert (probs[0] > 0).all() and (probs[1] == 0).any()


def test_rows_without_a_filter_get_the_same_probabilities_by_the_short_path():
    """torch_probabilities_for skips the filters' checks where no row has top-k or top-p: the same bits as the
    full function; a batch with one filtered row takes the full path for every row."""
    from specstream.sampling import torch_probabilities_for

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    plain = [SamplingParams(temperature=t) for t in (0.7, 1.0, 1.3)]
    full = probabilities(logits, torch.tensor([0.7, 1.0, 1.3]), torch.tensor([0, 0, 0]), torch.tensor([1.0, 1.0, 1.0]))
    assert torch.equal(torch_probabilities_for(logits, plain), full)
    mixed = torch_probabilities_for(logits, plain[:2] + [SamplingParams(temperature=1.3, top_k=5)])
    assert torch.equal(mixed[:2], full[:2]) and int((mixed[2] > 0).sum()) == 5


# ---------------------------------------------------------------------------------------------------- draw
def _loaded_kernels():
    import shutil

    from specstream.kernels import cpu as cpu_kernels

    if shutil.which("g++") is None:
        pytest.skip("no g++: the kernels cannot be built (make setup installs it)")
    assert cpu_kernels.load(), "the kernels should build where g++ is installed"


def _torch_draw(logits, params, us):
    from specstream.sampling import sample_from, torch_probabilities_for

    return sample_from(torch_probabilities_for(logits, params), us)


@pytest.mark.parametrize("vocab", [7, 300, 49152, 49189])
def test_the_sampling_kernel_draws_the_tokens_torchs_ops_draw(vocab):
    """sampling.draw's kernel (csrc/sample_rows.cpp) against softmax and the float64 running sum: the same token
    for every row (they round differently, so they could differ only where a uniform falls within rounding of a
    boundary, which these draws do not), each row's token the same alone as among others, and none of zero
    probability however the uniform rounds."""
    from specstream.sampling import draw

    _loaded_kernels()
    g = torch.Generator().manual_seed(vocab)
    rows = 400
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[:, ::5] = float("-inf")
    logits[:, -3:] = float("-inf")  # a masked tail: a uniform rounded to the total must not land there
    params = [SamplingParams(temperature=[0.3, 0.7, 1.0, 1.6][i % 4]) for i in range(rows)]
    us = torch.rand(rows, generator=g, dtype=torch.float64)
    drawn = draw(logits, params, us)
    assert drawn.tolist() == _torch_draw(logits, params, us).tolist()
    alone = [int(draw(logits[i : i + 1], params[i : i + 1], us[i : i + 1])[0]) for i in range(0, rows, 37)]
    assert alone == drawn[::37].tolist()
    for edge in (0.0, 1 - 2**-53):
        picked = draw(logits, params, torch.full((rows,), edge, dtype=torch.float64))
        assert torch.isfinite(logits.gather(1, picked[:, None])).all()


def test_the_sampling_kernels_cut_min_p_as_torchs_ops_do_in_any_step():
    """min-p in the kernels (vLLM's order: after temperature, before top-k and top-p): each row draws the token
    torch's ops draw, alone as in a step of rows with and without min-p or other cuts; its distribution is cut
    where torch's is (the same float32 comparison: a logit below the likeliest's plus log(min_p)) and no token
    below its min-p share is drawn. llama.cpp's settings (min_p 0.05, top_k 40, top_p 0.95) sorted the vocabulary
    of every row in torch's ops, several times the kernels' time."""
    from specstream.sampling import draw, probabilities_for, torch_probabilities_for

    _loaded_kernels()
    g = torch.Generator().manual_seed(5)
    rows, vocab = 64, 300
    logits = torch.randn(rows, vocab, generator=g) * 3
    cuts = [{}, {"min_p": 0.2}, {"min_p": 0.05, "top_k": 40, "top_p": 0.95}, {"min_p": 1.0}, {"min_p": 0.3, "top_p": 0.5}]
    params = [SamplingParams(temperature=0.8, **cuts[i % len(cuts)]) for i in range(rows)]
    us = torch.rand(rows, generator=g, dtype=torch.float64)
    drawn = draw(logits, params, us)
    assert drawn.tolist() == _torch_draw(logits, params, us).tolist()
    alone = [int(draw(logits[i : i + 1], params[i : i + 1], us[i : i + 1])[0]) for i in range(rows)]
    assert drawn.tolist() == alone
    probs = probabilities_for(logits, params)
    torch.testing.assert_close(probs, torch_probabilities_for(logits, params))
    for i in range(rows):
        if params[i].min_p == 0:
            continue
        y = logits[i] / 0.8
        below = y < y.max() + math.log(params[i].min_p)
        assert (probs[i][below] == 0).all() and probs[i, drawn[i]] >= params[i].min_p * probs[i].max()
        if params[i].top_k == 0 and params[i].top_p == 1:
            assert ((probs[i] == 0) == below).all()
    transposed = logits.t().contiguous().t()  # the same rows laid out column by column
    assert draw(transposed, params, us).tolist() == drawn.tolist()


@pytest.mark.parametrize("vocab", [1, 7, 16, 300, 49152, 49189])
def test_the_argmax_kernel_gives_torchs_argmax(vocab):
    """sampling.argmax_rows's kernel (csrc/sample_rows.cpp), which greedy decoding and verification take, against
    torch.argmax: the first of equal largest logits (ties placed in the vector body, the tail and across them), rows
    of -inf, a NaN counted as the largest (its first), and rows laid out with another stride."""
    from specstream.sampling import argmax_rows

    _loaded_kernels()
    g = torch.Generator().manual_seed(vocab)
    rows = 64
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[1] = float("-inf")
    logits[2] = 0.0  # every logit the largest: the first
    logits[3, vocab // 2 :] = logits[3].max() + 1  # the largest from the middle on
    logits[4, -1] = float("inf")
    logits[5, vocab // 3] = logits[5, -1] = float("nan")
    logits[6] = float("nan")
    logits[7, -1] = -0.0
    logits[7, :-1] = float("-inf")
    for r in range(8, rows):  # the row's largest value again at a random later place, or earlier
        j, m = int(torch.randint(vocab, (1,), generator=g)), int(logits[r].argmax())
        logits[r, j] = logits[r, m]
    expected = logits.argmax(-1)
    assert argmax_rows(logits).tolist() == expected.tolist()
    assert [int(argmax_rows(logits[i : i + 1])[0]) for i in range(rows)] == expected.tolist()
    transposed = logits.t().contiguous().t()
    assert argmax_rows(transposed).tolist() == expected.tolist()
    assert argmax_rows(logits[:0]).shape == (0,)


def test_the_sampling_kernel_draws_each_token_at_its_probability():
    from specstream.sampling import draw, torch_probabilities_for

    _loaded_kernels()
    g = torch.Generator().manual_seed(3)
    logits = torch.tensor([[0.5, float("-inf"), 2.0, -1.0, 1.0]])
    params = [SamplingParams(temperature=0.8)]
    n = 40000
    samples = draw(logits.expand(n, -1), params * n, torch.rand(n, generator=g, dtype=torch.float64))
    p = torch_probabilities_for(logits, params)[0].double()
    freq = torch.bincount(samples, minlength=5).double() / n
    assert ((freq - p).abs() <= 5 * torch.sqrt(p * (1 - p) / n) + 1.0 / n).all(), (freq.tolist(), p.tolist())


def _cut_rows(vocab: int, seed: int, per_setting: int = 4):
    """Rows of every pair of top-k and top-p settings (k past the vocabulary and k = 1 among them), at three
    temperatures, with masked tokens: (logits, params, the generator that made them)."""
    g = torch.Generator().manual_seed(seed)
    settings = [(k, p) for k in (0, 1, 3, 40, 5000) for p in (1.0, 0.99, 0.9, 0.5, 0.05)]
    rows = per_setting * len(settings)
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[:, ::7] = float("-inf")
    params = [SamplingParams(temperature=(0.5, 0.7, 1.3)[i % 3], top_k=settings[i % len(settings)][0], top_p=settings[i % len(settings)][1])
              for i in range(rows)]
    return logits, params, g


@pytest.mark.parametrize("vocab", [9, 1000, 49152])
def test_the_sampling_kernel_cuts_to_top_k_and_top_p_as_torchs_ops_do(vocab):
    """Rows with top-k, top-p or both (every pair of settings, k past the vocabulary and k = 1 among them) draw
    the tokens torch's sort-based cut draws, never one the cut dropped; rows of different settings share a call."""
    from specstream.sampling import draw, torch_probabilities_for

    _loaded_kernels()
    logits, params, g = _cut_rows(vocab, vocab, per_setting=12)
    us = torch.rand(len(params), generator=g, dtype=torch.float64)
    drawn = draw(logits, params, us)
    assert drawn.tolist() == _torch_draw(logits, params, us).tolist()
    assert (torch_probabilities_for(logits, params).gather(1, drawn[:, None]) > 0).all()


@pytest.mark.parametrize("vocab", [9, 1000, 49152, 49189])
def test_the_probability_kernel_gives_torchs_distributions(vocab):
    """probabilities_for's kernel (csrc/sample_rows.cpp's probability_rows) against torch's sort-based ops: the
    same tokens kept (but where the mass before a token is within rounding of top_p: torch sums it in float32,
    the kernel in float64), each probability within float32 rounding of torch's, each row summing to 1; a row's
    probabilities the same bits alone as among others and as a column-major view."""
    from specstream.sampling import probabilities_for, torch_probabilities_for

    _loaded_kernels()
    logits, params, _ = _cut_rows(vocab, vocab + 1)
    kernel, want = probabilities_for(logits, params), torch_probabilities_for(logits, params)
    got = kernel.clone()
    for i, j in ((got > 0) != (want > 0)).nonzero().tolist():
        mass = (logits[i].double() / params[i].temperature).softmax(-1)
        if params[i].top_k:
            mass[mass.argsort(descending=True)[params[i].top_k :]] = 0.0
        before = float(mass[logits[i] > logits[i, j]].sum() / mass.sum())
        assert params[i].top_p < 1 and abs(before - params[i].top_p) < 1e-4, (before, params[i])
        got[i, j] = want[i, j] = 0.0
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-7)
    assert torch.allclose(kernel.double().sum(-1), torch.ones(len(params), dtype=torch.float64), atol=1e-5)
    for i in range(0, len(params), 13):
        assert torch.equal(probabilities_for(logits[i : i + 1], params[i : i + 1])[0], kernel[i])
    assert torch.equal(probabilities_for(logits.t().contiguous().t(), params), kernel)


def test_the_probability_kernel_is_the_distribution_the_sampling_kernel_draws_from():
    """A round's q and p (probabilities_for) and plain decoding's token (draw) come from one distribution: inverse
    CDF over probability_rows' rows picks draw's token (away from rounding at a boundary)."""
    from specstream.sampling import draw, probabilities_for, sample_from

    _loaded_kernels()
    logits, params, _ = _cut_rows(49152, 5)
    us = torch.rand(len(params), generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    assert sample_from(probabilities_for(logits, params), us).tolist() == draw(logits, params, us).tolist()


def test_the_kernels_buffers_kept_between_calls_carry_nothing_from_one_call_to_the_next():
    """The sampling kernels keep each thread's buffers from call to call: a call after calls over larger and
    smaller vocabularies, with and without top-k and top-p, draws and distributes exactly as it did first."""
    from specstream.sampling import draw, probabilities_for

    _loaded_kernels()
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 300, generator=g) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.0)] * 2
    us = torch.rand(6, generator=g, dtype=torch.float64)
    first, first_p = draw(logits, params, us).tolist(), probabilities_for(logits, params)
    for vocab in (49152, 7, 1000):
        other = torch.randn(6, vocab, generator=g) * 3
        draw(other, params, us), probabilities_for(other, params)
    assert draw(logits, params, us).tolist() == first
    assert torch.equal(probabilities_for(logits, params), first_p)


def test_probabilities_for_takes_torchs_ops_where_the_kernel_does_not_serve():
    """bfloat16 logits (and CUDA, and a machine without the kernels) take torch's ops, as before."""
    from specstream.sampling import probabilities_for, torch_probabilities_for

    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1)).bfloat16()
    params = [SamplingParams(temperature=0.7, top_p=0.9)] * 3
    assert torch.equal(probabilities_for(logits, params), torch_probabilities_for(logits, params))
