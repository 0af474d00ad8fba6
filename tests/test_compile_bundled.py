"""The compiled forward on the bundled model (30 layers, its 4-bit and 8-bit blocks on specstream's kernels)
gives the eager forward's greedy tokens in float32, with each kind of proposer, for one sequence alone and
for several batched: the kept functions compiled ahead of time serve decode, verification and their batched
kinds exactly as the eager forward computes them.

Exactly: with the weight-only kernels (int4: q4_linear, q8_linear), where compiled and eager differ only by
float32 rounding; and under a8, which rounds each projection's input to 8 bits (a last-bit difference could move
a code by one step), compiled and eager compute a decode or verification row to the same bits: the same
attention and norm kernels, and inductor rounding bf16 intermediates as eager torch does."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import tree_path_logits
from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="no g++: inductor cannot build the compiled forward (make setup installs it)"
)

PROMPTS = [
    [{"role": "user", "content": "Repeat exactly: the blue heron waits by the river while the reeds bend in the wind."}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "List three prime numbers."}],
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def engine(method: str, compile: bool, quantization: str = "int4") -> Engine:
    # Not adaptive: every round drafts (k does not hang on timings taken on a busy machine), so verification
    # steps run for certain.
    spec = SpeculativeConfig(method=method, num_speculative_tokens=6, adaptive=False)
    config = EngineConfig(dtype="float32", quantization=quantization, compile=compile, speculative=spec)
    return Engine(config, log=False)


@pytest.fixture(scope="module")
def eager_tokens() -> dict[str, list[list[int]]]:
    plain = engine("off", compile=False)
    alone = [plain.generate(p, GREEDY)[0].token_ids for p in PROMPTS]
    assert [o.token_ids for o in plain.generate(PROMPTS, GREEDY)] == alone  # batching changes nothing eager
    return alone


@pytest.mark.parametrize("method", ["off", "ngram", "auto"])
def test_compiled_greedy_tokens_equal_eager_on_the_bundled_model(method, eager_tokens):
    compiled = engine(method, compile=True)
    assert compiled.runner.fast.compiled_rows > 0 and compiled.runner.fast.steps.kept_kinds(), compiled.forward_description
    alone = [compiled.generate(p, GREEDY)[0].token_ids for p in PROMPTS]
    batched = compiled.generate(PROMPTS, GREEDY)
    assert alone == eager_tokens
    assert [o.token_ids for o in batched] == eager_tokens
    if method != "off":
        assert sum(o.stats.accepted for o in batched) > 0  # verification steps ran, and drafts were accepted


def steps(e: Engine) -> torch.Tensor:
    """The logits of one decode and one 4-row verification step."""
    from specstream.model.runner import ForwardItem

    table: list[int] = []
    assert e.pool.reserve(table, 40)
    try:
        e.runner.forward([ForwardItem(table, 0, list(range(200, 235)), 1)])
        one = e.runner.forward([ForwardItem(table, 35, [9], 1)])
        four = e.runner.forward([ForwardItem(table, 36, [10, 11, 12, 13], 4)])
        return torch.cat([one, four])
    finally:
        e.pool.free(table)


def test_compiled_logits_match_eager_on_the_bundled_model():
    """The logits of the compiled steps are the eager forward's within float32 rounding (fusion changes the
    order of a few sums)."""
    compiled = engine("off", compile=True)
    assert compiled.runner.fast.compiled_rows >= 4
    torch.testing.assert_close(steps(compiled), steps(engine("off", compile=False)), rtol=1e-4, atol=1e-4)


def test_compiled_a8_logits_equal_eager():
    """Where a8 serves: the compiled steps' logits are the eager forward's, bit for bit, in float32 as in bf16
    (test_rows_are_bit_identical_in_any_step_in_bf16)."""
    from specstream.kernels import quant

    if not quant.a8_serves(torch.device("cpu")):
        pytest.skip("a8 does not serve on this CPU (no AVX512-VNNI, AMX-INT8 or AVX-VNNI)")
    compiled, eager = engine("off", compile=True, quantization="a8"), engine("off", compile=False, quantization="a8")
    assert compiled.runner.fast.compiled_rows >= 4
    assert torch.equal(steps(compiled), steps(eager))


def _logits_of(e: Engine, schedule: list[int], beside: str = "", prompt_chunks: tuple[int, ...] = (35,)) -> torch.Tensor:
    """The logits of 20 tokens fed after a 35-token prompt (prefilled in prompt_chunks) in runs of `schedule`
    (1: a decode step; up to 16: a verification; more: a prefill chunk), with beside="batch" other sequences
    verifying 9 rows in the same steps, with beside="prefill" those and another sequence's 30-token prefill
    chunk too (eager steps of up to 118 rows)."""
    from specstream.model.runner import ForwardItem

    prompt, tokens = list(range(300, 335)), list(range(1000, 1020))
    tables: list[list[int]] = [[] for _ in range(10)]
    for t in tables:
        assert e.pool.reserve(t, 200)
    try:
        start = 0
        for n in prompt_chunks:
            e.runner.forward([ForwardItem(tables[0], start, prompt[start : start + n], 1)])
            start += n
        for t in tables[1:9]:
            e.runner.forward([ForwardItem(t, 0, prompt[:20], 1)])
        out, pos, others, chunk = [], 35, 20, 0
        for n in schedule:
            items = [ForwardItem(tables[0], pos, tokens[pos - 35 : pos - 35 + n], n)]
            if beside:
                items += [ForwardItem(t, others, [5 + j] * 9, 9 if j % 2 else 1) for j, t in enumerate(tables[1:9])]
            if beside == "prefill":
                items.append(ForwardItem(tables[9], chunk, list(range(500 + chunk, 530 + chunk)), 1))
            out.append(e.runner.forward(items)[:n])
            pos, others, chunk = pos + n, others + 9, chunk + 30
        return torch.cat(out)
    finally:
        for t in tables:
            e.pool.free(t)


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("mode", ["a8", "deterministic"])
def test_rows_are_bit_identical_in_any_step_in_bf16(mode, compile):
    """Under a8, and under --deterministic over the weight-only kernels (rows alone, untiled), in bf16, a token's
    logits are the same bits whether it was decoded
    alone, verified among 9 or 16 rows, prefilled in a chunk of 20 or 17, in steps beside other sequences'
    verifications or beside a prefill chunk (eager steps of up to 118 rows), after a prompt prefilled whole or in
    two chunks (as after a prefix-cache hit), or verified as a tree's path (where the attention kernel pairs
    bfloat16); compiled and eager alike, and the compiled steps equal the eager ones. So greedy output cannot
    depend on the drafts, the batch or the prefix cache (under a8, prompts of up to
    attention.KERNEL_MAX_KEYS tokens where the attention kernel does not pair bfloat16: longer prefill chunks
    attend through SDPA)."""
    from specstream.kernels import cpu as cpu_kernels
    from specstream.kernels import quant

    spec = SpeculativeConfig(method="off")
    if mode == "a8":
        if not quant.a8_serves(torch.device("cpu")):
            pytest.skip("a8 does not serve on this CPU (no AVX512-VNNI, AMX-INT8 or AVX-VNNI)")
        config = EngineConfig(dtype="bfloat16", quantization="a8", compile=compile, compile_in_background=False, speculative=spec)
    else:
        if compile and not (cpu_kernels.load() and cpu_kernels.attention_pairs(torch.bfloat16, 64)):
            pytest.skip("invariant mode compiles only where attention drops its tiles: the attention kernel's bfloat16 "
                        "pairs need AVX512-BF16 without AMX (a CPU feature this one lacks)")
        config = EngineConfig(dtype="bfloat16", deterministic=True, compile=compile, compile_in_background=False, speculative=spec)
    e = Engine(config, log=False)
    fast = e.runner.fast
    if mode == "a8":
        assert {lin.packed.kernel[0] for lin in (fast.lm_head, *[layer[5] for layer in fast.layers])} == {"a8"}
        assert fast.stream_dtype == torch.float32 and e.pool.keys[0].dtype == torch.bfloat16  # a8's wide residual stream
    else:
        assert fast.tile == 0 and all(lin.packed.kernel[-1] == quant.ROWS_ALONE for lin in (fast.lm_head, *fast.layer_projections()))
    if compile:
        assert e.runner.fast.compiled_rows >= 16, e.forward_description
    alone = _logits_of(e, [1] * 20)
    cases = [
        ([9, 9, 2], "", (35,)),
        ([16, 4], "", (35,)),
        ([2] * 10, "", (35,)),
        ([20], "", (35,)),
        ([17, 3], "", (20, 15)),
        ([1, 9, 6, 4], "batch", (35,)),
        ([9, 1, 9, 1], "prefill", (3, 32)),
    ]
    for schedule, beside, chunks in cases:
        got = _logits_of(e, schedule, beside, chunks)
        assert torch.equal(got, alone), (schedule, beside, chunks, (got - alone).abs().max().item())
    if cpu_kernels.attention_pairs(torch.bfloat16, 64):  # the kernel lays a tree row's keys side by side
        # _logits_of's prompt, then its first 5 tokens as a tree's path with 4 siblings between them
        tree = tree_path_logits(e.runner, list(range(300, 335)), list(range(1000, 1005)), [7, 8, 9, 10])
        assert torch.equal(tree, alone[:5])
    if compile:
        e.runner.fast.steps, steps = None, e.runner.fast.steps
        try:
            assert torch.equal(_logits_of(e, [1] * 20), alone)  # eager decode == compiled decode
        finally:
            e.runner.fast.steps = steps
