"""specstream's C++ CPU kernels (cpu_kernels.py): short_attention gives what the torch version of a short
step's attention gives, for every layout a step can have, and a machine that cannot build the kernels
keeps the torch version."""

import logging
import random
import shutil
from pathlib import Path

import pytest
import torch

from specstream.kernels import cpu as cpu_kernels
from specstream.model.attention import attend_short

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++: the kernels cannot be built (make setup installs it)")

SLOTS, BLOCK = 4096, 16


@pytest.fixture(scope="module")
def kernels():
    assert cpu_kernels.load(), "the kernels should build where g++ is installed"


VECTOR, TILES = 0, 1  # short_attention's paths


@pytest.fixture(params=[VECTOR, TILES], ids=["vector", "amx-tiles"])
def path(request, kernels):
    """Each of short_attention's paths for bfloat16 and a head dimension of 64, skipped where the CPU lacks it."""
    if request.param not in torch.ops.specstream.short_attention_paths():
        pytest.skip("this CPU (or its build) has no AMX-BF16: short_attention's tile path is not here")
    return request.param


def _step(gen, batch, runs, s_max, heads, kv_heads, d, dtype, masked):
    """A random short step over a paged pool: each sequence's keys in random blocks of BLOCK slots, its
    query rows packed in a random order, padding rows and padding keys where a step has them."""
    keys = torch.randn(SLOTS, kv_heads, d, generator=gen).to(dtype)
    values = torch.randn(SLOTS, kv_heads, d, generator=gen).to(dtype)
    blocks = torch.randperm(SLOTS // BLOCK, generator=gen)[: batch * (s_max // BLOCK + 1)].view(batch, -1)
    kv_index = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK)).view(batch, -1)[:, :s_max].contiguous()
    t_max, n = max(runs), sum(runs)
    rows = torch.randperm(n, generator=gen)
    q_index = torch.zeros(batch, t_max, dtype=torch.long)
    out_index, mask, at = [], torch.zeros(batch, 1, t_max, s_max, dtype=torch.bool), 0
    for b, run in enumerate(runs):
        context = s_max - int(torch.randint(0, 20, (1,), generator=gen)) if masked else s_max
        for t in range(t_max):
            visible = context - run + 1 + t if t < run else 1
            mask[b, 0, t, :visible] = True
        q_index[b, :run] = rows[at : at + run]
        out_index += [b * t_max + t for t in range(run)]
        at += run
    out_index = torch.tensor(out_index)[torch.randperm(n, generator=gen)]
    query = torch.randn(n, heads, d, generator=gen).to(dtype)
    return keys, values, query, kv_index, mask if masked else None, q_index, out_index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "batch,runs,heads,kv_heads,d",
    [
        (1, [1], 9, 3, 64),  # a lone decode step of the bundled model
        (1, [9], 9, 3, 64),  # its verification of 8 drafts
        (4, [1, 5, 9, 3], 9, 3, 64),  # a batch of verifications of different lengths
        (3, [1, 1, 1], 4, 4, 128),  # no grouped heads, a wider head
        (2, [2, 4], 8, 1, 32),  # one key/value head for all
        (2, [3, 1], 4, 2, 256),
    ],
)
def test_short_attention_equals_the_torch_version(kernels, dtype, batch, runs, heads, kv_heads, d):
    gen = torch.Generator().manual_seed(batch * 100 + d)
    s_max = 70
    masked = batch > 1 or runs[0] > 1
    keys, values, query, kv_index, mask, q_index, out_index = _step(gen, batch, runs, s_max, heads, kv_heads, d, dtype, masked)
    none = torch.empty(0, dtype=torch.long)
    args = (keys, values, none, query, keys[:0], values[:0], kv_index, mask, q_index, out_index, d**-0.5)
    want = attend_short(*args, kernel=False)
    got = attend_short(*args, kernel=True)
    assert got.shape == want.shape == (len(out_index), heads, d) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_attention_writes_the_step_keys_first_and_ignores_masked_slots(kernels, dtype):
    """The step's own keys/values go into the pool before attending (a query sees its own key), and what
    masked slots hold never reaches the output, not even NaN (bfloat16: the tiles read a block of 16 keys in
    place where their slots run consecutively, hidden ones included)."""
    gen = torch.Generator().manual_seed(1)
    keys, values, query, kv_index, mask, q_index, out_index = _step(gen, 2, [3, 2], 48, 4, 2, 64, dtype, True)
    slots = kv_index[0, 40:43]
    new_k, new_v = torch.randn(3, 2, 64, generator=gen).to(dtype), torch.randn(3, 2, 64, generator=gen).to(dtype)
    args = (slots, query, new_k, new_v, kv_index, mask, q_index, out_index, 0.125)
    want = attend_short(keys.clone(), values.clone(), *args, kernel=False)
    hidden = ~mask[:, 0].any(1)  # key columns no query of its sequence sees
    keys[kv_index[hidden]] = float("nan")
    values[kv_index[hidden]] = float("nan")
    got = attend_short(keys, values, *args, kernel=True)
    assert torch.equal(keys[slots], new_k) and torch.equal(values[slots], new_v)
    assert not got.isnan().any()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_attention_gives_each_row_what_it_gets_alone(kernels, dtype):
    """Rows that share a pass over the keys (a verification's rows, the heads of a key/value head) get
    bit for bit what each gets in a step of its own: a row's result depends on its query, keys and mask
    alone, whatever the step holds and however the work is split among threads. (bfloat16 here takes the
    AMX tiles where the CPU has them: the default path, at every row count.)"""
    gen = torch.Generator().manual_seed(7)
    keys, values, query, kv_index, mask, q_index, out_index = _step(gen, 2, [9, 4], 300, 9, 3, 64, dtype, True)
    t_max = q_index.shape[1]
    together = torch.ops.specstream.short_attention(query, keys, values, kv_index, mask, q_index, out_index, 0.125)
    threads_before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            for i, flat in enumerate(out_index.tolist()):
                b, t = divmod(flat, t_max)
                row = q_index[b, t].item()
                alone = torch.ops.specstream.short_attention(
                    query[row : row + 1], keys, values, kv_index[b : b + 1], mask[b : b + 1, :, t : t + 1],
                    torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 0.125,
                )
                assert torch.equal(alone[0], together[i]), (i, b, t, threads)
        finally:
            torch.set_num_threads(threads_before)


@pytest.mark.parametrize("runs,s_max", [([1], 70), ([9], 70), ([16, 3], 300), ([17], 1030), ([6, 1, 2], 33)])
def test_short_attention_paths_agree(path, runs, s_max):
    """Each path (the vector one; AMX tiles: 16 queries a pass, keys read in place or gathered) gives the torch
    version's attention in float32 to bfloat16's precision, for decodes, verifications, more queries than one
    pass holds, and contexts that end mid-block; the default path is the tiles wherever the CPU has them."""
    gen = torch.Generator().manual_seed(len(runs) * 1000 + s_max)
    keys, values, query, kv_index, mask, q_index, out_index = _step(gen, len(runs), runs, s_max, 9, 3, 64, torch.bfloat16,
                                                                    len(runs) > 1 or runs[0] > 1)
    got = torch.ops.specstream.short_attention(query, keys, values, kv_index, mask, q_index, out_index, 0.125, path)
    none = torch.empty(0, dtype=torch.long)
    want = attend_short(keys.float(), values.float(), none, query.float(), keys[:0].float(), values[:0].float(),
                        kv_index, mask, q_index, out_index, 0.125, kernel=False)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    if path == max(torch.ops.specstream.short_attention_paths()):
        default = torch.ops.specstream.short_attention(query, keys, values, kv_index, mask, q_index, out_index, 0.125)
        assert torch.equal(default, got)


def test_short_attention_refuses_what_it_cannot_serve(kernels):
    q = torch.randn(1, 4, 48)
    kv = torch.randn(16, 2, 48)
    index = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="head dimension"):
        torch.ops.specstream.short_attention(q, kv, kv, index, None, index, index[0], 0.1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        q64 = torch.randn(1, 4, 64)
        kv64 = torch.randn(16, 2, 64, dtype=torch.bfloat16)
        torch.ops.specstream.short_attention(q64, kv64, kv64, index, None, index, index[0], 0.1)
    with pytest.raises(RuntimeError, match="path -2, -1, 0 or 1"):
        torch.ops.specstream.short_attention(q64, q64, q64, index, None, index, index[0], 0.1, 2)
    if TILES in torch.ops.specstream.short_attention_paths():
        with pytest.raises(RuntimeError, match="AMX path needs bfloat16"):
            torch.ops.specstream.short_attention(q64, q64, q64, index, None, index, index[0], 0.1, TILES)
    assert cpu_kernels.fits_head(64) and cpu_kernels.fits_head(128) and not cpu_kernels.fits_head(48)
    assert not cpu_kernels.fits_head(512)


def test_a_machine_that_cannot_build_the_kernels_keeps_the_torch_version(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_kernels, "_loaded", None)
    monkeypatch.setattr(cpu_kernels, "_building", None)
    monkeypatch.setattr(cpu_kernels, "cache_dir", lambda: tmp_path)
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with caplog.at_level(logging.WARNING, logger="specstream.kernels.cpu"):
        assert cpu_kernels.load() is False
        assert cpu_kernels.load() is False  # tried once
    assert sum("unavailable" in r.message for r in caplog.records) == 1
    assert not list(tmp_path.rglob("*.so"))  # no half-built library left behind


def test_a_damaged_kernel_library_is_built_again_never_loaded(monkeypatch, tmp_path, caplog):
    """A kept library whose bytes no longer match the digest recorded at its build (truncated by a full
    disk, overwritten) is rebuilt before anything loads it. The compiler here is a stand-in."""
    builds = []

    def compile_stand_in(command, out: Path):
        out.write_bytes(b"\x7fELF library built %d" % len(builds))
        builds.append(out)

    monkeypatch.setattr(cpu_kernels, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(cpu_kernels, "_compile_and_link", compile_stand_in)
    first = cpu_kernels._build()
    assert len(builds) == 1 and cpu_kernels._build() == first and len(builds) == 1  # kept: not built again
    first.write_bytes(first.read_bytes()[:5])  # truncated
    with caplog.at_level(logging.WARNING, logger="specstream.kernels.cpu"):
        again = cpu_kernels._build()
    assert again == first and len(builds) == 2 and again.read_bytes() == b"\x7fELF library built 1"
    assert "does not match its digest: building it again" in caplog.text
    (first.parent / "specstream_kernels.so.sha256").unlink()  # a library whose build recorded no digest
    assert cpu_kernels._build() == first and len(builds) == 3


def _tree_step(gen, rnd, keys, heads):
    """A random step of three draft trees over random cached contexts: (query, kv_index, mask, q_index,
    out_index, path_of), path_of giving each query row's sequence and its path (step places, root first)."""
    cached = rnd.randint(1, 300)
    trees = [[-1] + [rnd.randrange(-1, t) for t in range(1, rnd.randint(2, 16))] for _ in range(3)]  # parents
    s_max, t_max = cached + max(map(len, trees)), max(map(len, trees))
    kv_index = torch.randperm(keys.shape[0], generator=gen)[: len(trees) * s_max].view(len(trees), s_max)
    mask = torch.zeros(len(trees), 1, t_max, s_max, dtype=torch.bool)
    q_index = torch.zeros(len(trees), t_max, dtype=torch.long)
    out_index, path_of = [], []
    for b, parents in enumerate(trees):
        for t in range(len(parents)):
            path = [t]
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            path = [cached + a for a in path[::-1]]
            mask[b, 0, t, :cached] = True
            mask[b, 0, t, path] = True
            q_index[b, t] = len(out_index)
            out_index.append(b * t_max + t)
            path_of.append((b, cached, path))
    query = (torch.randn(len(out_index), heads, keys.shape[2], generator=gen) * 3).bfloat16()
    return query, kv_index, mask, q_index, torch.tensor(out_index), path_of


def test_a_tree_row_gets_the_bits_of_its_path_verified_as_a_chain(kernels):
    """A draft tree's row sees its sequence's cached keys and its ancestors, their siblings hidden between them. Where
    the kernel multiplies bfloat16 pairs (cpu.attention_pairs: the attention `--deterministic` drops its tiles for),
    asked to (cpu.ATTENTION_TREES_ALONE: invariant mode's and a8's path), it attends such a row over the keys it sees
    laid side by side: the row's output is bit for bit what the same path gets verified as a chain (and so decoded),
    beside chain rows and other trees in one pass. Either way it is attention (the torch version's, to bfloat16's
    precision). In place, the hidden keys shift the later ones to other lanes of the sums, and about one row in a
    thousand here rounded apart."""
    if not cpu_kernels.attention_pairs(torch.bfloat16, 64):
        pytest.skip("this CPU attends bfloat16 on AMX tiles or without VDPBF16PS: its tree rows are not laid side by side")
    gen, rnd = torch.Generator().manual_seed(11), random.Random(0)
    heads, kv_heads, d = 9, 3, 64
    keys = torch.randn(SLOTS, kv_heads, d, generator=gen).bfloat16()
    values = torch.randn(SLOTS, kv_heads, d, generator=gen).bfloat16()
    none, one = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    rows = 0
    for step in range(120):
        query, kv_index, mask, q_index, out_index, path_of = _tree_step(gen, rnd, keys, heads)
        args = (query, keys, values, kv_index, mask, q_index, out_index, 0.125)
        got = torch.ops.specstream.short_attention(*args, cpu_kernels.ATTENTION_TREES_ALONE)
        if step < 3:
            empty = torch.empty(0, dtype=torch.long)
            want = attend_short(keys.float(), values.float(), empty, query.float(), keys[:0].float(), values[:0].float(),
                                kv_index, mask, q_index, out_index, 0.125, kernel=False)
            torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
            in_place = torch.ops.specstream.short_attention(*args)
            torch.testing.assert_close(in_place.float(), want, atol=1e-2, rtol=1e-2)
        for i, (b, cached, path) in enumerate(path_of):
            chain = torch.cat([kv_index[b, :cached], kv_index[b, path]])[None]  # the cached keys, then the path's
            alone = torch.ops.specstream.short_attention(query[i : i + 1], keys, values, chain, None, none, one, 0.125)
            assert torch.equal(alone[0], got[i]), (step, b, path)
            rows += 1
    assert rows > 2000
