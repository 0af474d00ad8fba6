"""The compiled forward (EngineConfig.compile, compiled_steps.CompiledSteps): a short step runs every layer in
one call, compiled ahead of time and kept on disk (torch.compile'd layers where that fails). It must give the tokens the eager forward gives, cover
every short step with the graphs traced at start-up (no compile while serving), leave long steps
eager, and fall back to eager where compiling fails."""

import asyncio
import os
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import build_tiny_model
from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
from specstream.kernels import cpu as cpu_kernels
from specstream.model import fast_llama, kept_steps
from specstream.model.runner import ForwardItem

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None, reason="no g++: inductor cannot build the compiled forward (make setup installs it)"
)

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef add(",
    "Paris",
    [{"role": "user", "content": "Hello! How can I help you today?"}],
]


def make_engine(model_dir, compile, dtype="float32", method="ngram", adaptive=True, **kw):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=6, adaptive=adaptive)
    return Engine(EngineConfig(model=str(model_dir), dtype=dtype, compile=compile, speculative=spec, **kw), log=False)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """This module's tiny model has 32-wide heads (4 heads over 128 features; the session's has 16-wide
    ones), so its compiled steps attend with specstream's CPU kernel (cpu_kernels.fits_head)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-wide-heads"), seed=0, hidden=128)


@pytest.fixture(scope="module")
def compiled(tiny_model_dir):
    """An engine whose torch.compile'd calls (the fallback of the kept functions) also run both of the
    tiny model's layers at once (the default runs one per call)."""
    engine = make_engine(tiny_model_dir, compile=False)
    engine.runner.compile(layers_per_graph=2)
    return engine


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """The compiled forward's cache in an empty directory: a machine with nothing compiled yet."""
    from specstream.model import runner

    monkeypatch.setattr(runner, "cache_dir", lambda: tmp_path)
    return tmp_path


def test_compiled_greedy_tokens_equal_eager_alone_and_batched(tiny_model_dir, compiled):
    assert compiled.runner.fast.compiled_rows > 0
    assert compiled.runner.fast.steps.math.attention_kernel  # short steps attend with cpu_kernels' short_attention
    eager = make_engine(tiny_model_dir, compile=False)
    assert eager.runner.fast.compiled_rows == 0
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [eager.generate(p, greedy)[0].token_ids for p in PROMPTS]
    assert [compiled.generate(p, greedy)[0].token_ids for p in PROMPTS] == want
    assert [o.token_ids for o in compiled.generate(PROMPTS, greedy)] == want
    # Verified runs went through the compiled layer: drafts were accepted.
    assert compiled.metrics.num_accepted_tokens._value.get() > 0


def _step(runner, shape):
    """A forward over len(shape) sequences, each with its (context, new tokens)."""
    tables = []
    for context, n in shape:
        table: list[int] = []
        assert runner.pool.reserve(table, context + n)
        tables.append(table)
    try:
        items = [ForwardItem(t, c, [5] * n, n) for t, (c, n) in zip(tables, shape)]
        return runner.forward(items)
    finally:
        for t in tables:
            runner.pool.free(t)


def test_the_start_up_graphs_cover_every_short_step(compiled):
    """No step of up to compiled_rows rows needs a graph the warm-up did not trace: any context
    length, any number of sequences, any run length up to the limit, any mix."""
    runner = compiled.runner
    rows = runner.fast.compiled_rows
    runner.fast.steps.unseen_shape_stance = "fail_on_recompile"  # raises where a step would need a new graph
    graphs = counters["stats"]["unique_graphs"]
    try:
        for shape in ([(5, 1)], [(300, 1)], [(9, 7)], [(200, rows)], [(3, 1)] * rows, [(40, 2), (90, 1), (7, 5)],
                      [(100, 4), (12, 4)], [(1, 1), (500, 1)]):
            if sum(n for _, n in shape) <= rows:
                _step(runner, shape)
    finally:
        runner.fast.steps.unseen_shape_stance = "eager_on_recompile"
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_layer_matches_eager_logits_on_each_step_shape(tiny_model_dir, compiled):
    eager = make_engine(tiny_model_dir, compile=False).runner
    for shape in ([(12, 1)], [(12, 6)], [(12, 1), (30, 1)], [(12, 3), (30, 2), (2, 1)]):
        torch.testing.assert_close(_step(compiled.runner, shape), _step(eager, shape), rtol=1e-4, atol=1e-4)


def test_compiled_steps_hand_the_draft_head_the_same_hidden_states(tiny_model_dir, compiled):
    """aux_layers (what an EAGLE head reads: the residual stream entering some layers) come out of the
    compiled calls, which run several layers each, as out of the eager forward."""
    eager = make_engine(tiny_model_dir, compile=False).runner
    assert len(compiled.runner.fast.steps.spans) < len(compiled.runner.fast.layers)  # several layers per call
    got, want = _aux_step(compiled.runner), _aux_step(eager)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def _aux_step(runner):
    """(logits, aux) of a 3-token step after a 17-token prefill, with the residual stream entering
    layers 0 and 1."""
    table: list[int] = []
    assert runner.pool.reserve(table, 20)
    try:
        runner.forward([ForwardItem(table, 0, [5] * 17, 1)])
        return runner.forward([ForwardItem(table, 17, [6, 7, 8], 3)], aux_layers=(0, 1))
    finally:
        runner.pool.free(table)


@pytest.mark.parametrize("kernel", ["q4", "int4"])
def test_int4_kernels_run_inside_the_compiled_layer(tiny_model_dir, fresh_cache, monkeypatch, kernel):
    """bf16 with int4 weights: the graph holds the packed int4 kernel (specstream's q4_linear, or torch's
    where specstream's kernels did not build), and its logits match the eager forward's within bf16
    rounding (fusion keeps float32 between ops where eager rounds)."""
    from specstream.kernels import routes

    if kernel == "int4":
        monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setattr(routes, "_faster_packed", lambda *args: True)  # route every size to the packed kernel
    engine = make_engine(tiny_model_dir, compile=True, dtype="bfloat16", quantization="int4", method="off")
    fast = engine.runner.fast
    assert fast.compiled_rows > 0 and {k[0] for layer in fast.steps.kernels for k in (layer[1], layer[2], layer[4], layer[5])} == {kernel}
    out = _step(engine.runner, [(20, 3)])
    fast_compiled = fast.steps
    fast.steps = None  # the same weights, eager
    try:
        want = _step(engine.runner, [(20, 3)])
    finally:
        fast.steps = fast_compiled
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=0.05, atol=0.15)


def _count_kept_calls(fast) -> dict:
    calls = dict.fromkeys(fast.steps.kept, 0)
    for kind, fn in list(fast.steps.kept.items()):

        def counted(*args, _fn=fn, _kind=kind):
            calls[_kind] += 1
            return _fn(*args)

        counted.guard_check = fn.guard_check
        fast.steps.kept[kind] = counted
    return calls


def test_long_steps_stay_eager(compiled):
    fast = compiled.runner.fast
    kept = dict(fast.steps.kept)
    calls = _count_kept_calls(fast)
    try:
        _step(compiled.runner, [(0, fast.compiled_rows + 1)])
        assert sum(calls.values()) == 0
        _step(compiled.runner, [(4, 1), (3, 1)])
        assert calls["batch-decode"] == 1  # every layer in one call
        _step(compiled.runner, [(4, 1)])
        assert calls["decode"] == 1
    finally:
        fast.steps.kept = kept


def test_every_short_step_runs_a_function_compiled_ahead_of_time_and_kept_on_disk(tiny_model_dir, fresh_cache, caplog):
    """Each kind of short step runs a function compiled ahead of time (every layer in one call), built at the first start, kept under the cache and loaded by the next start
    with nothing traced; steps of any context and run length take it, with the eager forward's
    tokens."""
    kept_dir = fresh_cache / "compiled"
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = [make_engine(tiny_model_dir, compile=False).generate(p, greedy)[0].token_ids for p in PROMPTS]
    caplog.set_level("INFO", logger="specstream")
    # adaptive=False: n-gram drafts whenever it finds a match, so every kind of step (verifications
    # included) runs whatever the step costs this machine measured (the k policy may decline to draft)
    first = make_engine(tiny_model_dir, compile=True, adaptive=False)
    assert "compiled decode steps ahead of time (2 layers per call)" in caplog.text
    assert sorted(p.name.rsplit("-", 1)[0] for p in kept_dir.iterdir()) == sorted(fast_llama.KINDS)
    caplog.clear()
    graphs = counters["stats"]["unique_graphs"]
    stale = kept_dir / "decode-0123456789abcdef0123.bin"  # a file no start loads any more
    stale.write_bytes(b"old")
    os.utime(stale, (0, 0))
    kept = {p: p.stat().st_mtime for p in kept_dir.iterdir() if p != stale}
    for p in kept:
        os.utime(p, (0, 0))
    second = make_engine(tiny_model_dir, compile=True, adaptive=False)
    assert "ahead of time (" not in caplog.text  # loaded, not compiled
    assert counters["stats"]["unique_graphs"] == graphs  # and nothing traced
    assert all(p.stat().st_mtime > 0 for p in kept)  # loading marks a file as in use
    kept_steps.prune(kept_dir)
    assert not stale.exists() and all(p.exists() for p in kept)
    for engine in (first, second):
        fast = engine.runner.fast
        assert all(fast.steps.kept[kind] is not None for kind in fast_llama.KINDS)
        calls = _count_kept_calls(fast)
        assert [engine.generate(p, greedy)[0].token_ids for p in PROMPTS] == want
        assert [o.token_ids for o in engine.generate(PROMPTS, greedy)] == want
        assert all(calls[kind] > 0 for kind in fast_llama.KINDS)
        before = dict(calls)
        longest = min(fast.compiled_rows, fast_llama.COMPILED_MAX_RUN)  # the longest run a compiled step takes
        for shape in ([(5, 1)], [(300, 1)], [(9, 7)], [(200, longest)], [(40, 1), (90, 1)], [(40, 2), (7, 5)]):
            _step(engine.runner, shape)
        assert [calls[k] - before[k] for k in fast_llama.KINDS] == [2, 2, 1, 1]  # one call per step
        assert fast.steps.refused == {}
    # A damaged file (a truncated write, a full disk) is compiled again, never trusted.
    for p in kept:
        p.write_bytes(p.read_bytes()[:100])
    caplog.clear()
    third = make_engine(tiny_model_dir, compile=True)
    assert caplog.text.count("could not load") == len(kept) and "compiled decode steps ahead of time" in caplog.text
    assert all(third.runner.fast.steps.kept[kind] is not None for kind in fast_llama.KINDS)
    assert [third.generate(p, greedy)[0].token_ids for p in PROMPTS] == want


def test_a_function_that_fails_to_compile_ahead_of_time_leaves_the_torch_compiled_calls(
    tiny_model_dir, fresh_cache, monkeypatch, caplog
):
    def refuse(*args, **kwargs):
        raise RuntimeError("aot_compile is not available")

    monkeypatch.setattr(kept_steps, "saveable_guards", refuse)  # fails inside the ahead-of-time compile
    engine = make_engine(tiny_model_dir, compile=True, method="off")
    fast = engine.runner.fast
    assert fast.steps.kept == dict.fromkeys(fast_llama.KINDS) and fast.compiled_rows > 0 and fast.steps.refused == {}
    assert "take the per-layer torch.compile'd calls" in caplog.text
    eager = make_engine(tiny_model_dir, compile=False, method="off")
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    assert engine.generate("Paris", greedy)[0].token_ids == eager.generate("Paris", greedy)[0].token_ids
    assert [o.token_ids for o in engine.generate(PROMPTS[:2], greedy)] == [
        o.token_ids for o in eager.generate(PROMPTS[:2], greedy)
    ]


def test_a_failed_compile_leaves_the_eager_forward(tiny_model_dir, fresh_cache, monkeypatch, caplog):
    def compile_that_fails(fn, **kw):
        def broken(*args):
            raise RuntimeError("no C++ compiler")  # what inductor raises, at the first call, without g++

        return broken

    monkeypatch.setattr(torch, "compile", compile_that_fails)
    engine = make_engine(tiny_model_dir, compile=True, method="off")
    assert engine.runner.fast.compiled_rows == 0 and engine.runner.fast.steps is None
    assert "compiling the forward failed" in caplog.text and "no C++ compiler" in caplog.text
    assert len(engine.generate("Paris", SamplingParams(max_tokens=5, temperature=0))[0].token_ids) == 5


def test_compile_defaults_and_invariant_mode(tiny_model_dir, monkeypatch):
    from gateway.cli import build_parser

    monkeypatch.setenv("SPECSTREAM_COMPILE", "1")
    assert EngineConfig().compile is True
    assert build_parser().parse_args(["serve"]).compile is True
    assert build_parser().parse_args(["serve", "--no-compile"]).compile is False
    monkeypatch.setenv("SPECSTREAM_COMPILE", "0")
    assert EngineConfig().compile is False
    assert build_parser().parse_args(["serve"]).compile is False
    # Invariant mode over dense weights tiles every step: it stays eager.
    engine = make_engine(tiny_model_dir, compile=True, method="off", deterministic=True)
    assert engine.runner.fast.steps is None


def test_without_the_cpu_kernel_the_compiled_steps_attend_with_torch_ops(tiny_model_dir, fresh_cache, monkeypatch):
    """A machine where specstream's kernels did not build (or a head width they do not take) compiles
    the torch version of the short steps' attention, with the eager forward's tokens."""
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    engine = make_engine(tiny_model_dir, compile=True)
    assert engine.runner.fast.compiled_rows > 0 and not engine.runner.fast.steps.math.attention_kernel
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    eager = make_engine(tiny_model_dir, compile=False)
    want = [o.token_ids for o in eager.generate(PROMPTS, greedy)]
    assert [o.token_ids for o in engine.generate(PROMPTS, greedy)] == want


def test_a_background_compile_serves_eager_then_installs_the_compiled_steps(tiny_model_dir, fresh_cache, caplog):
    """compile_in_background (the server's default): the engine is built with the eager forward and serves at
    once; the compiled steps are installed between two steps once ready and priced again when idle, with
    the eager forward's tokens throughout, and the warm-up's scratch blocks are given back."""
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in make_engine(tiny_model_dir, compile=False).generate(PROMPTS, greedy)]
    caplog.set_level("INFO", logger="specstream")
    engine = make_engine(tiny_model_dir, compile=True, compile_in_background=True)
    assert engine.forward_description == "eager (compiling in the background)"
    free = engine.pool.num_free_blocks
    eager_cost = engine.policy.target_cost
    assert [o.token_ids for o in engine.generate(PROMPTS, greedy)] == want  # may straddle the install
    engine.upgrade(wait=True)
    assert not engine.compiling and engine.runner.fast.compiled_rows > 0
    assert engine.forward_description.startswith("compiled") and "the forward runs compiled" in caplog.text
    assert engine.pool.num_free_blocks > free  # the warm-up's two scratch sequences are freed
    engine.idle()
    assert engine.priced and engine.policy.target_cost is not eager_cost  # the compiled forward, priced
    assert [o.token_ids for o in engine.generate(PROMPTS, greedy)] == want


async def test_the_async_engine_installs_a_background_compile_when_idle(tiny_model_dir, fresh_cache):
    from specstream import AsyncEngine

    engine = make_engine(tiny_model_dir, compile=True, compile_in_background=True)
    async with AsyncEngine(engine=engine) as served:
        chunks = [c async for c in served.stream("Paris", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))]
        assert sum(len(c.token_ids) for c in chunks) == 8
        for _ in range(1200):  # the engine thread looks every half second while idle
            if not engine.compiling and engine.priced:
                break
            await asyncio.sleep(0.1)
        assert engine.runner.fast.compiled_rows > 0 and engine.priced


_COMPILED_RUN = """
import sys
from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig
spec = SpeculativeConfig(method="ngram", num_speculative_tokens=6)
engine = Engine(EngineConfig(model=sys.argv[1], dtype="float32", compile=True, speculative=spec), log=False)
out = engine.generate(["The quick brown fox jumps over the lazy dog. The quick brown fox"],
                      SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
print("tokens", out[0].token_ids, "compiled_rows", engine.runner.fast.compiled_rows)
"""


def test_a_truncated_inductor_cache_never_crashes_nor_changes_the_tokens(tiny_model_dir, tmp_path):
    """Every file of inductor's on-disk cache cut to half (a full disk, a killed write) and the kept
    functions gone: a new process compiles again and gives the tokens it gave before."""
    import subprocess
    import sys

    env = {**os.environ, "SPECSTREAM_CACHE_DIR": str(tmp_path), "SPECSTREAM_COMPILE": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)

    def run() -> str:
        done = subprocess.run([sys.executable, "-c", _COMPILED_RUN, str(tiny_model_dir)], env=env, capture_output=True,
                              text=True, timeout=900)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    first = run()
    files = [p for p in (tmp_path / "inductor").rglob("*") if p.is_file() and p.stat().st_size > 1]
    assert files and "compiled_rows 0" not in first
    for p in files:
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    shutil.rmtree(tmp_path / "compiled")
    assert run() == first


def test_kept_functions_check_the_steps_own_tensors_not_the_layers_they_are_keyed_by():
    """saveable_guards drops the guards on the layers' arguments (weights, pools, kernel tuples: in the kept
    file's key) and keeps those on the step's own tensors and sizes, and every guard it cannot save is dropped."""
    from types import SimpleNamespace

    from torch._dynamo.guards import CheckFunctionManager

    def guard(kind, name, derived=()):
        return SimpleNamespace(guard_type=kind, name=name, derived_guard_types=derived)

    layers = [guard(kind, f"layers[3][2][{i}]") for i, kind in enumerate(kept_steps._LAYER_GUARDS)]
    own = [guard("TENSOR_MATCH", "x"), guard("TENSOR_MATCH", "kv_index"), guard("SEQUENCE_LENGTH", "layers"),
           guard("CONSTANT_MATCH", "self.heads"), guard("SHAPE_ENV", "", ("SHAPE_ENV",))]
    unsaved = [guard(kind, "x") for kind in sorted(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)]
    assert kept_steps.saveable_guards(layers + own + unsaved) == [False] * len(layers) + [True] * len(own) + [False] * len(unsaved)


def test_a_kept_function_serves_any_pool_size(tiny_model_dir, fresh_cache, caplog):
    """A function compiled ahead of time leaves the pools' size free: a start with another KV budget loads the
    same file, nothing traced, and its steps take it with the eager forward's tokens."""
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = [make_engine(tiny_model_dir, compile=False).generate(p, greedy)[0].token_ids for p in PROMPTS]
    caplog.set_level("INFO", logger="specstream")
    make_engine(tiny_model_dir, compile=True, adaptive=False, kv_cache_tokens=1024)
    assert "compiled decode steps ahead of time" in caplog.text
    caplog.clear()
    graphs = counters["stats"]["unique_graphs"]
    other = make_engine(tiny_model_dir, compile=True, adaptive=False, kv_cache_tokens=4096)
    assert "ahead of time (" not in caplog.text and counters["stats"]["unique_graphs"] == graphs
    fast = other.runner.fast
    calls = _count_kept_calls(fast)
    assert [o.token_ids for o in other.generate(PROMPTS, greedy)] == want
    assert sum(calls.values()) > 0 and fast.steps.refused == {}
