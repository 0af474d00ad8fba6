"""Incremental detokenization: UTF-8 safety, stop strings across rounds, equality with one-shot decode."""

import pytest

from specstream.detok import IncrementalDetokenizer
from specstream.model.loader import load_tokenizer, resolve_model


@pytest.fixture(scope="module")
def tokenizers(tiny_model_dir, default_model_source):
    return {"tiny": load_tokenizer(resolve_model(str(tiny_model_dir))), "default": load_tokenizer(default_model_source)}


TEXTS = [
    "Hello world, caf\u00e9 cr\u00e8me br\u00fbl\u00e9e!",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u6771\u4eac\u3078\u3088\u3046\u3053\u305d",
    "emoji \U0001f600\U0001f680\U0001f468\u200d\U0001f469\u200d\U0001f467 end",
    "  leading spaces and\ttabs\nnew lines",
]


@pytest.mark.parametrize("name", ["tiny", "default"])
@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_one_shot_and_never_emits_broken_utf8(tokenizers, name, text):
    tok = tokenizers[name]
    prompt = tok.encode("Say:")
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, prompt, stop=[])
    pieces = []
    for t in ids:
        d.add(t)
        pieces.append(d.take())
    pieces.append(d.take(final=True))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


def test_stop_string_spanning_rounds_is_never_emitted(tokenizers):
    tok = tokenizers["default"]
    ids = tok.encode("The answer is 42. STOP here and nothing more")
    d = IncrementalDetokenizer(tok, [], stop=["STOP"])
    out, stopped_at = [], None
    for i, t in enumerate(ids):
        if d.add(t):
            stopped_at = i
            out.append(d.take())
            break
        out.append(d.take())
        assert "S" not in "".join(out)[len("The answer is 42. ") :]
    assert stopped_at is not None
    assert "".join(out) == "The answer is 42. "


def test_earliest_of_several_stop_strings_wins(tokenizers):
    tok = tokenizers["default"]
    d = IncrementalDetokenizer(tok, [], stop=["world", "lo"])
    for t in tok.encode("hello world"):
        if d.add(t):
            break
    assert d.text == "hel" and d.matched == "lo"
