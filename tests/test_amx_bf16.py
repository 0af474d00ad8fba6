"""The weight-only kernels' AMX-BF16 path (kernels/csrc/q4_linear.cpp, q8_linear.cpp): bfloat16 rows of x times the
file's 4- or 8-bit block weights on AMX tiles (TDPBF16PS), so that a verification's rows cost little more than a
decoded row's. Checked where this CPU and build have AMX-BF16 (skipped with the reason elsewhere): the tiles against
the vector path and a float64 reference at every row count a step has, the codes widened exactly (identity rows read
the weights back), the dispatcher's pick, and a clear error where the path cannot serve."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
import torch

from specstream.kernels import cpu as cpu_kernels
from specstream.kernels.quant import PackedInt8Blocks, PackedQ4
from specstream.kernels.weights import Int4Weights, Int8Blocks

CPU = torch.device("cpu")
VECTOR, AMX = 0, 1
# Rows from which each kernel picks the tiles (kAmxMinRows in its source).
Q4_AMX_MIN_ROWS, Q8_AMX_MIN_ROWS = 2, 2


def cpu_has(flag: str) -> bool:
    return os.path.exists("/proc/cpuinfo") and flag in Path("/proc/cpuinfo").read_text().split()


@pytest.fixture(scope="module")
def amx() -> None:
    if not cpu_kernels.load():
        pytest.skip("specstream's CPU kernels did not build here (no C++ compiler)")
    if AMX not in torch.ops.specstream.q4_paths():
        why = "the compiler did not take -mamx-bf16, or Linux refused the tiles" if cpu_has("amx_bf16") else "this CPU has no amx_bf16"
        pytest.skip(f"the weight-only kernels' AMX-BF16 path is not available: {why}")


def q4_weights(n: int, k: int, seed: int, f32_scales: bool = False) -> Int4Weights:
    """Q4_1-like blocks: float16 scales and minimums (float32 where f32_scales, as Q4_K's are served)."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    mins = -8 * scales + torch.randn(n, k // 32, generator=g) * 1e-3
    if not f32_scales:
        scales, mins = scales.half().float(), mins.half().float()
    return Int4Weights(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), scales, mins)


def q8_weights(n: int, k: int, seed: int) -> Int8Blocks:
    g = torch.Generator().manual_seed(seed)
    return Int8Blocks(torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, k // 32, generator=g) * 0.01)


def q4(x: torch.Tensor, p: PackedQ4, path: int = -1) -> torch.Tensor:
    return torch.ops.specstream.q4_linear(x, p.codes, p.scales, p.mins, path)


def q8(x: torch.Tensor, p: PackedInt8Blocks, path: int = -1) -> torch.Tensor:
    return torch.ops.specstream.q8_linear(x, p.codes, p.scales, path)


@pytest.mark.parametrize("n,k,f32_scales", [(64, 128, False), (48, 96, False), (32, 1536, False), (64, 256, True)])
def test_q4_tiles_multiply_by_the_files_weights_at_every_row_count(amx, n, k, f32_scales):
    w = q4_weights(n, k, seed=n + k, f32_scales=f32_scales)
    packed = PackedQ4(w, CPU)
    dense = w.dequantize().double()
    # identity rows read each weight back through the tiles: the codes are widened to bfloat16 exactly
    eye = torch.eye(k, dtype=torch.bfloat16)
    assert torch.equal(q4(eye[:16], packed, AMX).t(), w.dequantize()[:, :16].bfloat16())
    for rows in (1, 2, 3, 4, 5, 9, 15, 16, 17, 33):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        tiles, vector = q4(x, packed, AMX), q4(x, packed, VECTOR)
        reference = (x.double() @ dense.t()).bfloat16()
        # both paths sum exact products in float32 and round once to bfloat16: at most a last bit apart
        torch.testing.assert_close(tiles, reference, rtol=8e-3, atol=1e-3)
        torch.testing.assert_close(tiles, vector, rtol=8e-3, atol=1e-3)
        # the dispatcher: the tiles from Q4_AMX_MIN_ROWS rows of bfloat16 x, the vector path below
        assert torch.equal(q4(x, packed), tiles if rows >= Q4_AMX_MIN_ROWS else vector)
        assert torch.equal(packed(x), q4(x, packed))


@pytest.mark.parametrize("n,k", [(64, 128), (32, 576)])
def test_q8_tiles_multiply_by_the_files_weights_at_every_row_count(amx, n, k):
    w = q8_weights(n, k, seed=n + k)
    packed = PackedInt8Blocks(w, CPU)
    dense = w.dequantize().double()
    eye = torch.eye(k, dtype=torch.bfloat16)
    assert torch.equal(q8(eye[:16], packed, AMX).t(), w.dequantize()[:, :16].bfloat16())
    for rows in (1, 2, 3, 4, 5, 9, 16, 17, 40):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        tiles, vector = q8(x, packed, AMX), q8(x, packed, VECTOR)
        reference = (x.double() @ dense.t()).bfloat16()
        torch.testing.assert_close(tiles, reference, rtol=8e-3, atol=2e-3)
        torch.testing.assert_close(tiles, vector, rtol=8e-3, atol=2e-3)
        assert torch.equal(q8(x, packed), tiles if rows >= Q8_AMX_MIN_ROWS else vector)


def test_a_row_through_the_tiles_does_not_depend_on_the_rows_beside_it(amx):
    """Each row's sums are its own (a tile row is one row of x): row i of a 16-row call is row i alone, as tiles."""
    packed = PackedQ4(q4_weights(64, 576, seed=3), CPU)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    together = q4(x, packed, AMX)
    for i in (0, 7, 15):
        alone = q4(x[i : i + 1].expand(4, -1).contiguous(), packed, AMX)[0]
        assert torch.equal(together[i], alone)


@pytest.mark.parametrize("n,k", [(640, 1536), (1024, 576)])
def test_past_16_rows_every_pass_reads_the_codes_the_first_one_unpacked(amx, n, k):
    """Past 16 rows the tiles run in passes of 16 over a group of output tiles at a time, the first pass unpacking the
    codes and the others reading them back (common.h's bf16_tile_passes): each row is the row its own 16-row pass
    gives alone, bit for bit, across groups and threads (n: 40 and 64 tiles of outputs, several groups each)."""
    p4, p8 = PackedQ4(q4_weights(n, k, seed=n), CPU), PackedInt8Blocks(q8_weights(n, k, seed=k), CPU)
    for rows in (17, 31, 32, 40):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        for run in (lambda v: q4(v, p4, AMX), lambda v: q8(v, p8, AMX)):
            together = run(x)
            passes = torch.cat([run(x[m0 : m0 + 16].contiguous()) for m0 in range(0, rows, 16)])
            assert torch.equal(together, passes)


def test_the_tiles_refuse_what_they_cannot_serve_with_a_clear_error(amx):
    p4, p8 = PackedQ4(q4_weights(32, 64, seed=5), CPU), PackedInt8Blocks(q8_weights(32, 64, seed=6), CPU)
    with pytest.raises(RuntimeError, match="AMX path needs bfloat16 x"):
        q4(torch.randn(4, 64), p4, AMX)  # float32 x: the vector path's float32 sums only
    with pytest.raises(RuntimeError, match="AMX path needs bfloat16 x"):
        q8(torch.randn(4, 64), p8, AMX)
    with pytest.raises(RuntimeError, match="path -1, 0 or 1"):
        q4(torch.randn(4, 64).bfloat16(), p4, 2)
    # float32 x never takes the tiles: the same bits as the vector path at any row count
    x = torch.randn(9, 64)
    assert torch.equal(q4(x, p4), q4(x, p4, VECTOR)) and torch.equal(q8(x, p8), q8(x, p8, VECTOR))


def test_the_build_asks_for_amx_bf16_where_the_cpu_has_it():
    flags = "flags : fpu avx2 avx512f avx512_vnni amx_tile amx_int8 amx_bf16 avx_vnni"
    got = cpu_kernels.int8_dot_flags("g++", avx512=True, cpu_flags=flags)
    if not got:
        pytest.skip("g++ is missing or takes none of the flags")
    assert "-mamx-bf16" in got and got.count("-mamx-tile") == 1
    assert "-mamx-bf16" not in cpu_kernels.int8_dot_flags("g++", avx512=True, cpu_flags="flags : fpu avx2 avx512f amx_int8")


def test_a_compiler_without_amx_bf16_builds_the_vector_path_and_says_so_once(tmp_path, caplog):
    fake = tmp_path / "old-g++"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in -mamx-bf16) echo "unrecognized $a" >&2; exit 1;; esac; done\nexit 0\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    flags = "flags : fpu avx2 avx512f avx512_vnni amx_tile amx_int8 amx_bf16"
    with caplog.at_level(logging.WARNING, logger="specstream.kernels.cpu"):
        got = cpu_kernels.int8_dot_flags(str(fake), avx512=True, cpu_flags=flags)
    assert got == ["-mavx512vnni", "-mamx-tile", "-mamx-int8"]  # a8's tiles still built
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "-mamx-bf16" in lines[0] and "amx_bf16" in lines[0]
