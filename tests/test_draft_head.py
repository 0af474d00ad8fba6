"""Trained EAGLE-3 draft heads: training on a tiny target, the file format, serving with the
head (rollback, preemption, losslessness) and bad head directories."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model
from safetensors.torch import load_file

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.spec_decode.draft_head import ARCHITECTURE, HeadError, load_head, read_config, save_head, weight_names
from specstream.calibration import CostModel
from specstream.spec_decode.eagle import EagleProposer
from specstream.spec_decode.proposer import Draft
from specstream.model.runner import ForwardItem
from specstream.sequence import Sequence
from specstream.training.config import TrainConfig
from specstream.training.train_draft import train_draft
from specstream.training.data import user_turn_prefix
from specstream.spec_decode.verify import Round, verify_round

RAW_PROMPTS = ["hello there", "what is the capital", "tell me a story", "def add(a, b):", "Paris is", "quick brown"]


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A 4-layer tiny target whose greedy text does not collapse into one repeated token, so
    there is something to learn."""
    return build_tiny_model(
        tmp_path_factory.mktemp("eagle-target"), num_layers=4, vocab_dir=tiny_model_dir, initializer_range=0.15
    )


@pytest.fixture(scope="module")
def trained(target_dir, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("eagle-head")
    cfg = TrainConfig(
        model=str(target_dir),
        out=str(out),
        minutes=10,  # generous: the token budget below ends it (a few seconds of training)
        tokens=60_000,
        num_prompts=64,
        max_prompt_tokens=16,
        max_answer_tokens=64,
        draft_vocab_size=256,
        dtype="float32",
        lr=2e-3,
        batch_size=8,
    )
    return out, train_draft(cfg)


@pytest.fixture(scope="module")
def chats(trained) -> list:
    """Chats from the questions the target wrote for its training (the head's domain)."""
    lines = (trained[0] / "work" / "prompts.jsonl").read_text().splitlines()
    return [[{"role": "user", "content": json.loads(line)}] for line in lines[:6]]


@pytest.fixture(scope="module")
def untrained(trained, target_dir, tmp_path_factory) -> Path:
    """The same head before training: random layer, fc passing the last aux layer through, the
    target's norm and LM-head rows."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir)
    head = load_head(trained[0], target.get_input_embeddings().weight, torch.float32)
    head.init_from_target(target.model.norm.weight, target.lm_head.weight)
    return save_head(head, tmp_path_factory.mktemp("eagle-untrained"))


def engine_for(model: Path | str, method: str, head: Path | None, **kw) -> Engine:
    spec = SpeculativeConfig(
        method=method,
        draft_model=str(head) if head else None,
        num_speculative_tokens=kw.pop("k", 4),
        adaptive=False,
        tree_drafts=kw.pop("trees", True),
    )
    return Engine(EngineConfig(model=str(model), dtype=kw.pop("dtype", "float32"), speculative=spec, **kw), log=False)


def greedy(engine: Engine, prompts, max_tokens: int = 40):
    return engine.generate(list(prompts), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def acceptance(outs) -> float:
    return sum(o.stats.accepted for o in outs) / max(sum(o.stats.drafted for o in outs), 1)


# ---------------------------------------------------------------------- training
def test_training_writes_a_report_with_per_position_acceptance(trained):
    out, report = trained
    assert json.loads((out / "report.json").read_text()) == report
    per = report["acceptance_per_position"]
    assert len(per) == 6 and all(a >= b for a, b in zip(per, per[1:]))
    assert report["mean_accepted_length"] == pytest.approx(1 + sum(per), abs=1e-2)
    assert 0 < report["vocab_coverage"] <= 1 and report["train_steps"] > 0
    assert set(report["phase_seconds"]) >= {"prompts", "answers", "features", "training"}


def test_trained_head_beats_an_untrained_one_on_the_targets_own_greedy_text(trained, untrained, target_dir, chats):
    # The tiny random target writes nearly random text, so a few seconds of training reach
    # modest acceptance (0.086 when written); an untrained head gets next to none (0.03: it
    # starts from the target's late features read by the target's LM head, which on a random
    # 4-layer target predicts little).
    after = acceptance(greedy(engine_for(target_dir, "eagle", trained[0]), chats, 64))
    before = acceptance(greedy(engine_for(target_dir, "eagle", untrained), chats, 64))
    assert after > before + 0.04 and after > 2.5 * before, (before, after)


def test_self_prompts_start_from_the_user_turn_of_the_chat_template(target_dir):
    from transformers import AutoTokenizer

    assert user_turn_prefix(AutoTokenizer.from_pretrained(target_dir)) == "<|im_start|>user\n"


# ---------------------------------------------------------------------- file format
def test_head_files_carry_the_names_and_shapes_vllm_and_sglang_load(trained):
    out, _ = trained
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == [ARCHITECTURE] and raw["model_type"] == "llama"
    assert raw["num_hidden_layers"] == 1 and raw["tie_word_embeddings"] is False
    assert raw["draft_vocab_size"] == 256 and raw["vocab_size"] == 384
    assert (
        raw["eagle_aux_hidden_state_layer_ids"] == raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]
    )
    tensors = load_file(str(out / "model.safetensors"))
    h = raw["hidden_size"]
    expected = weight_names(read_config(out))
    assert {n: tuple(t.shape) for n, t in tensors.items()} == expected
    # What the loaders build: fc reads 3 target hidden states, q/k/v read [embedding; hidden].
    assert expected["fc.weight"] == (h, 3 * h) and expected["midlayer.self_attn.q_proj.weight"][1] == 2 * h
    assert "embed_tokens.weight" not in tensors  # the loaders share the target's embedding
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    # d2t holds offsets: draft id i is target id i + d2t[i]; t2d marks exactly those ids.
    target_ids = torch.arange(256) + tensors["d2t"]
    assert bool((target_ids[1:] > target_ids[:-1]).all())
    assert torch.equal(torch.nonzero(tensors["t2d"]).squeeze(1), target_ids)
    # vLLM's renaming reaches its module names (midlayer. -> layers.0.).
    assert {n.replace("midlayer.", "layers.0.") for n in tensors if n.startswith("midlayer.")} >= {
        "layers.0.self_attn.q_proj.weight",
        "layers.0.hidden_norm.weight",
        "layers.0.mlp.down_proj.weight",
    }


def test_head_round_trip_gives_the_same_drafts(trained, target_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    embed = AutoModelForCausalLM.from_pretrained(target_dir).get_input_embeddings().weight
    head = load_head(trained[0], embed, torch.float32)
    again = load_head(save_head(head, tmp_path / "copy"), embed, torch.float32)
    aux = torch.randn(2, 10, 3 * head.cfg.hidden_size)
    tokens = torch.randint(0, 384, (2, 10))
    with torch.no_grad():
        for a, b in zip(head.unroll(aux, tokens, 3), again.unroll(aux, tokens, 3)):
            assert torch.equal(head.logits(a), again.logits(b))


# ---------------------------------------------------------------------- serving
def test_greedy_output_with_the_head_is_identical_to_plain_alone_and_batched(trained, target_dir, chats):
    prompts = chats + RAW_PROMPTS
    plain = [o.token_ids for o in greedy(engine_for(target_dir, "off", None), prompts)]
    for method in ("eagle", "auto"):
        engine = engine_for(target_dir, method, trained[0])
        batched = greedy(engine, prompts)
        assert [o.token_ids for o in batched] == plain
        assert sum(o.stats.accepted for o in batched) > 0
        alone = [greedy(engine, [p])[0].token_ids for p in prompts[:2]]
        assert alone == plain[:2]
    # Every head block is back in the pool once the requests are done.
    assert engine.proposer.head.pool.num_free_blocks == engine.proposer.head.pool.num_blocks


def test_greedy_output_with_the_head_is_identical_to_plain_when_the_prefix_cache_skips_a_prompt(
    trained, target_dir, chats
):
    """fp32, prefix caching on: a prompt admitted past a cached prefix hands the head features
    only from there, so its cache starts at that position (never at stale or missing rows).
    Drafts still come, and the output is the plain one."""
    prompts = [
        c + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}] for c in chats[:3]
    ]
    plain = [o.token_ids for o in greedy(engine_for(target_dir, "off", None, enable_prefix_caching=False), prompts)]
    for method in ("eagle", "auto"):
        engine = engine_for(target_dir, method, trained[0], kv_block_size=4, enable_prefix_caching=True)
        assert [o.token_ids for o in greedy(engine, prompts)] == plain
        again = greedy(engine, prompts)  # every prompt's leading blocks are now cached
        assert [o.token_ids for o in again] == plain
        assert all(o.num_cached_tokens > 0 for o in again) and sum(o.stats.accepted for o in again) > 0
        head = engine.proposer if method == "eagle" else engine.proposer.head
        assert not head._state and head.pool.num_free_blocks == head.pool.num_blocks


def fresh_head_drafts(engine, seq, start: int) -> list[int]:
    """The drafts of a new proposer over the same head, fed seq's text from position start with
    features recomputed from scratch by the target: what a correct live cache must also draft."""
    return fresh_head_draft(engine, seq, start).tokens


def fresh_head_draft(engine, seq, start: int, k: int = 6, **settings) -> Draft:
    """fresh_head_drafts' draft whole, from a proposer with `settings` (trees, width, target_cost)."""
    live = engine.proposer
    cfg = live.head.cfg
    fresh = EagleProposer(
        live.head, type(live.pool)(1, cfg.num_key_value_heads, cfg.head_dim, 4096, 16, torch.float32, "cpu")
    )
    for name, value in settings.items():
        setattr(fresh, name, value)
    table = []
    engine.pool.reserve(table, len(seq.token_ids))
    _, aux = engine.runner.forward([ForwardItem(table, 0, seq.token_ids[:-1], 1)], live.aux_layers)
    engine.pool.free(table)
    twin = Sequence("twin", seq.token_ids, seq.params, arrival=0)
    fresh.observe(twin, start, aux[start:])
    return fresh.propose([twin], [k])[0]


def test_head_started_past_a_cached_prefix_drafts_what_a_head_fed_from_there_drafts(trained, target_dir, chats):
    engine = engine_for(target_dir, "eagle", trained[0], kv_block_size=4, enable_prefix_caching=True, k=6)
    greedy(engine, [chats[1]], max_tokens=8)
    seq = engine.prepare(chats[1], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.submit(seq)
    while seq.num_output_tokens < 12:
        engine.step()
    live = engine.proposer
    state = live._state[seq.request_id]
    assert 0 < state.base == seq.prefix.hit_tokens
    assert fresh_head_drafts(engine, seq, state.base) == live.propose([seq], [6])[0].tokens


def test_head_kv_after_rejections_equals_a_fresh_recompute(trained, target_dir, chats):
    """Rolled-back draft rows must leave the head's cache exactly as if the accepted text had
    been fed from scratch: the next drafts agree."""
    engine = engine_for(target_dir, "eagle", trained[0], k=6)
    seq = engine.prepare(chats[2], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    engine.submit(seq)
    while seq.num_output_tokens < 30:
        engine.step()
    assert seq.stats.drafted > seq.stats.accepted  # some drafts were rejected and rolled back
    live = engine.proposer
    state = live._state[seq.request_id]
    assert len(state.table) <= live.pool.blocks_for(state.fed + state.num_pending + 1)
    assert fresh_head_drafts(engine, seq, 0) == live.propose([seq], [6])[0].tokens


def test_waiting_features_are_counted_and_hold_only_their_own_rows(trained, target_dir, chats):
    """Features wait until a sequence next drafts (under load, maybe for its whole life): they are copied into
    the sequence's own buffer, not kept as views that hold the whole step's features alive, nor as a tensor a
    step, and the count of waiting rows must not cost a walk over them."""
    engine = engine_for(target_dir, "eagle", trained[0], k=6)
    seqs = [engine.prepare(c, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)) for c in chats[:3]]
    for seq in seqs:
        engine.submit(seq)
    for _ in range(4):
        engine.step()
        for seq in seqs:
            state = engine.proposer._state[seq.request_id]
            assert 0 < state.num_pending <= len(state.waiting)
            assert state.waiting._base is None  # the sequence's own storage
            assert state.base + state.fed + state.num_pending == len(seq.token_ids) - 1


def test_the_heads_cost_curve_follows_what_its_rounds_take(trained, target_dir, chats, monkeypatch):
    """The head's passes are timed once at start-up, from hot caches; each drafting round then corrects the curve
    with what its passes took (host work included), so a head that runs slower than timed is priced as it runs."""
    engine = engine_for(target_dir, "eagle", trained[0], k=4)
    proposer = engine.proposer
    proposer.cost = CostModel([1, 2, 4], [1e-5, 1.5e-5, 2e-5])  # far below what a pass takes here
    step = proposer.head.step

    def slow_step(*args, **kwargs):
        time.sleep(0.002)
        return step(*args, **kwargs)

    monkeypatch.setattr(proposer.head, "step", slow_step)
    seq = engine.prepare(chats[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.submit(seq)
    for _ in range(8):
        engine.step()
    assert seq.stats.drafted > 0
    assert proposer.cost.observed >= 8  # every pass of every round: the catch-up and one a further depth
    assert proposer.cost(1) > 10 * 1e-5  # moved toward the 2 ms each pass now takes
    assert proposer.cost(2) >= proposer.cost(1)
    assert proposer._passes is None  # no round in flight: calibration's passes (time_steps) are not observed
    observed = proposer.cost.observed
    proposer.propose([seq], [0])  # a round that drafts nothing runs no pass and teaches nothing
    assert proposer.cost.observed == observed


def head_drafting(target_dir, head_dir, chat, outputs: int = 4):
    """An eagle engine's proposer, a greedy sequence `outputs` tokens into its answer, and its head state."""
    engine = engine_for(target_dir, "eagle", head_dir, k=4)
    seq = engine.prepare(chat, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    engine.submit(seq)
    while seq.num_output_tokens < outputs:
        engine.step()
    return engine.proposer, seq, engine.proposer._state[seq.request_id]


def test_a_head_that_waits_past_its_bound_keeps_the_newest_rows_and_drafts_as_one_fed_from_them(
    trained, target_dir, chats, monkeypatch
):
    """A sequence that does not draft with the head for a while (auto's other methods, or a long prompt) keeps at
    most MAX_WAITING rows waiting: past it, the newest KEPT_WAITING stay and the head's context starts at them. A
    head that had fed rows starts its cache again there (its blocks handed back), and drafts what a head fed from
    there drafts."""
    import specstream.spec_decode.eagle as eagle

    monkeypatch.setattr(eagle, "MAX_WAITING", 12)
    monkeypatch.setattr(eagle, "KEPT_WAITING", 5)
    live, seq, state = head_drafting(target_dir, trained[0], chats[0])
    assert state.fed and state.table and state.base + state.fed + state.num_pending == len(seq.token_ids) - 1
    width = state.waiting.shape[1]
    # 20 rows arrive while the head does not draft: 12 fit, so the newest 5 stay, the cache starts again at them
    expected, free = state.base + state.fed + state.num_pending, live.pool.num_free_blocks
    rows = torch.arange(20 * width, dtype=state.waiting.dtype).reshape(20, width)
    live.observe(seq, expected, rows)
    assert (state.fed, state.num_pending, state.table) == (0, 5, [])
    assert live.pool.num_free_blocks > free
    assert torch.equal(state.pending, rows[-5:])
    assert len(state.waiting) <= 12 and state.base == expected + 20 - 5
    # served: rows past the bound go, and what the head then drafts is what a head fed from its base drafts
    engine = engine_for(target_dir, "eagle", trained[0], k=4)
    live = engine.proposer
    long_chat = [{"role": "user", "content": " ".join(c[0]["content"] for c in chats[:3])}]
    seq = engine.prepare(long_chat, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.submit(seq)
    while seq.num_output_tokens < 10:
        engine.step()
    state = live._state[seq.request_id]
    assert state.base >= seq.num_prompt_tokens - 5 > 0  # the prompt's rows went past the bound
    monkeypatch.setattr(eagle, "MAX_WAITING", 4096)  # the fresh head below keeps every row it is fed
    assert fresh_head_draft(engine, seq, state.base, k=4).tokens == live.propose([seq], [4])[0].tokens


def test_auto_s_head_asleep_then_woken_drafts_from_the_features_since_and_output_stays_plain(
    trained, target_dir, chats, monkeypatch
):
    """auto taps the head's features only while a head round may pay (AutoProposer.prefill): here no head round is
    priced for a few steps, the tap goes off (the target's forward computes no features; the head forgets its
    rows), then rounds are priced again and it wakes: each running sequence's head cache starts at the first
    features handed over after it, the head drafts from there, and the output is the plain one."""
    import specstream.spec_decode.auto as auto_module

    monkeypatch.setattr(auto_module, "TAP_LINGER", 2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in engine_for(target_dir, "off", None).generate(chats[:3], params)]
    engine = engine_for(target_dir, "auto", trained[0], k=4)
    auto = engine.proposer
    auto.head_prior = 0.95  # a head round pays wherever the head can draft
    real_rate, asleep = auto._head_rate, range(6, 14)  # steps where no head round is priced

    def head_rate(seq, bucket, *args):
        if auto._steps in asleep:
            auto._judged[bucket] = auto._steps
            return 0.0, 0, 0.0
        return real_rate(seq, bucket, *args)

    monkeypatch.setattr(auto, "_head_rate", head_rate)
    taps, head_steps, real_propose = [], [], auto.head.propose

    def head_propose(seqs, ks):
        drafts = real_propose(seqs, ks)
        head_steps.append(auto._steps) if any(d.tokens for d in drafts) else None
        return drafts

    monkeypatch.setattr(auto.head, "propose", head_propose)
    seqs = [engine.prepare(c, params) for c in chats[:3]]
    for seq in seqs:
        engine.submit(seq)
    woken = None
    while engine.has_unfinished():
        engine.step()
        taps.append(bool(auto.aux_layers))
        if woken is None and auto._steps > asleep[-1] and seqs[0].request_id in auto.head._state:
            woken = {s.request_id: auto.head._state[s.request_id].base - s.num_prompt_tokens for s in seqs}
    assert [s.output_ids for s in seqs] == plain
    assert not any(taps[asleep[0] + 2 : asleep[-1]]) and any(taps[asleep[-1] :]) and all(taps[: asleep[0]])
    assert min(woken.values()) >= asleep[-1] - 1  # each head cache started past the output so far: no prompt rows
    assert any(step > asleep[-1] + 1 for step in head_steps)  # the woken head drafts
    assert auto.head.pool.num_free_blocks == auto.head.pool.num_blocks and not auto.head._state


def test_a_gap_in_the_heads_features_starts_its_cache_again_at_the_new_rows(trained, target_dir, chats):
    """Features that stop for a while and come again (no tap in between) start the sequence's head cache at the
    first new position, its blocks handed back, rather than failing the sequence's drafting state."""
    live, seq, state = head_drafting(target_dir, trained[0], chats[0])
    assert state.fed and state.table
    start, free = state.base + state.fed + state.num_pending + 3, live.pool.num_free_blocks
    rows = torch.ones(2, state.waiting.shape[1], dtype=state.waiting.dtype)
    live.observe(seq, start, rows)
    assert (state.base, state.fed, state.num_pending, state.table) == (start, 0, 2, [])
    assert live.pool.num_free_blocks > free and torch.equal(state.pending, rows)


def test_preemption_frees_and_refeeds_the_heads_cache(trained, target_dir):
    plain = [o.token_ids for o in greedy(engine_for(target_dir, "off", None), RAW_PROMPTS, max_tokens=60)]
    engine = engine_for(target_dir, "eagle", trained[0], kv_cache_tokens=160, kv_block_size=16)
    outs = greedy(engine, RAW_PROMPTS, max_tokens=60)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == plain
    assert engine.proposer.pool.num_free_blocks == engine.proposer.pool.num_blocks and not engine.proposer._state


def test_chunked_prefill_hands_the_head_its_features_chunk_by_chunk(trained, target_dir, chats):
    plain = [o.token_ids for o in greedy(engine_for(target_dir, "off", None), chats[:3])]
    engine = engine_for(target_dir, "eagle", trained[0], max_num_batched_tokens=8)
    assert all(len(engine.processor.encode(c)) > 8 for c in chats[:3])  # every prompt takes several steps
    outs = greedy(engine, chats[:3])
    assert [o.token_ids for o in outs] == plain and sum(o.stats.accepted for o in outs) > 0


def _rows_after(model, prompt: list[int], draft: Draft, cache: dict) -> torch.Tensor:
    """The target's logits after the prompt and after each draft's path (a tree's row j + 1 sees draft j's
    ancestors only), from the reference model, one forward per path not seen before."""
    parents = draft.parents if draft.is_tree else list(range(-1, len(draft.tokens) - 1))
    paths = [()]
    for tok, parent in zip(draft.tokens, parents):
        paths.append(paths[parent + 1] + (tok,))
    for path in paths:
        if path not in cache:
            with torch.no_grad():
                cache[path] = model(torch.tensor([prompt + list(path)])).logits[0, -1].float()
    return torch.stack([cache[path] for path in paths])


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_sampling_with_the_head_keeps_the_target_distribution(trained, target_dir, shape):
    """One speculative round over many seeds: the first emitted token must follow the
    target's p exactly, including tokens outside the head's reduced vocabulary (q = 0). A tree
    (its children drawn from q without replacement, recursive rejection sampling) also accepts
    more than the one-hot walk of the same trees."""
    from transformers import AutoModelForCausalLM

    from specstream.calibration import CostModel

    engine = engine_for(target_dir, "eagle", trained[0])
    proposer = engine.proposer
    if shape == "tree":
        proposer.target_cost = CostModel(*FLAT)
    prompt = engine.processor.encode(RAW_PROMPTS[0])
    n, k = 3000, 2 if shape == "chain" else 4
    seqs = [Sequence(f"s{i}", prompt, SamplingParams(temperature=1.0, seed=i), arrival=i) for i in range(n)]
    table: list[int] = []
    engine.pool.reserve(table, len(prompt))
    logits, aux = engine.runner.forward([ForwardItem(table, 0, prompt, 1)], proposer.aux_layers)
    engine.pool.free(table)
    p = logits[0].softmax(-1)
    outside = ~proposer.head.t2d
    assert float(p[outside].sum()) > 0.05  # the test covers the reduced vocabulary
    for s in seqs:
        proposer.observe(s, 0, aux[:-1])
    # Steps of 16 sequences (the curve is timed to 64 rows: a tree's rows on top of thousands would not pay).
    drafts = [d for c in range(0, n, 16) for d in proposer.propose(seqs[c : c + 16], [k] * len(seqs[c : c + 16]))]
    assert all(d.probs is not None and float(d.probs[:, outside].sum()) == 0 for d in drafts)
    trees = sum(d.is_tree for d in drafts)
    assert trees > n // 2 if shape == "tree" else trees == 0
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    cache: dict = {}
    rows = [_rows_after(model, prompt, d, cache) for d in drafts]
    verdicts = verify_round([Round(s, d, r) for s, d, r in zip(seqs, drafts, rows)])
    first = torch.tensor([result.tokens[0] for result in verdicts])
    empirical = torch.bincount(first, minlength=p.shape[0]).float() / n
    tv = 0.5 * float((empirical - p).abs().sum())
    # Total variation of n samples from p itself is about sqrt(V / (2 pi n)) ~ 0.14 at V=384.
    assert tv < 0.2, tv
    assert abs(float(empirical[outside].sum()) - float(p[outside].sum())) < 0.04
    if shape == "tree":
        one_hot = [Draft(d.tokens, None, parents=d.parents) for d in drafts]
        walked = verify_round([Round(s, d, r) for s, d, r in zip(seqs, one_hot, rows)])
        assert sum(v.num_accepted for v in verdicts) > sum(v.num_accepted for v in walked)
    for s in seqs:
        proposer.release(s)


def test_whether_a_sampled_head_draft_is_verified_does_not_depend_on_the_token_drawn(trained, target_dir):
    """Rejection sampling is lossless only for a draft verified whatever token was drawn. A judged chain keeps
    or drops a sampled draft by its distribution q (its top), never by q of the token drawn: at a row price
    between the draws' q and the top of q, every seed keeps its draft, and above the top none does."""
    from specstream.calibration import CostModel

    engine = engine_for(target_dir, "eagle", trained[0])
    proposer = engine.proposer
    proposer.cost = None  # no head-pass share: a draft pays when its chance beats the row's price
    prompt = engine.processor.encode(RAW_PROMPTS[0])
    table: list[int] = []
    engine.pool.reserve(table, len(prompt))
    _, aux = engine.runner.forward([ForwardItem(table, 0, prompt, 1)], proposer.aux_layers)
    engine.pool.free(table)

    def drafts(price: float, seeds) -> list[Draft]:
        # One sequence alone, one draft: its row costs `price` one-token steps.
        proposer.target_cost = CostModel([1, 2], [0.010, 0.010 * (1 + price)])
        out = []
        for seed in seeds:
            s = Sequence(f"s{seed}", prompt, SamplingParams(temperature=1.0, seed=seed), arrival=seed)
            proposer.observe(s, 0, aux[:-1])
            out.append(proposer.propose([s], [1])[0])
            proposer.release(s)
        return out

    free = drafts(0.0, range(100))
    q = free[0].probs[0]
    drawn = q[torch.tensor([d.tokens[0] for d in free])]
    assert float(drawn.min()) < float(q.max()) / 2  # the draws' q spread below the top
    assert {len(d.tokens) for d in drafts(float(drawn.median()), range(100))} == {1}
    assert {len(d.tokens) for d in drafts(float(q.max()) * 1.05, range(100))} == {0}


def test_metrics_label_per_position_acceptance_by_method(trained, target_dir, chats):
    engine = engine_for(target_dir, "eagle", trained[0])
    greedy(engine, chats)
    value = engine.metrics.registry.get_sample_value
    drafted = value("specstream_spec_decode_num_draft_tokens_per_pos_total", {"position": "0", "method": "eagle"})
    accepted = value("specstream_spec_decode_num_accepted_tokens_per_pos_total", {"position": "0", "method": "eagle"})
    assert drafted > 0 and 0 < accepted <= drafted


# ---------------------------------------------------------------------- bad heads
def test_a_head_for_another_target_fails_at_start_up_naming_both(trained, tiny_draft_dir):
    with pytest.raises(HeadError, match="hidden size 64 vs the target's 32") as err:
        engine_for(tiny_draft_dir, "eagle", trained[0])
    assert str(trained[0]) in str(err.value) and str(tiny_draft_dir) in str(err.value)


def test_a_head_with_another_vocabulary_fails_at_start_up(trained, tmp_path):
    other = build_tiny_model(tmp_path / "other", vocab_size=300)
    with pytest.raises(HeadError, match="vocabulary 384 vs the target's"):
        engine_for(other, "eagle", trained[0])


def test_a_directory_that_is_no_head_is_refused(target_dir, tmp_path):
    with pytest.raises(HeadError, match="train-draft"):
        engine_for(target_dir, "eagle", tmp_path)
    with pytest.raises(HeadError, match="not an EAGLE-3 head"):
        engine_for(target_dir, "eagle", target_dir)


def test_eagle_without_a_bundled_head_names_train_draft_and_auto_falls_back_to_ngram(target_dir):
    with pytest.raises(HeadError, match="specstream train-draft --model"):
        engine_for(target_dir, "eagle", None)
    engine = engine_for(target_dir, "auto", None)
    assert engine.proposer.head is None and engine.proposer.aux_layers == ()
    assert len(greedy(engine, RAW_PROMPTS[:1])[0].token_ids) == 40


def test_train_draft_cli_rejects_a_bad_prompts_file(tmp_path, target_dir, capsys):
    from gateway.cli import main

    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"nothing": 1}\n')
    assert (
        main(
            [
                "train-draft",
                "--model",
                str(target_dir),
                "--out",
                str(tmp_path / "h"),
                "--prompts",
                str(bad),
                "--minutes",
                "0.1",
            ]
        )
        == 2
    )
    assert "expected a string or a list of chat messages" in capsys.readouterr().err


# ---------------------------------------------------------------------- the default model
def test_default_model_with_a_head_is_greedy_identical_to_plain_in_fp32(default_model_source, tmp_path):
    """fp32, so batched verification cannot flip near-ties: a head (here an untrained one in
    the default model's geometry: 3 aux layers of 30, 8k draft vocabulary) changes nothing
    but speed, alone and batched."""
    from specstream.spec_decode.draft_head import DraftHead, HeadConfig

    prompts = [
        [{"role": "user", "content": q}] for q in ("What is the capital of France?", "Write a haiku about the sea.")
    ]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = Engine(EngineConfig(dtype="float32", speculative=SpeculativeConfig(method="off")), log=False)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    cfg = HeadConfig.for_target(plain.model.config, 8192)
    assert cfg.aux_layers == (2, 15, 27)
    head = DraftHead(cfg, plain.model.get_input_embeddings().weight)
    head.set_vocabulary(torch.arange(8192) * 6)
    head.init_from_target(plain.model.model.norm.weight, plain.model.lm_head.weight)
    head_dir = save_head(head, tmp_path / "head")
    assert (head_dir / "model.safetensors").stat().st_size <= 20 * 10**6  # fits the bundled-head budget
    spec = SpeculativeConfig(method="eagle", draft_model=str(head_dir), num_speculative_tokens=4, adaptive=False)
    eagle = Engine(EngineConfig(dtype="float32", speculative=spec), log=False)
    batched = eagle.generate(prompts, params)
    assert [o.token_ids for o in batched] == expected and all(o.stats.drafted > 0 for o in batched)
    assert [eagle.generate(p, params)[0].token_ids for p in prompts] == expected


def test_the_bundled_head_drafts_losslessly_under_eagle_and_auto(default_model_source, tiny_model_dir):
    from gateway.cli import build_parser
    from specstream.spec_decode.head_files import bundled_head_dir

    # auto is the default: with the bundled head it measured faster than n-gram alone (README).
    assert EngineConfig().speculative.method == "auto"
    assert build_parser().parse_args(["serve"]).speculative_method == "auto"
    head_dir = bundled_head_dir("smollm2-135m")
    assert head_dir is not None and (head_dir / "model.safetensors").stat().st_size <= 20 * 10**6
    report = json.loads((head_dir / "report.json").read_text())
    assert report["target"] == "smollm2-135m" and report["acceptance_per_position"][0] > 0.2
    # The default engine drafts with the trained head, and in fp32 its greedy output is plain decoding's.
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = [[{"role": "user", "content": "Write a short poem about the sea."}], [{"role": "user", "content": "What is a CPU?"}]]
    plain = Engine(EngineConfig(dtype="float32", speculative=SpeculativeConfig(method="off")), log=False)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    del plain
    # Not adaptive: the head drafts every round (the cost policy may find a weak head's drafts not worth
    # verifying, and then this would test plain decoding).
    eagle_spec = SpeculativeConfig(method="eagle", adaptive=False, num_speculative_tokens=4)
    eagle = Engine(EngineConfig(dtype="float32", speculative=eagle_spec), log=False)
    outs = eagle.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.stats.accepted for o in outs) > 0  # the trained head's drafts are taken
    auto = Engine(EngineConfig(dtype="float32", speculative=SpeculativeConfig(method="auto")), log=False)
    assert auto.proposer.head is not None
    assert [auto.generate(p, params)[0].token_ids for p in prompts] == expected
    # A target with no bundled head: eagle names the trainer, auto runs n-gram alone.
    with pytest.raises(HeadError, match="specstream train-draft"):
        Engine(EngineConfig(model=str(tiny_model_dir), speculative=SpeculativeConfig(method="eagle")), log=False)
    auto_spec = SpeculativeConfig(method="auto")
    assert Engine(EngineConfig(model=str(tiny_model_dir), speculative=auto_spec), log=False).proposer.head is None


class _StubHead:
    """Stands in for EagleProposer in AutoProposer's choice: a fixed per-step cost, drafts of zeros."""

    aux_layers = ()
    target_cost = None  # no chain judge: the chain is as long as auto asks

    def __init__(self, step_seconds: float) -> None:
        self.step_seconds = step_seconds
        self.asked: list[int] = []

    def pass_cost(self, num_seqs: int) -> float:
        return self.step_seconds

    def begin_step(self, base) -> None:
        self.base = base

    def catch_up_cost(self, seq) -> float:
        return getattr(self, "pending_seconds", 0.0)

    def propose(self, seqs, ks):
        self.asked.extend(ks)
        return [Draft([0] * k, None, "head") for k in ks]

    def ready(self, seq) -> bool:
        return getattr(self, "can_draft", True)

    def drop_states(self) -> None:
        self.dropped = getattr(self, "dropped", 0) + 1

    def on_commit(self, seq) -> None:
        self.committed = getattr(self, "committed", []) + [seq.request_id]


def test_auto_drafts_at_the_length_that_pays_or_not_at_all():
    """auto judges each method at its best draft length against plain decoding: with cheap
    verification a confident head drafts its full k; where verifying grows with the rows (the int4
    kernel on a CPU) a weak head drafts a short chain or none, and a long n-gram copy still wins."""
    from specstream.calibration import CostModel
    from specstream.spec_decode.auto import AutoProposer
    from specstream.spec_decode.ngram import NgramProposer

    def choose(prior: float, verify: list[float], tokens: list[int], k: int = 8) -> tuple[list[int], str]:
        head = _StubHead(0.001)
        auto = AutoProposer(head, NgramProposer(1, 4), head_prior=prior)
        auto.target_cost = CostModel([1, 9], verify)
        seq = Sequence("s", tokens, SamplingParams(temperature=0), arrival=0)
        (draft,) = auto.propose([seq], [k])
        return head.asked, draft.method if draft.tokens else ""

    fresh = list(range(40, 60))  # no n-gram match anywhere
    assert choose(0.9, [0.010, 0.011], fresh) == ([8], "head")  # verification nearly free
    # 9 rows cost 3x one: a weak head drafts nothing, a fair one a chain of 1, a good one a short chain
    assert choose(0.3, [0.010, 0.030], fresh) == ([], "")
    assert choose(0.4, [0.010, 0.030], fresh) == ([1], "head")
    asked, method = choose(0.7, [0.010, 0.030], fresh)
    assert method == "head" and asked == [2]
    copy = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3, 4]  # a long match in the prompt
    assert choose(0.4, [0.010, 0.030], copy)[1] == "ngram"



def test_auto_prices_drafts_at_the_margin_of_the_step_they_join():
    """A head draft that pays for a lone sequence (a second row costs a tenth of the first) does not pay on top
    of a step of 8 decoding sequences, where the 9th row costs half of one sequence's share of the step: auto
    prices each draft by what it adds to the step the engine said it joins (begin_step), once."""
    from specstream.calibration import CostModel
    from specstream.spec_decode.auto import AutoProposer
    from specstream.spec_decode.ngram import NgramProposer
    from specstream.spec_decode.policy import StepBase

    head = _StubHead(0.0)
    auto = AutoProposer(head, NgramProposer(1, 4), head_prior=0.5)
    auto.target_cost = CostModel([1, 2, 8, 9, 16], [0.010, 0.011, 0.020, 0.0235, 0.040])
    fresh = Sequence("s", list(range(40, 60)), SamplingParams(temperature=0), arrival=0)
    auto.begin_step(StepBase(8, 8.0))
    auto.propose([fresh], [1])
    assert head.asked == []  # 8.5 tokens / 0.0235 s is below 8 / 0.020 s
    auto.propose([fresh], [1])  # no step announced: priced as the step's only sequence
    assert head.asked == [1]  # 1.5 tokens / 0.011 s beats 1 / 0.010 s
    # 1 decoding sequence beside a 15-token chunk: its draft is priced at that step's margin (a 17th row) and
    # pays against the decoding row's own rate, 1 token / 0.010 s.
    auto.begin_step(StepBase(16, 1.0, 15))
    auto.propose([fresh], [1])
    assert head.asked == [1, 1] and head.base == StepBase(16, 1.0, 15)  # the head's chain is judged in that step
    # A head that has not drafted for this sequence in a while first feeds it every row since: priced too.
    head.pending_seconds = 0.005
    auto.propose([fresh], [1])
    assert head.asked == [1, 1]


def test_auto_drafts_an_ngram_match_as_ngram_does_and_costs_the_k_policy_no_head_step():
    """Where the head is not picked, auto's n-gram draft is method ngram's (the whole match, up to the
    k granted), short matches included; and the k policy, which grants k before auto picks, is not
    charged a head step per draft (with a real cost curve it then granted auto no drafts at all)."""
    from specstream.calibration import CostModel
    from specstream.spec_decode.policy import KPolicy
    from specstream.spec_decode.auto import AutoProposer
    from specstream.spec_decode.ngram import NgramProposer

    ngram = NgramProposer(1, 4)
    auto = AutoProposer(_StubHead(0.004), ngram, head_prior=0.2)  # a weak, dear head: never picked here
    auto.target_cost = CostModel([1, 9], [0.010, 0.020])
    assert auto.pass_cost(1) == auto.pass_cost(16) == 0.0
    for tokens in ([5, 6, 7, 8, 9, 7], [1, 2, 3, 4, 1, 2], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]):
        seq = Sequence("s" + str(len(tokens)), tokens, SamplingParams(temperature=0), arrival=0)
        for k in (1, 3, 8):
            (draft,) = auto.propose([seq], [k])
            (plain_ngram,) = ngram.propose([seq], [k])
            assert draft.tokens == plain_ngram.tokens and draft.tokens, (tokens, k)
            assert draft.method == "ngram"
    policy = KPolicy(8, True, auto.target_cost, auto.pass_cost)
    same = KPolicy(8, True, auto.target_cost, ngram.pass_cost)
    seq = Sequence("p", [1, 2, 3], SamplingParams(temperature=0), arrival=0)
    assert policy.choose([seq], 1, 64) == same.choose([seq], 1, 64) and policy.choose([seq], 1, 64)[0] > 0


def test_auto_weighs_an_ngram_match_by_what_matches_of_its_length_were_kept(monkeypatch):
    """A sequence whose four-token matches were all kept draws no confidence from them for a one-token match:
    auto keeps its n-gram records by match length, and a short match is weighed (against the other methods,
    and in the step's expected tokens) at what short matches were kept."""
    from specstream.calibration import CostModel
    from specstream.spec_decode import policy
    from specstream.spec_decode.auto import NGRAM_PRIOR, AutoProposer
    from specstream.spec_decode.ngram import NgramProposer

    auto = AutoProposer(None, NgramProposer(1, 4))
    auto.target_cost = CostModel([1, 9], [0.010, 0.030])
    seq = Sequence("s", list(range(1, 13)) + list(range(1, 6)), SamplingParams(temperature=0.7, seed=1), arrival=0)
    for _ in range(6):
        (draft,) = auto.propose([seq], [4])
        assert draft.tokens == [6, 7, 8, 9] and draft.method == "ngram"
        seq.stats.record(4, 4, 0)  # every draft kept
        auto.on_commit(seq)
    record = auto._seqs["s"].ngram
    assert set(record) == {"ngram4"} and record["ngram4"].estimate(0.5, 2.0) > 0.9
    seq.token_ids.extend([99, 5])  # now only the last token matches
    gains = []
    add = policy.StepPrice.add
    monkeypatch.setattr(policy.StepPrice, "add", lambda self, gain, rows, extra=0.0: gains.append(gain) or add(self, gain, rows, extra))
    (draft,) = auto.propose([seq], [4])
    a = NGRAM_PRIOR[1]
    assert draft.method == "ngram" and gains == [pytest.approx(a + a * a)]  # two tokens each kept at the prior


def test_auto_stops_drafting_a_match_length_once_such_matches_are_known_not_to_pay():
    """While the shared record of one-token matches holds less than its prior's weight, auto drafts such a match as
    "ngram" would (so that the record learns); once it holds more and says they are rarely kept, they are not
    drafted, while a four-token match, of which nothing is known yet, still is; once the record has faded below
    its prior's weight, a one-token match is drafted again."""
    from specstream.calibration import CostModel
    from specstream.spec_decode.auto import AutoProposer
    from specstream.spec_decode.ngram import NgramProposer

    auto = AutoProposer(None, NgramProposer(1, 4))
    auto.target_cost = CostModel([1, 9], [0.010, 0.030])  # a verified row costs a quarter of a step
    params = SamplingParams(temperature=0.7, seed=1)
    short = Sequence("s", list(range(1, 13)) + [99, 5], params, arrival=0)  # only its last token matches
    rounds = 0
    while auto.shared.evidence("ngram1", "T0.75") < auto.shared.weight:
        (draft,) = auto.propose([short], [4])
        assert draft.tokens and draft.method == "ngram"
        short.stats.record(len(draft.tokens), 0, 0)  # none kept
        auto.on_commit(short)
        rounds += 1
    assert rounds == 5  # 4 rounds' rejections, faded, are just under the weight of 4
    (draft,) = auto.propose([short], [4])
    assert draft.tokens == [] and auto._seqs["s"].last_method == ""
    copy = Sequence("c", list(range(1, 13)) + list(range(1, 6)), params, arrival=0)
    (draft,) = auto.propose([copy], [4])
    assert draft.tokens == [6, 7, 8, 9]
    for _ in range(230):  # decoding rounds pass; the one-token record fades below its prior's weight
        auto.shared.tick()
    assert auto.shared.evidence("ngram1", "T0.75") < auto.shared.weight
    (draft,) = auto.propose([short], [4])
    assert draft.tokens and draft.method == "ngram"


def test_chain_judge_keeps_a_draft_while_its_chance_pays_for_its_row():
    """A draft is kept while (expected tokens + its chance) / (seconds + its row) beats the step's
    rate so far; later drafts need more confidence; free verification keeps every draft."""
    from specstream.calibration import CostModel
    from specstream.spec_decode.policy import ChainJudge

    steep = CostModel([1, 9], [0.010, 0.026])  # each verified row costs 0.002 s, a fifth of a step
    judge = ChainJudge(steep, CostModel([1], [0.0]), 1)
    assert not judge.keep(0, 0.15)  # 0.15 tokens for 0.002 s: below 1 token / 0.010 s
    judge = ChainJudge(steep, CostModel([1], [0.0]), 1)
    assert judge.keep(0, 0.9) and judge.chance == [0.9] and judge.rows == 2
    assert judge.step.expected == pytest.approx(1.9) and judge.step.seconds == pytest.approx(0.012)
    assert judge.keep(0, 0.5)  # chance 0.45 for 0.002 s against 1.9 tokens / 0.012 s
    assert not judge.keep(0, 0.5)  # chance 0.225: 0.002 s buys 0.34 tokens at the rate so far
    # A draft pays for the head step that made it too: the same chain stops sooner when they are dear.
    dear = ChainJudge(steep, CostModel([1], [0.004]), 1)
    dear.head_step(1)
    assert dear.keep(0, 0.9) and dear.step.seconds == pytest.approx(0.016)
    dear.head_step(1)
    assert not dear.keep(0, 0.5)
    # Verification as cheap for 9 rows as for 1: any chance pays.
    flat = ChainJudge(CostModel([1, 9], [0.010, 0.010]), None, 2)
    assert all(flat.keep(i, 0.01) for i in (0, 1, 0, 1))
    # On top of a step of 8 sequences (8 tokens / 0.022 s), a draft's row must bring more than alone.
    from specstream.spec_decode.policy import StepBase

    assert ChainJudge(steep, None, 1).keep(0, 0.3)  # 0.3 tokens for 0.002 s beats 1 / 0.010 s
    crowded = ChainJudge(steep, None, 1, StepBase(8, 8.0))
    assert crowded.rows == 8 and not crowded.keep(0, 0.3)  # but not 8 / 0.024 s
    assert crowded.keep(0, 0.95)


def _commit(trust, seq, accepted: int) -> None:
    """seq's round verified with `accepted` drafts kept (and the target's own token after them)."""
    seq.token_ids.extend([7] * (accepted + 1))
    seq.stats.record(4, accepted, 0)
    trust.committed(seq)


def test_the_heads_chances_are_taken_at_what_drafts_of_their_depth_were_accepted_lately():
    """ChanceTrust: per depth, accepted drafts over the chances the head gave them, pulled toward 1 while few.
    A head 0.9 sure of its first draft and 0.8 of its second, right 30% and 10% of the time, is trusted about
    a third and an eighth as far; sampled requests keep a record of their own; a round whose drafts were not
    the ones verified records nothing; the record fades back to 1 as rounds pass."""
    from specstream.spec_decode.policy import ChanceTrust, sampling_bucket

    trust = ChanceTrust()
    seq = Sequence("s", [1, 2, 3], SamplingParams(temperature=0), arrival=0)
    assert trust.factor("greedy", 1) == 1.0  # nothing known: the head's chances as they are
    for r in range(400):
        trust.drafted(seq, [0.9, 0.72], [1, 2])  # a chain: depth 2's chance is the product
        _commit(trust, seq, 2 if r % 10 == 0 else 1 if r % 10 < 3 else 0)
    assert trust.factor("greedy", 1) == pytest.approx(0.3 / 0.9, rel=0.05)
    assert trust.factor("greedy", 2) == pytest.approx(0.1 / 0.72, rel=0.15)
    assert trust.factor(sampling_bucket(SamplingParams(temperature=0.7)), 1) == 1.0
    # A tree: its depth-1 nodes are disjoint, so their chances add up to the depth's expected acceptance.
    tree = ChanceTrust()
    for _ in range(200):
        tree.drafted(seq, [0.5, 0.3, 0.2], Draft([4, 5, 6], parents=[-1, -1, 0]).depths())
        _commit(tree, seq, 1)
    assert tree.factor("greedy", 1) == pytest.approx(1 / 0.8, rel=0.05)
    assert tree.factor("greedy", 2) < 0.15  # never accepted: its prior weight is all that is left
    # Drafts announced and never verified (the sequence failed, or another proposer drafted): not recorded.
    stale = ChanceTrust()
    stale.drafted(seq, [0.9], [1])
    seq.token_ids.extend([7, 7, 7])
    seq.stats.record(1, 0, 0)
    stale.committed(seq)
    assert stale.shared.evidence("depth1", "greedy") == 0.0
    stale.drafted(seq, [0.9], [1])
    stale.release(seq)
    _commit(stale, seq, 1)
    assert stale.shared.evidence("depth1", "greedy") == 0.0
    for _ in range(20_000):  # rounds without the head's drafts
        trust.committed(seq)
    assert trust.factor("greedy", 1) == pytest.approx(1.0, abs=0.05)


def test_the_judge_takes_a_drafts_chance_at_the_heads_trust():
    """ChainJudge.keep and keep_best weigh the head's chances by its trust: a draft worth its row at the head's
    word is declined once the head is known to be right a sixth as often, and a tree keeps its confident first
    depth but not the second one its trust discounts; the drafts carry the head's own chances."""
    from specstream.calibration import CostModel
    from specstream.spec_decode.head_tree import keep_best
    from specstream.spec_decode.policy import ChainJudge

    steep = CostModel([1, 9], [0.010, 0.026])
    assert ChainJudge(steep, None, 1).keep(0, 0.9)
    assert not ChainJudge(steep, None, 1).keep(0, 0.9, trust=1 / 6)
    judge = ChainJudge(steep, None, 1)
    assert judge.keep(0, 0.9, trust=1.5) and judge.step.expected == pytest.approx(2.0)  # at most certain
    assert judge.chance == [0.9]  # the head's own chance goes on down the chain
    nodes = {0: [(11, -1, 0.9, 1), (12, 0, 0.8, 2), (13, -1, 0.05, 1)]}
    for trust, kept in ((None, [11, 12]), (lambda i, depth: 1.0 if depth == 1 else 0.2, [11])):
        drafts = [Draft([])]
        keep_best(nodes, {}, [4], ChainJudge(steep, None, 1), drafts, trust)
        assert drafts[0].tokens == kept and drafts[0].chances == [0.9, 0.8][: len(kept)]


def test_draft_depths_follow_the_parents():
    assert Draft([1, 2, 3]).depths() == [1, 2, 3]
    assert Draft([1, 2, 3, 4], parents=[-1, -1, 0, 2]).depths() == [1, 1, 2, 3]


def test_the_heads_trust_is_learned_from_its_verified_drafts_and_output_stays_plain(trained, target_dir, chats):
    """fp32, greedy, chains and trees judged by a curve: each judged round announces its drafts' chances and is
    recorded once verified (all but a request's last round, which ends it), nothing is left pending when the
    requests end, and the output is the plain one."""
    from specstream.calibration import CostModel

    prompts = chats + RAW_PROMPTS
    plain = [o.token_ids for o in greedy(engine_for(target_dir, "off", None), prompts)]
    for trees in (False, True):
        engine = engine_for(target_dir, "eagle", trained[0], k=6, trees=trees)
        engine.proposer.target_cost = CostModel([1, 7], [0.050, 0.053])  # rows cheap beside the head's passes
        trust = engine.proposer.trust
        announced, recorded, shapes = [], [], []
        drafted, record = trust.drafted, trust.shared.record

        def announce(seq, chances, depths, drafted=drafted, announced=announced, shapes=shapes):
            announced.append(seq.request_id)
            shapes.append(max(depths) < len(depths))
            drafted(seq, chances, depths)

        def note(kind, bucket, accepted, rejected, record=record, recorded=recorded):
            recorded.append(kind)
            record(kind, bucket, accepted, rejected)

        trust.drafted, trust.shared.record = announce, note
        outs = greedy(engine, prompts)
        assert [o.token_ids for o in outs] == plain
        depth1 = recorded.count("depth1")
        assert len(announced) > 20 and len(announced) - len(prompts) <= depth1 <= len(announced)
        assert any(shapes) == trees  # a tree has several nodes at some depth
        assert not trust._pending
        assert 0.0 < trust.factor("greedy", 1) < 3.0


def test_chains_stopped_by_the_heads_confidence_stay_lossless_and_drop_unlikely_drafts(trained, target_dir, chats):
    """fp32, greedy: with a verification cost that makes weak drafts lose, the head keeps fewer
    drafts, more of them are accepted, and the output is still the plain one."""
    from specstream.calibration import CostModel

    prompts = chats + RAW_PROMPTS
    plain = [o.token_ids for o in greedy(engine_for(target_dir, "off", None), prompts)]
    stats = {}
    for judged in (False, True):
        engine = engine_for(target_dir, "eagle", trained[0], k=6, trees=False)
        if judged:
            engine.proposer.target_cost = CostModel([1, 7], [0.010, 0.022])
        outs = greedy(engine, prompts)
        assert [o.token_ids for o in outs] == plain
        stats[judged] = (sum(o.stats.drafted for o in outs), acceptance(outs))
    assert stats[True][0] < stats[False][0] and stats[True][1] > stats[False][1], stats


# A verification curve this flat makes every draft pay: the head's trees grow to their limits.
FLAT = ([1, 64], [0.010, 0.0101])


def test_head_trees_are_greedy_identical_to_plain_and_accept_more_than_chains(trained, target_dir, chats):
    """EAGLE-2 trees from the head (greedy requests, drafts judged by a curve): the output is the plain one,
    the rounds verify trees, and the tree's side branches take tokens the chain's one path misses."""
    from specstream.calibration import CostModel

    prompts = chats + RAW_PROMPTS
    plain = [o.token_ids for o in greedy(engine_for(target_dir, "off", None), prompts)]
    accepted, shapes = {}, []
    for trees in (False, True):
        engine = engine_for(target_dir, "eagle", trained[0], k=6, trees=trees)
        engine.proposer.target_cost = CostModel(*FLAT)
        propose = engine.proposer.propose

        def spy(seqs, ks, propose=propose, trees=trees):
            drafts = propose(seqs, ks)
            shapes.extend((trees, d.is_tree) for d in drafts if d.tokens)
            return drafts

        engine.proposer.propose = spy
        outs = greedy(engine, prompts)
        assert [o.token_ids for o in outs] == plain
        accepted[trees] = sum(o.stats.accepted for o in outs)
        assert engine.proposer.pool.num_free_blocks == engine.proposer.pool.num_blocks
    assert (True, True) in shapes and (False, True) not in shapes
    assert accepted[True] > accepted[False], accepted


def test_a_head_trees_likeliest_path_is_the_heads_own_chain(trained, target_dir, chats):
    """A tree's rows see only their own paths: the path of each node's likeliest child, through the head's
    tree-masked passes, drafts what the head's chain drafts step by step."""
    from specstream.calibration import CostModel

    engine = engine_for(target_dir, "eagle", trained[0], k=6)
    seq = engine.prepare(chats[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.submit(seq)
    while seq.num_output_tokens < 10:
        engine.step()
    chain = fresh_head_draft(engine, seq, 0)  # no curve: a chain of 6
    tree = fresh_head_draft(engine, seq, 0, k=12, trees=True, width=2, target_cost=CostModel(*FLAT))
    assert tree.is_tree and not chain.is_tree and len(tree.tokens) > 6
    path = tree.main_chain().tokens
    assert len(path) >= 3 and path == chain.tokens[: len(path)], (path, chain.tokens)
    # A sampled request draws its tree from the head's q: each node carries the q it was drawn from (the
    # chain's first q at the root), siblings share it and are distinct draws of tokens q allows.
    seq.params = SamplingParams(max_tokens=40, temperature=0.8, seed=1, ignore_eos=True)
    sampled = fresh_head_draft(engine, seq, 0, trees=True, target_cost=CostModel(*FLAT))
    assert sampled.is_tree and sampled.probs is not None and len(sampled.probs) == len(sampled.tokens)
    torch.testing.assert_close(sampled.probs[0], fresh_head_draft(engine, seq, 0).probs[0])
    siblings: dict[int, list[int]] = {}
    for j, parent in enumerate(sampled.parents):
        siblings.setdefault(parent, []).append(j)
    assert max(len(js) for js in siblings.values()) > 1
    for js in siblings.values():
        assert len({sampled.tokens[j] for j in js}) == len(js)
        assert all(torch.equal(sampled.probs[j], sampled.probs[js[0]]) and sampled.probs[j][sampled.tokens[j]] > 0 for j in js)


def test_auto_hands_every_verified_round_to_its_head():
    """The head learns how far to trust its chances from the rounds it drafted (ChanceTrust): auto passes each
    sequence's commit on to it, whichever method drafted the round."""
    from specstream.spec_decode.auto import AutoProposer
    from specstream.spec_decode.ngram import NgramProposer

    head = _StubHead(0.001)
    auto = AutoProposer(head, NgramProposer(1, 4))
    seq = Sequence("s", [1, 2, 3], SamplingParams(temperature=0), arrival=0)
    auto.on_commit(seq)
    auto.on_commit(seq)
    assert head.committed == ["s", "s"]


def test_auto_falls_back_to_the_ngram_match_when_the_heads_chain_declines():
    """auto picked the head, but the head's confidence kept none of its drafts: the n-gram match
    drafts instead, and the declined round counts against the head in auto's choice."""
    from specstream.calibration import CostModel
    from specstream.spec_decode.auto import AutoProposer
    from specstream.spec_decode.ngram import NgramProposer

    class Declining(_StubHead):
        target_cost = CostModel([1, 9], [0.010, 0.018])

        def propose(self, seqs, ks):
            self.asked.extend(ks)
            return [Draft([], None, "eagle") for _ in ks]

    head = Declining(0.0005)
    auto = AutoProposer(head, NgramProposer(1, 4), head_prior=0.9)
    auto.target_cost = CostModel([1, 9], [0.010, 0.018])
    seq = Sequence("s", [5, 6, 7, 1, 2, 3, 9, 5, 6, 7], SamplingParams(temperature=0), arrival=0)
    (draft,) = auto.propose([seq], [4])
    assert head.asked == [4] and draft.method == "ngram" and draft.tokens[:3] == [1, 2, 3]
    history = auto._seqs["s"].head
    assert history.rejected == 1.0 and history.accepted == 0.0


def test_auto_taps_the_heads_features_only_while_a_head_round_may_pay(monkeypatch):
    """The target computes the head's features (aux_layers) only while the head may be picked: for TAP_LINGER steps
    after a head round last priced above plain decoding and the sequence's other drafts (the head cannot draft without
    them, so a round it is not ready for keeps the tap on but is not picked), or when a prompt is prefilled of a
    sampling bucket never judged or whose head contended when last judged. Going off, the head forgets its rows."""
    import specstream.spec_decode.auto as auto_module
    from specstream.calibration import CostModel
    from specstream.spec_decode.auto import AutoProposer
    from specstream.spec_decode.ngram import NgramProposer

    monkeypatch.setattr(auto_module, "TAP_LINGER", 3)
    head = _StubHead(0.0)
    head.aux_layers = (0, 1)
    auto = AutoProposer(head, NgramProposer(1, 4), head_prior=0.05)  # a head round never pays
    auto.target_cost = CostModel([1, 9], [0.010, 0.030])
    fresh = list(range(40, 60))
    greedy_seq = Sequence("g", fresh, SamplingParams(temperature=0), arrival=0)
    assert auto.aux_layers == (0, 1)  # on at start: a first prompt's features are not lost
    for _ in range(3):
        auto.prefill([])
        auto.propose([greedy_seq], [4])
    assert auto.aux_layers == (0, 1)
    auto.prefill([])
    assert auto.aux_layers == () and head.dropped == 1 and head.asked == []
    auto.prefill([(Sequence("g2", fresh, SamplingParams(temperature=0), arrival=0), 20)])
    assert auto.aux_layers == ()  # greedy was judged and its head round did not pay
    sampled = Sequence("t", fresh, SamplingParams(temperature=0.7), arrival=0)
    auto.prefill([(sampled, 20)])
    assert auto.aux_layers == (0, 1)  # a bucket never judged: its prompt's features are kept
    for _ in range(4):
        auto.prefill([])
        auto.propose([sampled], [4])
    assert auto.aux_layers == () and head.dropped == 2
    # A head round priced above plain decoding wakes the tap, but is not picked while the head cannot draft yet.
    auto.head_prior, head.can_draft = 0.95, False
    auto.prefill([])
    (draft,) = auto.propose([Sequence("g3", fresh, SamplingParams(temperature=0), arrival=0)], [4])
    assert auto.aux_layers == (0, 1) and head.asked == [] and not draft.tokens
    head.can_draft = True
    auto.prefill([])
    auto.propose([Sequence("g4", fresh, SamplingParams(temperature=0), arrival=0)], [4])
    assert head.asked and auto.aux_layers == (0, 1)
    # prompts of a bucket whose head contended when last judged wake it again
    for _ in range(4):
        auto.prefill([])
    assert auto.aux_layers == ()
    auto.prefill([(Sequence("g5", fresh, SamplingParams(temperature=0), arrival=0), 20)])
    assert auto.aux_layers == (0, 1)
    # A head round above plain decoding but below the sequence's suffix draft would not be picked: the tap sleeps.
    auto.suffix = _CertainSuffix()
    asked = len(head.asked)
    for _ in range(4):
        auto.prefill([])
        (draft,) = auto.propose([Sequence("g6", fresh, SamplingParams(temperature=0), arrival=0)], [4])
        assert draft.method == "suffix"
    assert auto.aux_layers == () and len(head.asked) == asked


def test_a_head_priced_out_by_its_catch_up_lets_the_tap_sleep(monkeypatch):
    """A head round priced above plain decoding only before its catch-up (the rows it has not fed) is not picked
    and does not keep the head's features tapped: with the tap on and the head never picked, those rows pile up and
    price it out for good. Once the tap sleeps and the head forgets them, a round priced above plain decoding for a
    sequence it has no features for wakes the tap, and the head, starting with nothing to catch up, is picked."""
    import specstream.spec_decode.auto as auto_module
    from specstream.calibration import CostModel
    from specstream.spec_decode.auto import AutoProposer
    from specstream.spec_decode.ngram import NgramProposer

    monkeypatch.setattr(auto_module, "TAP_LINGER", 3)
    head = _StubHead(0.0)
    head.aux_layers = (0, 1)
    head.pending_seconds = 0.05  # five plain steps' worth of rows to feed before its first draft
    auto = AutoProposer(head, NgramProposer(1, 4), head_prior=0.95)
    auto.target_cost = CostModel([1, 9], [0.010, 0.012])
    seq = Sequence("g", list(range(40, 60)), SamplingParams(temperature=0), arrival=0)
    for _ in range(4):
        auto.prefill([])
        (draft,) = auto.propose([seq], [4])
        assert not draft.tokens
    assert auto.aux_layers == () and head.dropped == 1 and head.asked == []
    head.can_draft, head.pending_seconds = False, 0.0  # asleep, the head forgot the sequence's rows
    auto.prefill([])
    auto.propose([seq], [4])
    assert auto.aux_layers == (0, 1) and head.asked == []
    head.can_draft = True
    auto.prefill([])
    (draft,) = auto.propose([seq], [4])
    assert len(head.asked) == 1 and draft.method == "head" and auto.aux_layers == (0, 1)


class _CertainSuffix:
    """A suffix proposer whose drafts are sure to be kept: no head round prices above them."""

    def draft(self, seq, k):
        return Draft([7] * k, method="suffix", chances=[1.0] * k)

    def release(self, seq):
        pass


def test_head_served_in_8_bit_blocks_drafts_as_the_dense_head_does(trained, target_dir):
    """bf16 serving reads the head's projections as 8-bit blocks (CPU kernels): its logits stay
    within the quantization's error of the dense head's and its greedy drafts agree."""
    from specstream.kernels import cpu as cpu_kernels
    from specstream.spec_decode.draft_head import _Q8Linear

    if not cpu_kernels.load():
        pytest.skip("specstream's CPU kernels did not build (no g++)")
    from transformers import AutoModelForCausalLM

    embed = AutoModelForCausalLM.from_pretrained(target_dir).get_input_embeddings().weight
    dense = load_head(trained[0], embed, torch.float32)
    q8 = load_head(trained[0], embed, torch.float32)
    assert q8.serve_in_8_bits() and isinstance(q8.lm_head, _Q8Linear)
    assert isinstance(q8.midlayer.self_attn.q_proj, _Q8Linear) and isinstance(q8.fc, torch.nn.Linear)
    aux = torch.randn(2, 24, 3 * dense.cfg.hidden_size)
    tokens = torch.randint(0, 384, (2, 24))
    with torch.no_grad():
        for a, b in zip(dense.unroll(aux, tokens, 2), q8.unroll(aux, tokens, 2)):
            la, lb = dense.logits(a), q8.logits(b)
            assert (la - lb).abs().max() < 0.05 * la.abs().max()
            assert (la.argmax(-1) == lb.argmax(-1)).float().mean() > 0.95
    # A bf16 engine serves its head that way; float32 keeps the head as trained.
    bf16 = engine_for(target_dir, "eagle", trained[0], dtype="bfloat16")
    assert isinstance(bf16.proposer.head.lm_head, _Q8Linear)
    assert isinstance(engine_for(target_dir, "eagle", trained[0]).proposer.head.lm_head, torch.nn.Linear)
