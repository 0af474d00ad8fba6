"""The a8 kernel (kernels/csrc/a8_linear.cpp, quant.PackedA8): GGUF blocks times x rounded to 8-bit blocks, summed
as integers. Each instruction path (scalar, AVX2/AVX-VNNI, AVX512-VNNI, AMX-INT8) is checked where this CPU and
build have it: the integer part bit for bit against NumPy, the float part against a float64 reference, the
paths against each other bit for bit, and a row's output independent of the rows beside it."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.kernels import cpu as cpu_kernels
from specstream.kernels import quant, routes
from specstream.kernels.quant import PackedA8
from specstream.kernels.weights import Int4Weights, Int8Blocks, q4_k_weights, q6_k_weights

PATHS = {0: "scalar", 1: "avx2", 2: "avx512_vnni", 3: "amx_int8"}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def paths() -> list[int]:
    if not cpu_kernels.load():
        pytest.skip("specstream's CPU kernels did not build here (no C++ compiler): a8 cannot serve")
    listed = list(torch.ops.specstream.a8_paths())
    return listed[: listed.index(-1)]


def need(paths: list[int], path: int) -> None:
    if path not in paths:
        flag = PATHS[path]
        have = flag in Path("/proc/cpuinfo").read_text().split() if os.path.exists("/proc/cpuinfo") else False
        why = "the compiler did not take its flags" if have else f"this CPU has no {flag}"
        pytest.skip(f"a8's {flag} path is not available: {why}")


def a8(x: torch.Tensor, packed: PackedA8, path: int = -1) -> torch.Tensor:
    return torch.ops.specstream.a8_linear(x, packed.codes, packed.scales, packed.mins, path)


def int_weights(n: int, k: int, bits: int, seed: int, q4_0: bool = False, group: int = 32) -> Int4Weights | Int8Blocks:
    """Block weights with unit scales, so that y is the integer sum itself (exact in float32 here). group 16: 8-bit
    codes with a scale per 16 inputs (Q6_K's form)."""
    g = torch.Generator().manual_seed(seed)
    ones = torch.ones(n, k // 32)
    if bits == 8:
        return Int8Blocks(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), torch.ones(n, k // group))
    mins = -8 * ones if q4_0 else torch.zeros(n, k // 32)
    return Int4Weights(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), ones, mins)


def int_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """x whose 8-bit blocks are x itself: integers in -127..127 with 127 or -127 in every block (dx = 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (m, k), generator=g).float()
    x.view(m, -1, 32)[:, :, 5] = torch.where(torch.rand(m, k // 32, generator=g) < 0.5, 127.0, -127.0)
    return x


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("bits", [4, 8, "q4_0", "q6_k"])
def test_integer_sums_match_numpy_bit_for_bit(paths, path, bits):
    need(paths, path)
    m, n, k = 17, 48, 160  # 17 rows: two AMX passes (16 + 1), two VNNI ones (8 + 9)
    w = int_weights(n, k, 4 if bits in (4, "q4_0") else 8, seed=1, q4_0=bits == "q4_0", group=16 if bits == "q6_k" else 32)
    x = int_activations(m, k, seed=2)
    codes = w.codes.numpy().astype(np.int64)
    want = x.numpy().astype(np.int64) @ codes.T  # exact
    if bits == "q4_0":
        want -= 8 * x.numpy().astype(np.int64).sum(1, keepdims=True)  # the block minimum m = -8 d
    got = a8(x, PackedA8(w, CPU), path)
    assert np.array_equal(got.numpy().astype(np.int64), want)


def numpy_quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8-bit blocks of x as the kernel defines them, in float32 NumPy."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).clip(-127, 127).astype(np.int8)
    return q.reshape(x.shape), (amax / np.float32(127)).astype(np.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_activation_blocks_match_numpy_bit_for_bit(paths, dtype):
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[0, :32] = 0  # an all-zero block: dx 0, codes 0
    q, dx = torch.ops.specstream.a8_quantize(x)
    want_q, want_dx = numpy_quantize(x.float().numpy())
    assert np.array_equal(q.numpy(), want_q) and np.array_equal(dx.numpy(), want_dx)


def reference(x: torch.Tensor, w: Int4Weights | Int8Blocks) -> torch.Tensor:
    """The kernel's sum in float64 (the float steps in exact arithmetic)."""
    q, dx = torch.ops.specstream.a8_quantize(x)
    m, k = x.shape
    group = k // w.scales.shape[1]  # 32, or 16 (8-bit codes with a scale per 16: Q6_K)
    qb = q.double().view(m, k // group, group)
    c = w.codes.double().view(w.codes.shape[0], -1, group)
    dxg = dx.double().repeat_interleave(32 // group, dim=1)
    y = (torch.einsum("mgj,ngj->mng", qb, c) * dxg[:, None] * w.scales.double()[None]).sum(-1)
    qb = q.double().view(m, k // 32, 32)
    if isinstance(w, Int4Weights):
        y += (w.mins.double()[None] * (dx.double() * qb.sum(-1))[:, None]).sum(-1)
    return y


def realistic(n: int, k: int, kind: str, seed: int) -> Int4Weights | Int8Blocks:
    if kind == "q6_k":  # super-blocks of 256: 6-bit codes less 32, a float32 scale per 16
        rng = np.random.default_rng(seed)
        raw = rng.integers(0, 256, size=(n * k // 256, 210), dtype=np.uint8)
        raw[:, 208:210] = np.float16(rng.uniform(2e-5, 2e-4, size=len(raw))).view(np.uint8).reshape(-1, 2)
        weights = q6_k_weights(raw.reshape(n, -1))
        assert weights.group == 16
        return weights
    if kind == "q4_k":  # super-blocks of 256: float32 scales and mins (float16 cannot hold them)
        rng = np.random.default_rng(seed)
        raw = rng.integers(0, 256, size=(n * k // 256, 144), dtype=np.uint8)
        for start in (0, 2):
            raw[:, start : start + 2] = np.float16(rng.uniform(1e-4, 2e-3, size=len(raw))).view(np.uint8).reshape(-1, 2)
        weights = q4_k_weights(raw.reshape(n, -1))
        assert quant.block_scale_dtype(weights.scales, weights.mins) == torch.float32
        return weights
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if kind == "q8_0":
        return Int8Blocks.quantize(w, torch.float16)
    int4 = Int4Weights.quantize(w)
    if kind == "q4_0":  # symmetric: m = -8 d
        d = (w.view(n, -1, 32).abs().amax(-1) / 8).half().float()
        codes = (w.view(n, -1, 32) / d[..., None]).round().clamp(-8, 7) + 8
        int4 = Int4Weights(codes.to(torch.uint8).view(n, k), d, -8 * d)
    return int4


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_path_gives_the_same_bits_and_the_reference_sum(paths, kind, dtype):
    n, k = 96, 768
    w = realistic(n, k, kind, seed=4)
    packed = PackedA8(w, CPU)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(5)).to(dtype)
    outs = {p: a8(x, packed, p) for p in paths}
    first = outs[paths[0]]
    assert all(torch.equal(o, first) for o in outs.values()), [p for p, o in outs.items() if not torch.equal(o, first)]
    want = reference(x.float(), w)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((first.double() - want).abs().max() / want.abs().max()).item() < tol
    dense = x.float() @ w.dequantize().t()  # and close to the unrounded product: x lost only its 8-bit rounding
    assert ((first.float() - dense).abs().max() / dense.abs().max()).item() < 0.03


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["q4_1", "q4_k", "q6_k"])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it(paths, dtype, kind):
    w = realistic(64, 1536, kind, seed=6)
    packed = PackedA8(w, CPU)
    x = torch.randn(27, 1536, generator=torch.Generator().manual_seed(7)).to(dtype)
    alone = torch.cat([a8(x[i : i + 1], packed) for i in range(27)])
    for rows in (2, 4, 9, 12, 13, 16, 27):  # one pass of each kind (1-3 rows: two sums a row), two, three
        assert torch.equal(a8(x[:rows], packed), alone[:rows])
    assert torch.equal(a8(x.flip(0), packed).flip(0), alone)  # other neighbours, other positions


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
def test_past_16_rows_the_tiles_unpack_each_weight_once_and_give_the_same_bits(paths, kind):
    """Past 16 rows of 4-bit codes the AMX path runs every pass of 16 rows over a group of output tiles, the first pass
    unpacking the codes and the others reading them back: the same bits as every other path, across groups and threads
    (64 tiles of outputs over 48 blocks: 10 tiles a group)."""
    n, k = 1024, 1536
    packed = PackedA8(realistic(n, k, kind, seed=8), CPU)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(9)).bfloat16()
    outs = {p: a8(x, packed, p) for p in paths}
    first = outs[paths[0]]
    assert all(torch.equal(o, first) for o in outs.values()), [p for p, o in outs.items() if not torch.equal(o, first)]
    assert torch.equal(first[17:33], a8(x[17:33], packed))  # rows 17-32 alone, one pass of 16


def test_the_dispatcher_lists_what_this_cpu_has_and_refuses_the_rest(paths):
    flags = set(Path("/proc/cpuinfo").read_text().split()) if os.path.exists("/proc/cpuinfo") else set()
    assert 0 in paths and set(paths) <= set(PATHS)
    if "avx512_vnni" in flags:
        assert 2 in paths
    if "amx_int8" in flags:
        assert 3 in paths
    missing = [p for p in PATHS if p not in paths]
    w = realistic(16, 32, "q4_1", seed=8)
    for path in missing:
        with pytest.raises(RuntimeError, match="not available"):
            a8(torch.randn(1, 32), PackedA8(w, CPU), path)
    assert a8(torch.randn(1, 32), PackedA8(w, CPU)).shape == (1, 16)
    # a fast path wherever the CPU has an integer dot product (this build's compiler takes every flag)
    assert quant.a8_serves(CPU) == bool({"avx512_vnni", "amx_int8", "avx_vnni"} & flags)


def test_a_compiler_without_the_flags_builds_without_that_path_and_says_so_once(tmp_path, caplog):
    fake = tmp_path / "old-g++"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in -mamx-*) echo "unrecognized $a" >&2; exit 1;; esac; done\nexit 0\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    flags = "flags : fpu avx2 avx512f avx512_vnni amx_tile amx_int8 avx_vnni"
    with caplog.at_level(logging.WARNING, logger="specstream.kernels.cpu"):
        got = cpu_kernels.int8_dot_flags(str(fake), avx512=True, cpu_flags=flags)
    assert got == ["-mavx512vnni", "-mavxvnni"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "-mamx-tile -mamx-int8" in lines[0] and "amx_int8" in lines[0]
    # a CPU without the instructions asks for no flags, and logs nothing
    caplog.clear()
    assert cpu_kernels.int8_dot_flags(str(fake), avx512=False, cpu_flags="flags : fpu avx2 avx512_vnni") == []
    assert not caplog.records


def test_bad_shapes_are_refused_with_a_clear_error(paths):
    packed = PackedA8(realistic(16, 64, "q4_1", seed=9), CPU)
    with pytest.raises(RuntimeError, match="a8_linear"):
        torch.ops.specstream.a8_linear(torch.randn(2, 32), packed.codes, packed.scales, packed.mins)
    with pytest.raises(RuntimeError, match="mins"):
        torch.ops.specstream.a8_linear(torch.randn(2, 64), packed.codes, packed.scales, torch.empty(0, dtype=torch.half))
    assert a8(torch.randn(0, 64), packed).shape == (0, 16)


GREEDY = SamplingParams(max_tokens=12, temperature=0)


def projections(engine: Engine) -> list[quant.Linear]:
    fast = engine.runner.fast
    return [fast.lm_head] + [part for layer in fast.layers for part in layer if isinstance(part, quant.Linear)]


def kinds(engine: Engine) -> set[str]:
    return {lin.packed.kernel[0] if lin.packed is not None else "dense" for lin in projections(engine)}


def test_a8_rounds_a_dense_models_weights_to_8bit_blocks_and_speculation_stays_lossless(tiny_model_dir, paths):
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=5, adaptive=False)
    config = dict(model=str(tiny_model_dir), dtype="bfloat16", quantization="a8")
    plain = Engine(EngineConfig(**config, speculative=SpeculativeConfig(method="off")), log=False)
    ngram = Engine(EngineConfig(**config, speculative=spec), log=False)
    assert kinds(ngram) == {"a8"}
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11, 12, 9]]
    want = [plain.generate([p], GREEDY)[0].token_ids for p in prompts]
    got = ngram.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == want
    assert sum(o.stats.accepted for o in got) > 0


def test_routes_keep_a8_for_every_row_count_whatever_the_timings(tiny_model_dir, paths, monkeypatch):
    """a8 serves every call, untimed, and keeps no dense copy: a row's logits never depend on its step's row
    count (the dense GEMM's rounding would)."""
    monkeypatch.setattr(routes, "_faster_packed", lambda *args, **kw: False)  # dense "wins" everywhere
    engine = Engine(EngineConfig(model=str(tiny_model_dir), quantization="a8", speculative=SpeculativeConfig(method="off")), log=False)
    assert kinds(engine) == {"a8"}
    assert all(lin.max_packed_rows >= 1 << 30 and lin.dense is None for lin in projections(engine))


def test_default_model_under_a8_greedy_speculation_equals_plain(paths):
    """The bundled GGUF under a8: greedy speculation gives plain decoding's tokens (fp32, eager: decode and
    verification steps compute a row alike there)."""
    if not quant.a8_serves(CPU):
        pytest.skip("this CPU has no integer dot-product instruction (AVX512-VNNI, AMX-INT8, AVX-VNNI)")
    prompts = [
        [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog, twice."}],
        [{"role": "user", "content": "What is the capital of France?"}],
    ]
    params = SamplingParams(max_tokens=10, temperature=0)
    config = dict(dtype="float32", compile=False, quantization="a8")
    plain = Engine(EngineConfig(**config, speculative=SpeculativeConfig(method="off")), log=False)
    assert kinds(plain) == {"a8"}
    spec = Engine(EngineConfig(**config, speculative=SpeculativeConfig(num_speculative_tokens=6, adaptive=False)), log=False)
    want = [plain.generate(p, params)[0].token_ids for p in prompts]
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert sum(o.stats.accepted for o in got) > 0


def test_auto_keeps_the_weight_only_kernels(default_model_source, paths):
    engine = Engine(EngineConfig(dtype="float32", compile=False, speculative=SpeculativeConfig(method="off")), log=False)
    assert "a8" not in kinds(engine) and "q4" in kinds(engine)
