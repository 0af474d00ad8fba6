"""Invariant mode (EngineConfig.deterministic): a token's logits are bit-identical whether it is
computed alone, as one of k + 1 verified tokens, in a prefill chunk, or beside other
sequences; so greedy output and seeded sampling do not depend on drafts or on the batch, in
bf16 as in fp32."""

import pytest
import torch
import torch.nn.functional as F

from conftest import build_tiny_model, tree_path_logits
from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.kernels import cpu as cpu_kernels
from specstream.kernels.quant import ROWS_ALONE
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


def check_logits_do_not_depend_on_the_step(runner):
    """A token's logits alone, verified (the prompt, then runs of k + 1 tokens as a speculative round feeds them),
    in one prefill chunk over all 40 tokens (more than one tile), and beside other sequences (b's long prefill and
    c's decoding share a's steps): the same bits, the prompt's rows (prefilled in 20 vs 40 vs 7 + 13) included."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(3, 300, (40,), generator=g).tolist()
    b = torch.randint(3, 300, (70,), generator=g).tolist()
    c = torch.randint(3, 300, (25,), generator=g).tolist()
    alone = run_schedule(runner, [a], alone_schedule(20, 40))[0]
    verified = run_schedule(runner, [a], [[(0, 20)], [(0, 5)], [(0, 9)], [(0, 1)], [(0, 5)]])[0]
    prefilled = run_schedule(runner, [a], [[(0, 40)]])[0]
    batched = run_schedule(
        runner,
        [a, b, c],
        [[(1, 33), (0, 7), (2, 10)], [(0, 13), (1, 37), (2, 1)], [(2, 9), (0, 3)], [(0, 17), (2, 5)]],
    )[0]
    for name, got in (("verified", verified), ("prefilled", prefilled), ("batched", batched)):
        assert torch.equal(got, alone), name


def check_tree_rows_round_as_their_path(runner):
    """A draft tree verified in one step (a's next tokens on one path, random siblings beside it, the path's rows
    between them) gives the path's rows the bits the same tokens get decoded one by one."""
    g = torch.Generator().manual_seed(1)
    a = torch.randint(3, 300, (30,), generator=g).tolist()
    alone = run_schedule(runner, [a], alone_schedule(20, 30))[0]
    siblings = torch.randint(3, 300, (4,), generator=g).tolist()
    assert torch.equal(tree_path_logits(runner, a[:19], a[19:24], siblings), alone[19:24])


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
    check_logits_do_not_depend_on_the_step(make_runner(tiny_model_dir, dtype))


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


def check_greedy_tokens_equal(plain, spec, max_tokens):
    """Greedy: plain decoding batched, and speculation alone and batched, give plain decoding's tokens alone."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    alone = [plain.generate(p, greedy)[0].token_ids for p in PROMPTS]
    assert [o.token_ids for o in plain.generate(PROMPTS, greedy)] == alone
    assert [spec.generate(p, greedy)[0].token_ids for p in PROMPTS] == alone
    assert [o.token_ids for o in spec.generate(PROMPTS, greedy)] == alone
    # The drafts were real: some were accepted, so the tokens above came from verified runs.
    assert spec.metrics.num_accepted_tokens._value.get() > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_greedy_tokens_equal_with_drafts_and_in_any_batch(tiny_model_dir, dtype):
    check_greedy_tokens_equal(engine(tiny_model_dir, dtype), engine(tiny_model_dir, dtype, "ngram"), 48)


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


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_invariant_mode_over_block_kernels_computes_rows_alone_without_padding(tiny_model_dir, dtype):
    """Where every projection takes specstream's block kernels, asked to compute each row alone, the row-wise work
    runs untiled (a decode step computes one row, not 16) and a token's logits still do not depend on its step.
    The tiny model's heads (16 wide) do not fit the attention kernel, so attention keeps its tiles."""
    if not cpu_kernels.load():
        pytest.skip("specstream's CPU kernels did not build (no g++)")
    plain = engine(tiny_model_dir, dtype, quantization="int4")
    runner = plain.runner
    assert runner.fast.tile == 0 and runner.tile == INVARIANT_TILE
    assert runner.tiling == f"rows alone, attention in tiles of {INVARIANT_TILE} rows"
    projections = [runner.fast.lm_head, *runner.fast.layer_projections()]
    assert all(lin.packed.kernel[-1] == ROWS_ALONE for lin in projections)
    check_logits_do_not_depend_on_the_step(runner)


@pytest.fixture(scope="module")
def wide_heads_model_dir(tmp_path_factory):
    """The tiny model with 64-wide heads (the attention kernel's), as the bundled model has; at this width an init
    of 0.05 falls into the loops that n-gram drafts are accepted on."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-wide-heads"), hidden=256, initializer_range=0.05)


def test_invariant_mode_attends_through_the_kernel_untiled_where_it_pairs_bfloat16(wide_heads_model_dir):
    """Where the attention kernel multiplies bfloat16 pairs (AVX512-BF16 without AMX) it attends every group,
    prefill chunks of any length included, computing a query row alone: invariant mode then drops attention's
    tiles too, and greedy speculation (drafts verified as trees) and batching still give plain decoding's tokens."""
    if not cpu_kernels.load() or not cpu_kernels.attention_pairs(torch.bfloat16, 64):
        pytest.skip("the attention kernel's bfloat16 pairs need AVX512-BF16 without AMX (a CPU feature this one lacks)")
    plain = engine(wide_heads_model_dir, "bfloat16", quantization="int4")
    assert plain.runner.tile == 0 and plain.runner.fast.tile == 0 and plain.runner.tiling == "rows alone"
    assert plain.runner.fast.math.attention_kernel
    check_logits_do_not_depend_on_the_step(plain.runner)
    spec = engine(wide_heads_model_dir, "bfloat16", "ngram", quantization="int4")
    # Drafts as trees: the kernel attends a tree row over the keys it sees laid side by side, as the same path's
    # chain has them (tests/test_cpu_kernels.py checks the bits), so a tree's rows round as its path decoded.
    assert spec.proposer.trees is True
    check_tree_rows_round_as_their_path(plain.runner)
    forward, trees = spec.runner.forward, []

    def counting(items, *args, **kwargs):
        trees.extend(item.parents for item in items if item.parents and len(set(item.parents)) < len(item.parents))
        return forward(items, *args, **kwargs)

    spec.runner.forward = counting
    check_greedy_tokens_equal(plain, spec, 40)
    assert trees, "some step should verify a tree that branches (a token of two children)"


def test_invariant_mode_keeps_its_tiles_where_a_dense_gemm_serves(tiny_model_dir):
    """Dense weights (quantization none): the GEMM rounds by row count, so the row-wise work stays in tiles."""
    runner = engine(tiny_model_dir, "bfloat16", quantization="none").runner
    assert runner.fast.tile == INVARIANT_TILE and runner.tiling == f"tiles of {INVARIANT_TILE} rows"
