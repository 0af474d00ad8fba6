"""Invariant mode (EngineConfig.deterministic): a token's logits are bit-identical whether it is
computed alone, as one of k + 1 verified tokens, in a prefill chunk, or beside other
sequences; so greedy output and seeded sampling do not depend on drafts or on the batch, in
bf16 as in fp32."""

import pytest
import torch
import torch.nn.functional as F

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.model.attention import ATTN_IMPLEMENTATION, model_geometry
from specstream.model.fast_llama import FastLlama
from specstream.memory.kv import KVPool
from specstream.model.loader import ModelError, load_model, resolve_model
from specstream.model.runner import INVARIANT_TILE, ForwardItem, ModelRunner

DTYPES = [torch.bfloat16, torch.float32]


def _ids(dtype):
    return str(dtype).removeprefix("torch.")


def make_runner(model_dir, dtype, tile=INVARIANT_TILE, fast=True):
    model = load_model(resolve_model(str(model_dir)), dtype, "cpu", attn_implementation=ATTN_IMPLEMENTATION)
    pool = KVPool(*model_geometry(model.config), 2048, 8, dtype, "cpu")
    return ModelRunner(model, pool, fast=fast, tile=tile)


def run_schedule(runner, seqs, steps):
    """Feed each sequence in the given chunks, some steps holding several sequences. steps: a
    list of steps, each a list of (sequence index, number of tokens). Returns, per sequence,
    the logits of every token after the first, in order."""
    pool = runner.pool
    tables = [[] for _ in seqs]
    done = [0] * len(seqs)
    out = [[] for _ in seqs]
    for t, s in zip(tables, seqs):
        assert pool.reserve(t, len(s))
    for step in steps:
        items = []
        for i, n in step:
            items.append(ForwardItem(tables[i], done[i], seqs[i][done[i] : done[i] + n], n))
        logits = runner.forward(items)
        row = 0
        for i, n in step:
            out[i].append(logits[row : row + n])
            row += n
            done[i] += n
    for t in tables:
        pool.free(t)
    return [torch.cat(o)[: len(s) - 1] if o else None for o, s in zip(out, seqs)]


def alone_schedule(prompt, total):
    """Prefill the prompt, then one token per step: plain decoding."""
    return [[(0, prompt)]] + [[(0, 1)] for _ in range(total - prompt)]


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_single_projection_rows_are_batch_invariant(dtype):
    """The tiled projection: a row's output is the same bits in a call of 1, 9 or 75 rows, on a
    shape (1536 inputs) whose plain bf16 matmul on this kind of CPU changes with the row count."""
    torch.manual_seed(0)
    weight = (torch.randn(576, 1536) * 0.05).to(dtype)
    x = torch.randn(75, 1536).to(dtype)

    class Layer:
        tile = INVARIANT_TILE

    rows = FastLlama._rows.__get__(Layer())
    proj = lambda h: F.linear(h, weight)  # noqa: E731
    alone = torch.cat([rows(proj, x[i : i + 1]) for i in range(75)])
    for n in (9, 16, 17, 75):
        assert torch.equal(rows(proj, x[:n]), alone[:n]), n


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
def test_whole_model_logits_do_not_depend_on_the_step(tiny_model_dir, dtype):
    runner = make_runner(tiny_model_dir, dtype)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(3, 300, (40,), generator=g).tolist()
    b = torch.randint(3, 300, (70,), generator=g).tolist()
    c = torch.randint(3, 300, (25,), generator=g).tolist()
    alone = run_schedule(runner, [a], alone_schedule(20, 40))[0]
    # Verification: the prompt, then runs of k + 1 tokens as a speculative round feeds them.
    verified = run_schedule(runner, [a], [[(0, 20)], [(0, 5)], [(0, 9)], [(0, 1)], [(0, 5)]])[0]
    # One long prefill chunk over all 40 tokens (more than one tile).
    prefilled = run_schedule(runner, [a], [[(0, 40)]])[0]
    # Beside other sequences: b's long prefill and c's decoding share a's steps.
    batched = run_schedule(
        runner,
        [a, b, c],
        [[(1, 33), (0, 7), (2, 10)], [(0, 13), (1, 37), (2, 1)], [(2, 9), (0, 3)], [(0, 17), (2, 5)]],
    )[0]
    for name, got in (("verified", verified), ("prefilled", prefilled), ("batched", batched)):
        assert torch.equal(got[19:], alone[19:]), name
    # The prompt rows too (prefilled in 20 vs 40 vs 7 + 13): same bits.
    assert torch.equal(prefilled[:19], alone[:19]) and torch.equal(batched[:19], alone[:19])


def test_invariant_mode_needs_the_lean_forward(tiny_model_dir):
    with pytest.raises(ModelError, match="lean Llama forward"):
        make_runner(tiny_model_dir, torch.float32, fast=False)


PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef add(",
    "Paris",
    "Speculative decoding lets a small proposer guess tokens. Speculative decoding lets a small proposer guess",
    [{"role": "user", "content": "Hello! How can I help you today?"}],
]


def engine(model_dir, dtype, method="off", k=6, **kw):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k)
    return Engine(EngineConfig(model=str(model_dir), dtype=dtype, deterministic=True, speculative=spec, **kw), log=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_tokens_equal_with_drafts_and_in_any_batch(tiny_model_dir, dtype):
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = engine(tiny_model_dir, dtype)
    spec = engine(tiny_model_dir, dtype, "ngram")
    alone = [plain.generate(p, greedy)[0].token_ids for p in PROMPTS]
    assert [o.token_ids for o in plain.generate(PROMPTS, greedy)] == alone
    assert [spec.generate(p, greedy)[0].token_ids for p in PROMPTS] == alone
    assert [o.token_ids for o in spec.generate(PROMPTS, greedy)] == alone
    # The drafts were real: some were accepted, so the tokens above came from verified runs.
    assert spec.metrics.num_accepted_tokens._value.get() > 0


def test_seeded_sampling_equal_with_and_without_drafts_bf16(tiny_model_dir):
    params = [
        SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=s, ignore_eos=True) for s in range(len(PROMPTS))
    ]
    plain = engine(tiny_model_dir, "bfloat16")
    spec = engine(tiny_model_dir, "bfloat16", "ngram")
    want = [plain.generate(p, sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want


def test_invariant_mode_with_int4_weights_routes_without_timing(tiny_model_dir):
    """Kernel routes timed at start-up differ between starts, and so would the rounding: in
    invariant mode every int4 projection takes the packed kernel, so two engines (plain and
    speculative) give the same bf16 tokens."""
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = engine(tiny_model_dir, "bfloat16", quantization="int4")
    spec = engine(tiny_model_dir, "bfloat16", "ngram", quantization="int4")
    qkv = plain.runner.fast.layers[0][1]
    assert qkv.packed is not None and qkv.max_packed_rows == 1 << 30 and qkv.dense is None
    alone = [plain.generate(p, greedy)[0].token_ids for p in PROMPTS]
    assert [spec.generate(p, greedy)[0].token_ids for p in PROMPTS] == alone
    assert [o.token_ids for o in spec.generate(PROMPTS, greedy)] == alone
