"""Every architecture specstream claims gives transformers' own output.

For each decoder architecture in VERIFIED_ARCHITECTURES a tiny random model is built from a
config with a fixed seed and tiny sliding windows (8 tokens, so every prompt runs past its
window), and compared with Hugging Face in fp32:
- logits of a ragged, chunked packed forward equal the reference forward's;
- greedy tokens equal `generate`'s, with speculation off (chunked prefill, alone and
  batched), with n-gram speculation (alone, and batched in a KV pool so small that the batch
  is preempted and recomputed), and with the model drafting for itself (every draft
  accepted, so multi-token verification and bonus tokens are exercised on every model).
A claimed architecture without a case here fails the suite; so does an unclaimed one with a case.
"""

from __future__ import annotations

import pytest
import torch

from specstream import Engine, EngineConfig, ModelError, SamplingParams, SpeculativeConfig
from specstream.model.architectures import VERIFIED_ARCHITECTURES, check_architecture
from specstream.model.attention import ATTN_IMPLEMENTATION, build_key_view, model_geometry
from specstream.memory.kv import KVPool
from specstream.memory.blocks import NO_BLOCK
from specstream.model.loader import load_model, resolve_model
from specstream.model.runner import ForwardItem, ModelRunner

WINDOW = 8
SLIDING_THEN_FULL = ["sliding_attention", "full_attention"]
# Per architecture: what its config needs for two layers with an 8-token window where it has one.
ARCHITECTURES: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": WINDOW},
    "ministral": {"sliding_window": WINDOW, "layer_types": SLIDING_THEN_FULL},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen3": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    # Soft-capping small enough to change every score, and non-default scaling.
    "gemma2": {"sliding_window": WINDOW, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 1.5,
               "final_logit_softcapping": 5.0},
    "gemma3_text": {"sliding_window": WINDOW, "query_pre_attn_scalar": 24, "sliding_window_pattern": 2},
    "phi3": {"sliding_window": WINDOW},
    "olmo2": {},
    "olmo3": {"sliding_window": WINDOW, "layer_types": SLIDING_THEN_FULL},
    "smollm3": {"use_sliding_window": True, "sliding_window": WINDOW, "no_rope_layer_interval": 2},
    "gpt_oss": {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "cohere2": {"sliding_window": WINDOW, "layer_types": SLIDING_THEN_FULL},
}
NEW_TOKENS = 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run faster on one thread, and the suite must stay fast on a busy
    2-core machine where spinning OpenMP workers wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build_model(path, model_type: str, tokenizer_dir, seed: int = 0, **overrides):
    """A two-layer random model of model_type with the tiny byte-level tokenizer, saved to path."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(path)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.1,  # greedy output falls into loops now and then: n-gram drafts get accepted
        **{**ARCHITECTURES.get(model_type, {}), **overrides},
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def prompts(vocab: int) -> list[list[int]]:
    """Three prompts of 22, 37 and 45 tokens (all longer than the window and the 16-token
    prefill chunk), each repeating a phrase so n-gram lookup has something to propose."""
    g = torch.Generator().manual_seed(1)
    out = []
    for phrase, tail in ((7, 8), (11, 15), (13, 6)):
        words = torch.randint(3, vocab, (phrase,), generator=g).tolist()
        out.append(words * 3 + torch.randint(3, vocab, (tail,), generator=g).tolist())
    return [p[: n] for p, n in zip(out, (22, 37, 45))]


def hf_generate(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(request, tmp_path_factory, tiny_model_dir):
    """(model_type, model directory, prompts, transformers' greedy continuations, reference model)."""
    model_type = request.param
    path = build_model(tmp_path_factory.mktemp(model_type), model_type, tiny_model_dir)
    reference = load_model(resolve_model(str(path)))
    reference.generation_config.eos_token_id = None
    texts = prompts(reference.config.get_text_config().vocab_size)
    return model_type, path, texts, [hf_generate(reference, p) for p in texts], reference


def test_every_claimed_architecture_has_a_conformance_case():
    assert set(ARCHITECTURES) == set(VERIFIED_ARCHITECTURES)


def test_ragged_chunked_logits_match_transformers(arch):
    model_type, path, texts, _, reference = arch
    model = load_model(resolve_model(str(path)), attn_implementation=ATTN_IMPLEMENTATION)
    pool = KVPool(*model_geometry(model.config), 256, 8, torch.float32, "cpu")
    runner = ModelRunner(model, pool)
    assert (runner.fast is not None) == (model_type == "llama")  # the lean path takes Llama only
    cuts = [5, 17, 30]
    tables = [[] for _ in texts]
    for table, ids in zip(tables, texts):
        assert pool.reserve(table, len(ids))
    runner.forward([ForwardItem(t, 0, ids[:c], 0) for t, ids, c in zip(tables, texts, cuts)])
    out = runner.forward([ForwardItem(t, c, ids[c:], len(ids) - c) for t, ids, c in zip(tables, texts, cuts)])
    with torch.inference_mode():
        expected = torch.cat([reference(torch.tensor([ids])).logits[0, c:] for ids, c in zip(texts, cuts)])
    torch.testing.assert_close(out, expected.float(), atol=1e-4, rtol=1e-4)


def engine(path, method: str, kv_cache_tokens: int | None = None) -> Engine:
    draft = str(path) if method == "draft" else None
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, adaptive=False, draft_model=draft)
    config = EngineConfig(
        model=str(path), dtype="float32", device="cpu", speculative=spec, max_num_batched_tokens=16,
        kv_cache_tokens=kv_cache_tokens, kv_block_size=8,
    )
    return Engine(config, log=False)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def test_plain_decoding_with_chunked_prefill_equals_generate(arch):
    _, path, texts, expected, _ = arch
    plain = engine(path, "off")
    assert plain.generate(texts[-1], GREEDY)[0].token_ids == expected[-1]
    assert [o.token_ids for o in plain.generate(texts, GREEDY)] == expected


def test_ngram_speculation_under_preemption_equals_generate(arch):
    _, path, texts, expected, _ = arch
    # 80 KV slots: any one sequence fits, the batch of three does not. Where every layer is windowed,
    # a sequence holds at most (window + its step) positions whatever its length: 24 slots then.
    spec = engine(path, "ngram", kv_cache_tokens=80)
    if all(g.window is not None for g in spec.pool.groups):
        spec = engine(path, "ngram", kv_cache_tokens=24)
    alone = [spec.generate(p, GREEDY)[0] for p in texts]
    assert [o.token_ids for o in alone] == expected
    batched = spec.generate(texts, GREEDY)
    assert [o.token_ids for o in batched] == expected
    assert spec.scheduler.num_preemptions > 0
    assert sum(o.stats.drafted for o in alone + batched) > 0


def test_self_drafting_accepts_every_draft_and_equals_generate(arch):
    _, path, texts, expected, _ = arch
    outputs = engine(path, "draft").generate(texts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert all(o.stats.accepted == o.stats.drafted > 0 for o in outputs)


def test_windowed_layers_hold_only_their_window_and_a_cached_prefix_equals_generate(arch):
    """The KV pool lays out the windows the model's attention asks for; a windowed layer group
    never holds more blocks than its window and one step need, and drops the rest as it goes;
    a prompt served again from the prefix cache (full layers' whole prefix, windowed layers' last
    window) gives the same tokens."""
    model_type, path, texts, expected, _ = arch
    e = engine(path, "ngram")
    pool = e.pool
    windowed = [g for g, group in enumerate(pool.groups) if group.window is not None]
    assert bool(windowed) == ("sliding_window" in ARCHITECTURES[model_type])
    assert all(pool.groups[g].window == WINDOW for g in windowed)
    most = pool.blocks_for(WINDOW - 1 + e.config.max_num_batched_tokens) + 1
    dropped = []
    step = e.step

    def checked_step():
        chunks = step()
        for seq in e.scheduler.running:
            for g in windowed:
                blocks = pool.tables(seq.block_table)[g]
                assert sum(b != NO_BLOCK for b in blocks) <= most
                dropped.append(blocks.count(NO_BLOCK))
        return chunks

    e.step = checked_step
    assert [o.token_ids for o in e.generate(texts, GREEDY)] == expected
    assert not windowed or max(dropped) >= 3  # 45 + 16 positions: windowed blocks were handed back
    again = e.generate(texts[-1], GREEDY)[0]
    assert again.token_ids == expected[-1] and again.num_cached_tokens >= 40


def test_a_window_query_sees_exactly_the_last_window_keys():
    # One sequence, 3 new queries at positions 10..12 over 13 cached keys, window 4.
    kv_index = torch.arange(13)[None]
    q_pos = torch.tensor([[10, 11, 12]])
    view = build_key_view(kv_index, q_pos, 4)
    for row, p in enumerate((10, 11, 12)):
        visible = view.kv_index[0][view.mask[0, 0, row]].tolist()
        assert visible == list(range(p - 3, p + 1))


def test_unverified_architecture_is_refused_at_load(tmp_path, tiny_model_dir):
    path = build_model(tmp_path / "starcoder2", "starcoder2", tiny_model_dir)
    with pytest.raises(ModelError, match="architecture 'starcoder2'.*not one specstream has verified"):
        engine(path, "off")


def test_bidirectional_attention_is_refused_at_load(tmp_path, tiny_model_dir):
    path = build_model(tmp_path / "bidi", "gemma3_text", tiny_model_dir, use_bidirectional_attention=True)
    with pytest.raises(ModelError, match="bidirectional"):
        engine(path, "off")


def test_batch_dependent_rope_is_refused(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = AutoModelForCausalLM.from_pretrained(
        build_model(tmp_path / "dyn", "qwen2", tiny_model_dir, rope_parameters=rope)
    )
    with pytest.raises(ModelError, match="'dynamic' RoPE scaling"):
        check_architecture(model)
