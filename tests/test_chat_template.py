"""--chat-template / EngineConfig(chat_template=...): a model without a template can chat, and
chat on such a model without one is refused with an error that names the flag."""

from __future__ import annotations

import shutil

import httpx
import pytest

from conftest import CHATML_TEMPLATE
from gateway.app import create_app
from gateway.settings import GatewaySettings
from specstream import (
    AsyncEngine,
    Engine,
    EngineConfig,
    InvalidRequestError,
    ModelError,
    SamplingParams,
    SpeculativeConfig,
)
from specstream.model.loader import load_tokenizer, resolve_model

CHAT = [{"role": "user", "content": "Hello!"}]
# A template unlike the tiny tokenizer's own, so using it is visible in the tokens.
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def untemplated_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its chat template removed."""
    path = tmp_path_factory.mktemp("no-template")
    for f in tiny_model_dir.iterdir():
        shutil.copy(f, path / f.name)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer = load_tokenizer(resolve_model(str(path)))
    tokenizer.chat_template = None
    tokenizer.save_pretrained(path)
    assert not load_tokenizer(resolve_model(str(path))).chat_template
    return path


def engine(path, chat_template=None) -> Engine:
    spec = SpeculativeConfig(method="off")
    config = EngineConfig(model=str(path), dtype="float32", speculative=spec, chat_template=chat_template)
    return Engine(config, log=False)


def test_chat_without_a_template_names_the_flag(untemplated_dir):
    with pytest.raises(InvalidRequestError, match="--chat-template") as err:
        engine(untemplated_dir).processor.encode(CHAT)
    assert err.value.param == "prompt"  # the gateway calls it "messages" for chat


def test_template_file_makes_chat_work(untemplated_dir, tmp_path):
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML_TEMPLATE)
    eng = engine(untemplated_dir, str(template))
    expected = eng.tokenizer.encode("<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")
    assert eng.processor.encode(CHAT) == expected
    out = eng.generate(CHAT, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == expected and len(out.token_ids) == 3


def test_inline_template_replaces_the_model_own(tiny_model_dir):
    eng = engine(tiny_model_dir, PLAIN_TEMPLATE)
    assert eng.processor.encode(CHAT) == eng.tokenizer.encode("user: Hello!\nassistant:")


async def test_async_engine_tokenizer_thread_uses_the_template_too(untemplated_dir):
    # AsyncEngine tokenizes with its own copy of the engine's tokenizer, on its own thread:
    # the template must reach that copy, or chat through the server would still be refused.
    eng = engine(untemplated_dir, PLAIN_TEMPLATE)
    async with AsyncEngine(engine=eng) as aengine:
        assert aengine.tokenizer is not eng.tokenizer and aengine.tokenizer.chat_template == PLAIN_TEMPLATE
        out = await aengine.generate(CHAT, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert out.prompt_token_ids == eng.tokenizer.encode("user: Hello!\nassistant:")


async def test_chat_over_http_without_a_template_is_a_400_naming_the_flag(untemplated_dir):
    aengine = AsyncEngine(engine=engine(untemplated_dir))
    app = create_app(aengine, GatewaySettings(served_model_name="tiny"))
    async with aengine, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        refused = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": CHAT})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert "--chat-template" in error["message"] and error["param"] == "messages"
        plain = await client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
        assert plain.status_code == 200


def test_missing_template_file_is_a_model_error(tiny_model_dir):
    with pytest.raises(ModelError, match="chat template file 'no/such/template.jinja' does not exist"):
        engine(tiny_model_dir, "no/such/template.jinja")


def test_cli_refuses_a_missing_template_before_loading(tiny_model_dir, capsys):
    from gateway.cli import main

    assert main(["serve", "--model", str(tiny_model_dir), "--chat-template", "missing.jinja"]) == 2
    assert "chat template file 'missing.jinja' does not exist" in capsys.readouterr().err
