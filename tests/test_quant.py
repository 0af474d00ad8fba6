"""Quantized projections: the int4 layout represents GGUF's 4-bit blocks exactly, the kernels compute
what the layout says, and speculative output still equals plain output with quantized weights."""

import types
import numpy as np
import pytest
import torch

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.kernels import cpu as cpu_kernels
from specstream.kernels import quant, routes
from specstream.kernels.weights import q4_k_weights, read_gguf_blocks, source_int4_weights
from specstream.kernels.weights import Int4Weights, Int8Blocks
from specstream.kernels.quant import Linear, LinearFactory, PackedInt4, PackedInt8, project

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef add(",
    "Paris",
    [{"role": "user", "content": "Hello! How can I help you today?"}],
]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def assert_float32_sums(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got is x @ w.T summed in float32, in any order: within float32's bound for a sum of k products (k u sum |x w|,
    u = 2^-24) of the exact result. A fixed tolerance is too tight where products cancel."""
    exact = x.double() @ w.double().t()
    bound = x.shape[-1] * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    excess = (got.double() - exact).abs() - bound
    assert bool((excess <= 0).all()), f"{float(excess.max())} past the bound"


def random_int4(n: int = 64, k: int = 128, seed: int = 0) -> Int4Weights:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    # float16 block scales and minimums, as a Q4_1 file stores them
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
    mins = (-8 * scales + torch.randn(n, k // 32, generator=gen) * 1e-3).half().float()
    return Int4Weights(codes, scales, mins)


def test_int4_kernel_multiplies_by_c_minus_8_times_scale_plus_zero_exactly_in_float32():
    weights = random_int4()
    packed = PackedInt4(weights, torch.float32, torch.device("cpu"))
    # Rows of the identity pick out single weights: the output is the kernel's weight, with no sum rounding.
    seen = packed(torch.eye(weights.codes.shape[1])).t()
    assert torch.equal(seen, weights.dequantize())
    assert torch.equal(seen, quant._effective_int4(weights, torch.float32))


def test_8bit_blocks_as_two_int4_planes_are_exact_in_float32():
    """GGUF Q8_0 (w = d * c, c in -128..127, d float16 per 32 weights) served by the int4 kernel twice:
    c = 16 hi + lo, and the two planes' products add up to the file's weights bit for bit."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (64, 128), generator=gen, dtype=torch.int8)
    codes[0, :4] = torch.tensor([-128, 127, -1, 0], dtype=torch.int8)
    blocks = Int8Blocks(codes, (torch.rand(64, 4, generator=gen) * 0.01 + 1e-4).half().float())
    packed = PackedInt4(blocks.planes(), torch.float32, torch.device("cpu"))
    assert packed.kernel[0] == "int4x2"
    seen = packed(torch.eye(128)).t()
    assert torch.equal(seen, blocks.dequantize())
    assert torch.equal(quant._effective_int4(blocks.planes(), torch.float32), blocks.dequantize())
    x = torch.randn(5, 128)
    torch.testing.assert_close(packed(x), x @ blocks.dequantize().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k", [(64, 128), (48, 96), (32, 1536)])
def test_4bit_block_kernel_multiplies_by_the_files_weights(n, k):
    """specstream's q4_linear kernel (cpu_kernels.py) weighs by exactly d * c + m (identity rows read the
    weights back) and sums in float32, at every row count a step has (its row groups of 1 to 12, and more)."""
    if not cpu_kernels.load():
        pytest.skip("specstream's CPU kernels did not build (no g++)")
    weights = random_int4(n, k)
    assert quant.PackedQ4.fits(weights)
    packed = quant.PackedQ4(weights, torch.device("cpu"))
    assert packed.kernel[0] == "q4" and packed.nbytes == n * k // 2 + 2 * 2 * n * (k // 32)
    assert torch.equal(packed(torch.eye(k)).t(), weights.dequantize())
    # bfloat16 rows take the bfloat16-pair path where the CPU has one: the same weights
    assert torch.equal(packed(torch.eye(k, dtype=torch.bfloat16)).t(), weights.dequantize().bfloat16())
    for rows in (1, 2, 3, 4, 5, 7, 9, 12, 13, 30):
        x = torch.randn(rows, k)
        torch.testing.assert_close(packed(x), x @ weights.dequantize().t(), rtol=1e-5, atol=1e-5)
        xb = x.bfloat16()
        torch.testing.assert_close(packed(xb), (xb.float() @ weights.dequantize().t()).bfloat16(), rtol=1e-2, atol=1e-2)
    assert packed(torch.randn(0, k)).shape == (0, n)


def random_q4_k(rows: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF Q4_K super-blocks as a file holds them, [rows, k / 256 * 144] bytes: random codes, 6-bit scales and
    minimums, and float16 d and dmin of a trained model's size."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * (k // 256), 144), dtype=np.uint8)
    for start in (0, 2):
        blocks[:, start : start + 2] = np.float16(rng.uniform(1e-4, 2e-3, size=len(blocks))).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def test_q4_k_super_blocks_are_read_as_the_files_weights(tmp_path):
    """A Q4_K super-block (256 inputs: float16 d and dmin, 6-bit scale and minimum per 32) in a GGUF file becomes
    affine blocks of 32 with float32 scales: the weights are ggml's dequantization of the file, bit for bit, and
    the scales are ones float16 cannot hold (so the kernels take them in float32)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from k_quants import write_tensor

    raw = random_q4_k(48, 512)
    write_tensor(tmp_path / "q4_k.gguf", "blk.0.ffn_down.weight", raw, GGMLQuantizationType.Q4_K)
    weights = read_gguf_blocks(tmp_path / "q4_k.gguf", ["blk.0.ffn_down.weight"])["blk.0.ffn_down.weight"]
    assert weights.codes.shape == (48, 512) and weights.scales.shape == weights.mins.shape == (48, 16)
    assert np.array_equal(weights.dequantize().numpy(), dequantize(raw, GGMLQuantizationType.Q4_K))
    assert quant.block_scale_dtype(weights.scales, weights.mins) == torch.float32
    assert quant.block_scale_dtype(random_int4().scales, random_int4().mins) == torch.float16


def test_4bit_blocks_float16_cannot_hold_keep_float32_scales_in_specstreams_kernels(monkeypatch):
    """Q4_K's scales (and any others float16 cannot hold) are kept in float32: q4_linear and a8 still serve them,
    with the file's weights (identity rows read them back), where torch's int4 kernel would round them to bf16."""
    if not cpu_kernels.load():
        pytest.skip("specstream's CPU kernels did not build (no g++)")
    weights = q4_k_weights(random_q4_k(64, 512, seed=1))
    packed = quant.PackedQ4(weights, torch.device("cpu"))
    assert packed.scales.dtype == packed.mins.dtype == torch.float32
    assert packed.nbytes == 64 * 512 // 2 + 2 * 4 * 64 * (512 // 32)
    assert torch.equal(packed(torch.eye(512)).t(), weights.dequantize())
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 4, 9, 13):
        x = torch.randn(rows, 512, generator=gen)
        # float32 sums in another order than the matmul's, outputs up to ~60 here: 1e-5 relative is not enough alone
        torch.testing.assert_close(packed(x), x @ weights.dequantize().t(), rtol=1e-5, atol=1e-4)
        xb = x.bfloat16()
        torch.testing.assert_close(packed(xb), (xb.float() @ weights.dequantize().t()).bfloat16(), rtol=1e-2, atol=1e-2)
    factory = LinearFactory("auto", torch.float32, torch.device("cpu"), {"w": weights})
    lin = factory(["w"], torch.zeros(64, 512))
    assert lin.packed.kernel[0] == "q4" and torch.equal(lin.dense, weights.dequantize())
    monkeypatch.setattr(cpu_kernels, "_loaded", False)  # without specstream's kernels: torch's int4 kernel
    factory = LinearFactory("auto", torch.float32, torch.device("cpu"), {"w": weights})
    assert factory(["w"], torch.zeros(64, 512)).packed.kernel[0] == "int4"


def random_q6_k(rows: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF Q6_K super-blocks as a file holds them, [rows, k / 256 * 210] bytes: random 6-bit codes and int8
    scales, a float16 d of a trained model's size."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * (k // 256), 210), dtype=np.uint8)
    blocks[:, 208:210] = np.float16(rng.uniform(2e-5, 2e-4, size=len(blocks))).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def test_q6_k_super_blocks_are_read_as_8bit_codes_with_a_scale_per_16_and_served_exactly(tmp_path):
    """Q6_K (most Q4_K_M files' LM head, and some of their attn_v and ffn_down): 6-bit codes less 32 as int8, a
    float32 scale d * sc_j per 16 inputs; the weights are ggml's dequantization of the file bit for bit, and
    q8_linear multiplies by them (identity rows read them back) at every row count, under auto."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from k_quants import write_tensor

    raw = random_q6_k(64, 512)
    write_tensor(tmp_path / "q6_k.gguf", "output.weight", raw, GGMLQuantizationType.Q6_K)
    weights = read_gguf_blocks(tmp_path / "q6_k.gguf", ["output.weight"])["output.weight"]
    assert isinstance(weights, Int8Blocks) and weights.group == 16 and weights.scales.shape == (64, 32)
    assert np.array_equal(weights.dequantize().numpy(), dequantize(raw, GGMLQuantizationType.Q6_K))
    assert weights.planes() is None  # the int4 layout's blocks are 32: torch's kernel cannot hold it
    if not cpu_kernels.load():
        pytest.skip("specstream's CPU kernels did not build (no g++)")
    packed = quant.PackedInt8Blocks(weights, torch.device("cpu"))
    assert packed.scales.shape == (4, 32, 16)
    assert torch.equal(packed(torch.eye(512)).t(), weights.dequantize())
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 3, 4, 5, 9, 13):  # float32 chains, one sum a row, bfloat16 pairs, two passes
        x = torch.randn(rows, 512, generator=gen)
        # float32 sums in another order than the matmul's, outputs up to ~60 here: 1e-5 relative is not enough alone
        torch.testing.assert_close(packed(x), x @ weights.dequantize().t(), rtol=1e-5, atol=1e-4)
        xb = x.bfloat16()
        torch.testing.assert_close(packed(xb), (xb.float() @ weights.dequantize().t()).bfloat16(), rtol=1e-2, atol=1e-2)
    lin = LinearFactory("auto", torch.float32, torch.device("cpu"), {"w": weights})(["w"], torch.zeros(64, 512))
    assert lin.packed.kernel[0] == "q8" and torch.equal(lin.dense, weights.dequantize())


def random_int8_blocks(n: int, k: int, seed: int = 0) -> Int8Blocks:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    codes[0, :4] = torch.tensor([-128, 127, -1, 0], dtype=torch.int8)
    return Int8Blocks(codes, (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-4).half().float())


@pytest.mark.parametrize("k", [128, 96, 576])  # 96: a tail of half a vector group; 576: the bundled model's
def test_8bit_block_kernel_multiplies_by_the_files_weights(k):
    """specstream's q8_linear kernel (cpu_kernels.py) weighs by exactly d * c (identity rows read them back)
    and sums in float32, at every row count a step has (float32 passes of up to 8 rows, bfloat16 pair passes
    of up to 12 from 5 rows, and what is left)."""
    if not cpu_kernels.load():
        pytest.skip("specstream's CPU kernels did not build (no g++)")
    blocks = random_int8_blocks(80, k)
    packed = quant.PackedInt8Blocks(blocks, torch.device("cpu"))
    assert packed.kernel[0] == "q8" and packed.nbytes == 80 * k + 80 * (k // 32) * 4
    assert torch.equal(packed(torch.eye(k)).t(), blocks.dequantize())
    assert torch.equal(packed(torch.eye(k, dtype=torch.bfloat16)).t(), blocks.dequantize().bfloat16())
    for rows in (1, 2, 3, 4, 5, 8, 9, 12, 13, 16, 25):
        x = torch.randn(rows, k)
        assert_float32_sums(packed(x), x, blocks.dequantize())
        xb = x.bfloat16()
        # bfloat16 x: products exact, sums in float32, rounded once: within a bfloat16 step of the float32 result
        want = xb.float() @ blocks.dequantize().t()
        torch.testing.assert_close(packed(xb).float(), want, rtol=2**-8, atol=1e-4)
    assert packed(torch.randn(0, k)).shape == (0, 80)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.specstream.q8_linear(torch.randn(1, 40), torch.zeros(1, 20, 32, dtype=torch.int8), torch.ones(1, 1, 16))
    assert not quant.PackedInt8Blocks.fits(random_int8_blocks(72, k))  # not whole tiles of 16 outputs


@pytest.mark.parametrize("built", [True, False])
def test_8bit_source_blocks_take_the_q8_kernel_where_it_builds_else_two_int4_planes(monkeypatch, built):
    if built and not cpu_kernels.load():
        pytest.skip("specstream's CPU kernels did not build (no g++)")
    monkeypatch.setattr(cpu_kernels, "_loaded", built)  # after loading: True alone would not load the library
    blocks = random_int8_blocks(64, 128)
    factory = LinearFactory("auto", torch.float32, torch.device("cpu"), {"lm_head.weight": blocks})
    lin = factory(["lm_head.weight"], torch.zeros(64, 128))
    assert lin.packed.kernel[0] == ("q8" if built else "int4x2") and factory.kernel_kinds == [lin.packed.kernel[0]]
    assert torch.equal(lin.dense, blocks.dequantize())  # both routes serve the file's weights
    x = torch.randn(3, 128)
    torch.testing.assert_close(lin.packed(x), torch.nn.functional.linear(x, lin.dense), rtol=1e-5, atol=1e-5)


def test_int4_kernel_in_bfloat16_reads_bfloat16_scales():
    weights = random_int4()
    packed = PackedInt4(weights, torch.bfloat16, torch.device("cpu"))
    seen = packed(torch.eye(weights.codes.shape[1], dtype=torch.bfloat16)).t().float()
    assert torch.equal(seen, quant._effective_int4(weights, torch.bfloat16).bfloat16().float())


def test_quantize_rounds_each_weight_to_the_nearest_of_16_levels():
    weight = torch.randn(48, 96)
    q = Int4Weights.quantize(weight)
    assert q.codes.max() <= 15 and q.scales.shape == (48, 3)
    err = (q.dequantize() - weight).abs()
    # half a step, plus the float16 rounding of the group's minimum and scale
    slack = (q.mins.abs() + 15 * q.scales) * 2**-10
    assert (err <= (q.scales / 2 + slack).repeat_interleave(32, 1)).all()
    assert torch.equal(q.scales, q.scales.half().float()) and torch.equal(q.mins, q.mins.half().float())


def test_int8_kernel_matches_its_dequantized_weight():
    weight = torch.randn(64, 96)
    packed = PackedInt8(weight, torch.float32, torch.device("cpu"))
    x = torch.randn(5, 96)
    dense = packed.codes.float() * packed.scales[:, None]
    torch.testing.assert_close(packed(x), x @ dense.t(), rtol=1e-5, atol=1e-5)


def test_linear_routes_by_rows_and_both_kernels_serve_the_same_weight():
    factory = LinearFactory("int4", torch.float32, torch.device("cpu"))
    weight = torch.randn(64, 128)
    lin = factory(["w"], weight)
    lin.max_packed_rows = 2
    x = torch.randn(5, 128)
    torch.testing.assert_close(lin(x[:2]), lin.packed(x[:2]))
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.packed(x), lin(x), rtol=1e-5, atol=1e-5)


def test_a_tied_embedding_keeps_its_values_when_the_head_is_quantized():
    embed = torch.randn(64, 96)
    before = embed.clone()
    factory = LinearFactory("int4", torch.float32, torch.device("cpu"), shared=(embed,))
    head = factory(["lm_head.weight"], embed)
    assert torch.equal(embed, before) and head.dense.data_ptr() != embed.data_ptr()


def test_kernel_choice_keeps_what_it_routes_to():
    factory = LinearFactory("int4", torch.bfloat16, torch.device("cpu"))
    lin = factory(["w"], torch.randn(256, 256, dtype=torch.bfloat16))
    (choice,) = routes.choose_kernels(factory.built, 64, torch.bfloat16, torch.device("cpu"))
    assert choice.max_packed_rows == lin.max_packed_rows
    assert (lin.packed is None) == (choice.max_packed_rows == 0)
    assert (lin.dense is None) == (not choice.keeps_dense)
    assert lin(torch.randn(3, 256, dtype=torch.bfloat16)).shape == (3, 256)


def test_kernel_routes_timed_once_are_replayed_from_their_file(tmp_path, monkeypatch):
    """A restart reads the routes the first start timed: no timing, and the same kernels (so the same
    bf16 rounding) as before. A damaged file is timed again."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(256, 256, dtype=torch.bfloat16))  # what release_unused frees

    def build():
        factory = LinearFactory("int4", torch.bfloat16, torch.device("cpu"))
        factory(["w"], torch.randn(256, 256, dtype=torch.bfloat16))
        return factory

    path = tmp_path / "routes.json"
    first = routes.settle(build(), model, 64, routes_file=path)
    assert routes.load_routes(path) == {"256x256": first[0].max_packed_rows}
    monkeypatch.setattr(routes, "_faster_packed", lambda *args: pytest.fail("timed again"))
    second = routes.settle(build(), model, 64, routes_file=path)
    assert [c.max_packed_rows for c in second] == [c.max_packed_rows for c in first]
    path.write_text('{"256x256": "many"}')
    assert routes.load_routes(path) is None
    monkeypatch.setattr(routes, "_faster_packed", lambda *args: True)
    (third,) = routes.settle(build(), model, 64, routes_file=path)
    assert third.max_packed_rows == 1 << 30 and routes.load_routes(path) == {"256x256": 1 << 30}


def test_a_shape_the_kept_routes_do_not_name_is_timed_once_and_kept_beside_them(tmp_path, monkeypatch):
    """A kept routes file without a shape (written by a start whose routes were not timed, or before the model had
    the shape) has that shape timed and added to it: the start after that times nothing."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(256, 256, dtype=torch.bfloat16))

    def build():
        factory = LinearFactory("int4", torch.bfloat16, torch.device("cpu"))
        factory(["w"], torch.randn(256, 256, dtype=torch.bfloat16))
        return factory

    path = tmp_path / "routes.json"
    routes.save_routes(path, {"64x64": 8})
    monkeypatch.setattr(routes, "_faster_packed", lambda group, x: x.shape[0] <= 16)
    (first,) = routes.settle(build(), model, 64, routes_file=path)
    assert first.max_packed_rows == 16 and routes.load_routes(path) == {"64x64": 8, "256x256": 16}
    monkeypatch.setattr(routes, "_faster_packed", lambda *args: pytest.fail("timed again"))
    (second,) = routes.settle(build(), model, 64, routes_file=path)
    assert second.max_packed_rows == 16


def test_auto_quantization_is_the_default_for_the_engine_and_serve(monkeypatch):
    from gateway.cli import build_parser

    monkeypatch.delenv("SPECSTREAM_QUANTIZATION", raising=False)
    assert EngineConfig().quantization == "auto"
    assert build_parser().parse_args(["serve"]).quantization == "auto"
    assert build_parser().parse_args(["serve", "--quantization", "none"]).quantization == "none"
    assert build_parser().parse_args(["serve", "--quantization", "int4"]).quantization == "int4"


def test_unknown_quantization_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int3")


def engine(model, method="off", quantization="int4", k=5):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, adaptive=False)
    config = EngineConfig(model=str(model), dtype="float32", speculative=spec, quantization=quantization)
    return Engine(config, log=False)


@pytest.mark.parametrize("kernels", ["measured", "packed for every step"])
def test_int4_greedy_speculative_equals_plain_alone_and_batched(tiny_model_dir, monkeypatch, kernels):
    if kernels != "measured":
        monkeypatch.setattr(routes, "choose_kernels", lambda *args: [])
    plain, spec = engine(tiny_model_dir), engine(tiny_model_dir, "ngram")
    if kernels != "measured":
        assert all(layer[1].max_packed_rows > 64 for layer in spec.runner.fast.layers)
    expected = [plain.generate(p, GREEDY)[0].token_ids for p in PROMPTS]
    assert [spec.generate(p, GREEDY)[0].token_ids for p in PROMPTS] == expected
    batched = spec.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in batched] == expected
    assert sum(o.stats.accepted for o in batched) > 0
    dense = engine(tiny_model_dir, quantization="none")
    assert [o.token_ids for o in dense.generate(PROMPTS, GREEDY)] != expected  # the weights did change


def test_gguf_int4_blocks_are_the_files_weights_bit_for_bit(default_model_source):
    from specstream.model.loader import gguf_file, load_model

    model = load_model(default_model_source)  # float32, dequantized from the same file by gguf-py
    source = source_int4_weights(gguf_file(default_model_source), model.config)
    params = dict(model.named_parameters())
    params["lm_head.weight"] = model.get_output_embeddings().weight  # tied: the Q8_0 embedding
    assert len(source) == 7 * model.config.num_hidden_layers + 1
    assert isinstance(source["lm_head.weight"], Int8Blocks)
    for name, weights in source.items():
        assert torch.equal(weights.dequantize(), params[name]), name
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    packed = PackedInt4(source[o_proj], torch.float32, torch.device("cpu"))
    assert torch.equal(packed(torch.eye(params[o_proj].shape[1])).t(), params[o_proj])


def test_default_model_int4_greedy_speculative_equals_plain_batched(monkeypatch):
    # Kept cheap: few tokens, and no kernel timing at start-up (covered on the tiny model above). Single
    # rows (decoding) take the packed int4 kernel, longer calls the dense copy, which serves the same
    # weights bit for bit in float32, so plain decoding and speculative verification must still agree.
    def route_single_rows_packed(linears, *args):
        for lin in linears:
            lin.max_packed_rows = 1
        return []

    monkeypatch.setattr(routes, "choose_kernels", route_single_rows_packed)
    prompts = [
        [{"role": "user", "content": "Rewrite in the past tense: The cat sits on the mat and the dog runs."}],
        [{"role": "user", "content": "What is the capital of France?"}],
    ]
    params = SamplingParams(max_tokens=8, temperature=0)
    config = dict(dtype="float32", quantization="int4")
    plain = Engine(EngineConfig(**config, speculative=SpeculativeConfig(method="off")), log=False)
    ngram = SpeculativeConfig(num_speculative_tokens=6, adaptive=False)
    spec = Engine(EngineConfig(**config, speculative=ngram), log=False)
    want = [plain.generate(p, params)[0].token_ids for p in prompts]
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert sum(o.stats.accepted for o in got) > 0
    assert isinstance(spec.runner.fast.lm_head, Linear) and spec.runner.fast.lm_head.shape == (49152, 576)


def test_projections_built_once_are_loaded_from_their_kept_file_and_built_again_when_damaged(monkeypatch, caplog):
    """A restart loads the projections an earlier start built (kernels/kept_weights.py) without reading
    the source's blocks, and they serve the same logits; a truncated file is built again, never loaded."""
    from specstream.engine.builder import EngineBuilder
    from specstream.kernels.kept_weights import KeptWeights
    from specstream.model.loader import resolve_model
    from specstream.model.runner import ForwardItem

    def fixed_routes(linears, *args):
        for lin in linears:
            lin.max_packed_rows = 1
        return []

    def logits(engine) -> torch.Tensor:
        table: list[int] = []
        assert engine.pool.reserve(table, 13)
        try:
            return torch.cat([engine.runner.forward([ForwardItem(table, 0, list(range(100, 112)), 12)]),
                              engine.runner.forward([ForwardItem(table, 12, [7], 1)])])  # fmt: skip
        finally:
            engine.pool.free(table)

    monkeypatch.setattr(routes, "choose_kernels", fixed_routes)
    config = EngineConfig(dtype="float32", speculative=SpeculativeConfig(method="off"))
    path = EngineBuilder(config).kept_projections(resolve_model(config.model))
    path.unlink(missing_ok=True)
    want = logits(Engine(config, log=False))
    assert KeptWeights(path, torch.device("cpu")).found

    def no_source(*args):
        raise AssertionError("the source's blocks were read again")

    with monkeypatch.context() as m:
        m.setattr(quant, "source_int4_weights", no_source)
        assert torch.equal(logits(Engine(config, log=False)), want)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated
    with caplog.at_level("WARNING", logger="specstream.kernels.kept_weights"):
        assert torch.equal(logits(Engine(config, log=False)), want)
    assert "cannot be read" in caplog.text and KeptWeights(path, torch.device("cpu")).found  # written again


def test_a_gguf_file_with_q4_k_tensors_is_served_by_the_block_kernel_and_speculation_stays_lossless(tmp_path):
    """The path a user's Q4_K_M file takes: the bundled GGUF copied with its 30 ffn_down tensors (1536 inputs, whole
    super-blocks) stored as Q4_K, loaded by its path. Those projections are served by q4_linear with float32
    scales, holding the file's weights (gguf's own dequantization), and greedy speculation gives plain decoding's
    tokens (fp32, eager)."""
    if not cpu_kernels.load():
        pytest.skip("specstream's CPU kernels did not build (no g++)")
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    from k_quants import copy_with_q4_k
    from specstream.model.loader import BUNDLED_MODELS, bundled_gguf_path

    path = tmp_path / "smollm2-q4_k.gguf"
    converted = copy_with_q4_k(bundled_gguf_path(BUNDLED_MODELS["smollm2-135m"]), path, lambda name, shape: ".ffn_down." in name)
    assert len(converted) == 30
    engine = Engine(EngineConfig(model=str(path), dtype="float32", compile=False,
                                 speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=6, adaptive=False)), log=False)
    downs = [layer[5] for layer in engine.runner.fast.layers]
    assert all(d.packed.kernel[0] == "q4" and d.packed.scales.dtype == torch.float32 for d in downs)
    assert all(layer[1].packed.scales.dtype == torch.float16 for layer in engine.runner.fast.layers)  # Q4_1 as before
    stored = next(t for t in GGUFReader(path).tensors if t.name == "blk.3.ffn_down.weight")
    assert stored.tensor_type == GGMLQuantizationType.Q4_K
    file_weights = torch.from_numpy(dequantize(stored.data, stored.tensor_type).reshape(576, 1536))
    assert torch.equal(downs[3].packed(torch.eye(1536)).t(), file_weights)
    prompts = [
        [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog, twice."}],
        [{"role": "user", "content": "What is the capital of France?"}],
    ]
    plain = SamplingParams(max_tokens=12, temperature=0, num_speculative_tokens=0)
    want = [engine.generate(p, plain)[0].token_ids for p in prompts]
    got = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert [o.token_ids for o in got] == want
    assert sum(o.stats.accepted for o in got) > 0


def test_one_noisy_timing_does_not_end_the_packed_kernels_range(monkeypatch):
    """The packed kernel serves up to the last row count where it wins before the dense GEMM wins two
    counts in a row: a single loss (a timing taken while the machine was busy) does not end its range."""

    def route(losing_rows: set[int]) -> tuple[int, list[int]]:
        factory = LinearFactory("int4", torch.bfloat16, torch.device("cpu"))
        factory(["w"], torch.randn(256, 256, dtype=torch.bfloat16))
        asked = []
        monkeypatch.setattr(routes, "_faster_packed", lambda group, x: asked.append(x.shape[0]) or x.shape[0] not in losing_rows)
        (choice,) = routes.choose_kernels(factory.built, 64, torch.bfloat16, torch.device("cpu"))
        return choice.max_packed_rows, asked

    every = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]
    assert route({12}) == (1 << 30, every)  # one loss, then wins to the last count: packed at every size
    assert route({12, 64}) == (48, every)  # lost at the last count: the range ends before it
    assert route({12, 24, 32}) == (16, every[:8])  # two losses in a row end it
    assert route({1, 2}) == (0, [1, 2])  # the dense GEMM wins from the start: no packed route
    assert route({1, 4}) == (1 << 30, every)


def test_a_floor_extends_the_packed_range_that_timing_or_a_kept_route_ends_earlier(monkeypatch, tmp_path):
    """floors: a shape's packed range runs at least that many rows (capped at the largest step) where timing, or a
    route kept from an earlier start, would end it earlier; a shape the packed kernel never wins stays dense."""

    def route(losing_rows: set[int], floors, routes_file=None) -> int:
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.zeros(256, 256, dtype=torch.bfloat16))  # what release_unused frees
        factory = LinearFactory("int4", torch.bfloat16, torch.device("cpu"))
        factory(["w"], torch.randn(256, 256, dtype=torch.bfloat16))
        monkeypatch.setattr(routes, "_faster_packed", lambda group, x: x.shape[0] not in losing_rows)
        (choice,) = routes.settle(factory, model, 128, routes_file=routes_file, floors=floors)
        return choice.max_packed_rows

    losing = {24, 32, 48, 64, 96, 128}
    assert route(losing, None) == 16
    assert route(losing, {(256, 256): 64}) == 64
    assert route(losing, {(256, 256): 8}) == 16  # a floor never shortens a range
    assert route(losing, {(128, 256): 64}) == 16  # another shape's floor
    assert route({1, 2}, {(256, 256): 64}) == 0  # the dense GEMM wins from one row: no packed route to extend
    assert route(losing, {(256, 256): 1000}) == 1 << 30  # past the largest step: packed serves every step
    kept = tmp_path / "routes.json"
    routes.save_routes(kept, {"256x256": 16})
    assert route(set(), {(256, 256): 64}, kept) == 64  # a kept route is extended as a timed one is


def test_the_decoder_layers_keep_the_packed_kernels_up_to_the_compiled_steps_rows_on_amx_tiles(tiny_model_dir, monkeypatch):
    """Where the block kernels multiply on AMX tiles, the layers' projections (not the LM head) get a floor of
    COMPILED_MAX_ROWS, so the compiled forward serves every step up to it; elsewhere, none."""
    from specstream.engine.builder import EngineBuilder
    from specstream.model import fast_llama
    from specstream.model.fast_llama import FastLlama

    builder = EngineBuilder(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", quantization="int4"))
    q4 = types.SimpleNamespace(kernel=("q4",))
    layer = (None, *(types.SimpleNamespace(packed=q4, shape=s) for s in [(96, 64), (64, 64)]), None,
             *(types.SimpleNamespace(packed=q4, shape=s) for s in [(256, 64), (64, 128)]))
    dense = types.SimpleNamespace(packed=None, shape=(32, 32))
    layers = [layer, (None, dense, dense, None, dense, dense)]
    runner = types.SimpleNamespace(fast=types.SimpleNamespace(layers=layers))
    runner.fast.layer_projections = lambda: FastLlama.layer_projections(runner.fast)
    monkeypatch.setattr(cpu_kernels, "block_tiles", lambda: True)
    floors = builder.packed_floors(runner)
    assert floors == {s: fast_llama.COMPILED_MAX_ROWS for s in [(96, 64), (64, 64), (256, 64), (64, 128)]}
    monkeypatch.setattr(cpu_kernels, "block_tiles", lambda: False)
    assert builder.packed_floors(runner) == {}


def test_4bit_block_kernel_gives_each_row_of_a_16_row_call_the_bits_it_gets_alone():
    """--deterministic pads every call to whole tiles of 16 rows, and a row's bits must not depend on where in
    the tile it sits: the kernel's passes over a call's rows sum each row in an order that depends on the pass's
    row count. In passes of 12 and 4, rows 12-15 of a verification were summed as 4 chains and a decode step's
    row as 1, and once in a while the two rounded to different bfloat16 (a greedy token then differed with and
    without drafts). float32 rows show any change of order in their bits (before: rows 12-15 of every tile)."""
    if not cpu_kernels.load():
        pytest.skip("specstream's CPU kernels did not build (no g++)")
    packed = quant.PackedQ4(random_int4(256, 1536), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for tile in torch.randn(4, 16, 1536, generator=gen).to(dtype):
            full = packed(tile)
            for r in range(16):
                alone = torch.zeros_like(tile)
                alone[0] = tile[r]
                assert torch.equal(packed(alone)[0], full[r]), (dtype, r)


@pytest.mark.parametrize("bits", [4, 8])
def test_block_kernels_asked_for_rows_alone_give_a_row_the_same_bits_at_every_row_count(bits):
    """quant.ROWS_ALONE (--deterministic without padding): the block kernels then take one path and one summation
    order at every row count, so a row's outputs in a call of 2-33 rows are the bits it gets alone. Without it a few
    rows take float32 or several chains, and a row alone rounds differently (float32 x shows any change of order)."""
    if not cpu_kernels.load():
        pytest.skip("specstream's CPU kernels did not build (no g++)")
    device = torch.device("cpu")
    packed = quant.PackedQ4(random_int4(96, 512), device) if bits == 4 else quant.PackedInt8Blocks(random_int8_blocks(96, 512), device)
    linear = Linear(["w"], None, packed)
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(33, 512, generator=gen).to(dtype)
        before = [project(packed.kernel, x[: n])[n - 1] for n in range(1, 34)]
        assert linear.rows_alone() and packed.kernel[-1] == quant.ROWS_ALONE
        alone = [project(packed.kernel, x[r : r + 1])[0] for r in range(33)]
        for n in (2, 3, 4, 5, 9, 12, 13, 16, 17, 33):
            y = project(packed.kernel, x[:n])
            assert all(torch.equal(y[r], alone[r]) for r in range(n)), (dtype, n)
        # the same weights either way: only the order of the sums moved
        torch.testing.assert_close(torch.stack(before), torch.stack(alone), rtol=2e-2, atol=2e-2)
        packed.kernel = packed.kernel[:-1]


def test_only_the_block_kernels_serving_every_call_compute_rows_alone():
    """Linear.rows_alone: a dense route (some calls through the GEMM) or torch's int4 kernel cannot, and say so."""
    dense = Linear(["w"], torch.randn(32, 64))
    assert not dense.rows_alone()
    routed = Linear(["w"], torch.randn(96, 512), quant.PackedQ4(random_int4(96, 512), torch.device("cpu")))
    routed.max_packed_rows = 16
    assert not routed.rows_alone()
    torch_int4 = Linear(["w"], None, PackedInt4(random_int4(96, 512), torch.float32, torch.device("cpu")))
    assert not torch_int4.rows_alone()
