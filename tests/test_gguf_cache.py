"""Any GGUF file gets a conversion cache keyed by its content: converted once, found again
from a copy, converted anew when its content changes, and hashed only when it is new or changed.

The dequantization itself (models._convert) is the one the bundled model goes through and is
replaced here by a recorder, so these tests measure the cache's keying, not transformers."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from specstream.model import loader as models
from specstream.model.loader import ModelSource, converted_source, resolve_model


@pytest.fixture
def conversions(tmp_path, monkeypatch) -> list[Path]:
    monkeypatch.setenv("SPECSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    done: list[Path] = []

    def record(gguf: Path, target: Path, origin: str) -> None:
        done.append(gguf)
        target.mkdir(parents=True)
        (target / ".complete").write_text(origin)

    monkeypatch.setattr(models, "_convert", record)
    return done


def gguf_file(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + content)
    return path


def test_a_gguf_file_is_converted_once_and_then_read_from_its_cache(tmp_path, conversions, caplog):
    caplog.set_level(logging.INFO, logger="specstream.model.loader")
    source = resolve_model(str(gguf_file(tmp_path / "a" / "m.gguf", b"weights" * 1000)))
    first, second = converted_source(source), converted_source(source)
    assert conversions == [tmp_path / "a" / "m.gguf"]
    assert first == second == ModelSource(source.name, first.path)
    assert Path(first.path).parent == tmp_path / "cache" / "models" and (Path(first.path) / ".complete").is_file()
    assert caplog.text.count("hashing m.gguf") == 1  # the second start only stats the file


def test_a_copy_with_the_same_content_shares_the_cache(tmp_path, conversions):
    original = gguf_file(tmp_path / "a" / "m.gguf", b"weights" * 1000)
    copy = tmp_path / "b" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy(original, copy)
    assert converted_source(resolve_model(str(original))).path == converted_source(resolve_model(str(copy))).path
    assert len(conversions) == 1


def test_changed_content_gets_a_new_cache(tmp_path, conversions):
    path = gguf_file(tmp_path / "m.gguf", b"weights" * 1000)
    before = converted_source(resolve_model(str(path))).path
    gguf_file(path, b"other weights" * 1000)
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse-clock file systems
    after = converted_source(resolve_model(str(path))).path
    assert before != after and len(conversions) == 2


def test_non_gguf_sources_are_loaded_as_they_are(tiny_model_dir, conversions):
    source = resolve_model(str(tiny_model_dir))
    assert converted_source(source) is source and not conversions


def test_a_damaged_conversion_is_converted_again(tmp_path, monkeypatch, tiny_model_dir, caplog):
    """A conversion whose weights no longer load (a truncated file) is detected and made again from the
    GGUF file, once; the model then loads as converted."""
    monkeypatch.setenv("SPECSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    done: list[Path] = []

    def convert(gguf: Path, target: Path, origin: str) -> None:  # the tiny model stands in for a dequantization
        done.append(gguf)
        shutil.copytree(tiny_model_dir, target)
        (target / ".complete").write_text(origin)

    monkeypatch.setattr(models, "_convert", convert)
    source = resolve_model(str(gguf_file(tmp_path / "m.gguf", b"weights" * 1000)))
    first = {k: v.clone() for k, v in models.load_model(source).state_dict().items()}
    weights = Path(converted_source(source).path) / "model.safetensors"
    truncated = weights.read_bytes()[:1000]
    weights.unlink()  # a new file: the first model's weights may still be mapped from the old one
    weights.write_bytes(truncated)
    with caplog.at_level(logging.WARNING, logger="specstream.model.loader"):
        second = models.load_model(source).state_dict()
    assert len(done) == 2 and "does not load" in caplog.text and "converting it again" in caplog.text
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
