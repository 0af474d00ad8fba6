"""Packed forward: ragged batches through the KV pool reproduce the reference model."""

import pytest
import torch

from specstream.model.attention import ATTN_IMPLEMENTATION, model_geometry
from specstream.memory.kv import KVPool
from specstream.model.loader import load_model, resolve_model
from specstream.model.runner import ForwardItem, ModelRunner


def setup(model_dir, tokens=512, fast=True):
    source = resolve_model(str(model_dir))
    ref = load_model(source)
    model = load_model(source, attn_implementation=ATTN_IMPLEMENTATION)
    pool = KVPool(*model_geometry(model.config), tokens, 8, torch.float32, "cpu")
    runner = ModelRunner(model, pool, fast=fast)
    assert (runner.fast is not None) == fast
    return ref, runner, pool


def reference_logits(ref, ids):
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("fast", [True, False], ids=["lean-llama", "transformers-modules"])
def test_ragged_chunks_match_reference(tiny_model_dir, fast):
    ref, runner, pool = setup(tiny_model_dir, fast=fast)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (29, 3, 50)]
    cuts = [11, 1, 40]
    tables = [[] for _ in seqs]
    for t, s in zip(tables, seqs):
        assert pool.reserve(t, len(s))
    runner.forward([ForwardItem(t, 0, s[:c], 0) for t, s, c in zip(tables, seqs, cuts)])
    out = runner.forward([ForwardItem(t, c, s[c:], len(s) - c) for t, s, c in zip(tables, seqs, cuts)])
    expected = torch.cat([reference_logits(ref, s)[c:] for s, c in zip(seqs, cuts)])
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_cache_after_rejected_drafts_equals_cache_rebuilt_from_accepted(tiny_model_dir):
    _, runner, pool = setup(tiny_model_dir)
    prompt, drafts, accepted = [5, 17, 42, 9, 100, 7], [11, 12, 13, 14], 2
    table = []
    pool.reserve(table, len(prompt) + len(drafts))
    runner.forward([ForwardItem(table, 0, prompt, 1)])
    runner.forward([ForwardItem(table, len(prompt), drafts, len(drafts))])
    # Reject drafts past `accepted`: the length simply moves back. Continue with a new token.
    length = len(prompt) + accepted
    after_rollback = runner.forward([ForwardItem(table, length, [77], 1)])
    kept = [pool.keys[0][pool.slots(table, 0, length + 1)].clone(), pool.values[1][pool.slots(table, 0, length + 1)].clone()]

    fresh = []
    pool.reserve(fresh, length + 1)
    rebuilt = runner.forward([ForwardItem(fresh, 0, prompt + drafts[:accepted] + [77], 1)])
    torch.testing.assert_close(after_rollback, rebuilt, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kept[0], pool.keys[0][pool.slots(fresh, 0, length + 1)], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kept[1], pool.values[1][pool.slots(fresh, 0, length + 1)], atol=1e-5, rtol=1e-5)


def test_a_sequence_logits_do_not_depend_on_its_batch(tiny_model_dir):
    _, runner, pool = setup(tiny_model_dir)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    alone_table, other_table, batched_table = [], [], []
    for t in (alone_table, other_table, batched_table):
        pool.reserve(t, 40)
    alone = runner.forward([ForwardItem(alone_table, 0, ids, len(ids))])
    batched = runner.forward([ForwardItem(other_table, 0, list(range(30, 60)), 3), ForwardItem(batched_table, 0, ids, len(ids))])
    torch.testing.assert_close(batched[3:], alone, atol=1e-5, rtol=1e-5)


def test_a_float32_stream_under_bf16_weights_keeps_bf16_kv_and_comes_closer_to_the_fp32_model(tiny_model_dir):
    """stream_dtype float32 (what a8 runs under bf16): the residual stream and norms in float32, q/k/v and the KV
    pool in bf16, the draft head's features handed over in bf16; its logits are closer to the fp32 model's than
    those of the same bf16 weights with a bf16 stream, prefill and decode alike (the a8 engine's stream:
    test_compile_bundled)."""
    source = resolve_model(str(tiny_model_dir))
    ref = load_model(source)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (60,), generator=g).tolist()
    expected = reference_logits(ref, ids)[40:]
    errors = {}
    for wide in (None, torch.float32):
        model = load_model(source, torch.bfloat16, attn_implementation=ATTN_IMPLEMENTATION)
        pool = KVPool(*model_geometry(model.config), 128, 8, torch.bfloat16, "cpu")
        runner = ModelRunner(model, pool, stream_dtype=wide)
        assert runner.fast.stream_dtype == wide
        table = []
        assert pool.reserve(table, len(ids))
        prefill = runner.forward([ForwardItem(table, 0, ids[:50], 10)])  # logits of the prompt's last 10 rows
        decoded = [runner.forward([ForwardItem(table, i, [ids[i]], 1)]) for i in range(50, 59)]
        _, aux = runner.forward([ForwardItem(table, 59, [ids[59]], 1)], aux_layers=(1,))
        got = torch.cat([prefill, *decoded, _])
        assert pool.keys[0].dtype == torch.bfloat16 and got.dtype == torch.float32 and aux.dtype == torch.bfloat16
        errors[wide] = (got - expected).abs().mean().item()
    assert errors[torch.float32] < 0.95 * errors[None], errors  # 0.0060 against 0.0067 (the dense projections' inputs are rounded to bf16 still)


def test_model_geometry_reads_llama_config(tiny_model_dir):
    from transformers import AutoConfig

    assert model_geometry(AutoConfig.from_pretrained(tiny_model_dir)) == (2, 2, 16)


def test_default_model_takes_the_lean_forward_and_matches_transformers(default_model_source):
    ref = load_model(default_model_source)
    model = load_model(default_model_source, attn_implementation=ATTN_IMPLEMENTATION)
    pool = KVPool(*model_geometry(model.config), 256, 16, torch.float32, "cpu")
    runner = ModelRunner(model, pool)
    assert runner.fast is not None
    ids = [1, 504, 3458, 282, 4649, 314, 253, 1789, 30, 378, 3458, 282]
    table = []
    pool.reserve(table, len(ids))
    runner.forward([ForwardItem(table, 0, ids[:7], 0)])
    out = runner.forward([ForwardItem(table, 7, ids[7:], 5)])
    torch.testing.assert_close(out, reference_logits(ref, ids)[7:], atol=2e-4, rtol=2e-4)


def test_prefill_chunks_attend_through_the_kernel_where_it_multiplies_bfloat16_pairs(tmp_path):
    """Where short_attention multiplies bfloat16 pairs from each sequence's keys laid out once (AVX512-BF16 without
    AMX: cpu.attention_pairs), prefill chunks of any length attend through it (there it is faster than SDPA: the
    README's figures), and their logits, a chunk after a cached prefix included, are as close to the float32
    model's as SDPA's; elsewhere prefill keeps SDPA (short prompts under a8 aside)."""
    from conftest import build_tiny_model

    from specstream.kernels import cpu as cpu_kernels

    if not cpu_kernels.load():
        pytest.skip("specstream's CPU kernels did not build (no g++)")
    source = resolve_model(str(build_tiny_model(tmp_path / "heads-of-64", hidden=256)))  # 4 heads of 64
    model = load_model(source, torch.bfloat16, attn_implementation=ATTN_IMPLEMENTATION)
    pool = KVPool(*model_geometry(model.config), 2048, 8, torch.bfloat16, "cpu")
    runner = ModelRunner(model, pool)
    runner.fast.routes_settled()  # as the engine's builder calls it
    pairs = cpu_kernels.attention_pairs(torch.bfloat16, 64)
    assert runner.fast.prefill_keys == (1 << 62 if pairs else 0)
    if not pairs:
        pytest.skip("short_attention has no bfloat16 pair path here (AMX tiles, or no AVX512-BF16): prefill keeps SDPA")
    ids = torch.randint(0, 300, (700,), generator=torch.Generator().manual_seed(0)).tolist()
    want = reference_logits(load_model(source), ids)

    def prefill() -> torch.Tensor:
        table = []
        assert pool.reserve(table, len(ids))
        first = runner.forward([ForwardItem(table, 0, ids[:300], 300)])
        return torch.cat([first, runner.forward([ForwardItem(table, 300, ids[300:], 400)])])

    kernel = prefill()
    runner.fast.prefill_keys = 0
    sdpa = prefill()
    assert not torch.equal(kernel, sdpa)  # two attentions, not one twice
    error = {name: (got - want).abs().mean().item() for name, got in (("kernel", kernel), ("sdpa", sdpa))}
    assert error["kernel"] < 1.1 * error["sdpa"], error  # 0.0304 against 0.0302 (bf16 weights and activations)
    agree = {name: (got.argmax(-1) == want.argmax(-1)).float().mean().item() for name, got in (("kernel", kernel), ("sdpa", sdpa))}
    assert agree["kernel"] > agree["sdpa"] - 0.02, agree
