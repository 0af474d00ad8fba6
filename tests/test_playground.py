"""The chat playground (gateway/playground.py, gateway/static/) in a real headless Chromium
driven by Selenium, against live servers: a reply streams in coloured by how its tokens
arrived, Stop frees the request on the server, markup from the model and from the user is
shown as text, the page works with an API key and on a phone-sized screen, and
`--no-playground` turns it off.

Needs Debian's `chromium` and `chromium-driver` (installed by `make setup` as root with apt)
and selenium (the test extra); skipped with a message saying so where they are missing.
The README's picture is written by the first test: `UPDATE_README_SCREENSHOT=1 pytest
tests/test_playground.py` saves it to docs/img/playground.png.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from gateway_server import LiveServer

from gateway.app import create_app
from gateway.cli import build_parser
from gateway.settings import GatewaySettings
from specstream import AsyncEngine, EngineConfig, SpeculativeConfig

try:
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # the browser tests skip themselves (see the chrome fixture); the others run
    webdriver = None

README_SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "img" / "playground.png"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,1000",
]
KEY = "playground-test-key"
# A copy-heavy request: n-gram lookup finds most of the answer in the prompt.
GROUNDED = (
    "Rewrite in the past tense: The quick brown fox jumps over the lazy dog and runs into the forest. "
    "It finds a river, drinks the cold water and sleeps under an old tree until the sun goes down."
)


TINY_PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def no_timing_speculation(k: int) -> SpeculativeConfig:
    # Non-adaptive k drafts whenever the n-gram proposer finds a match, so what the page
    # colours does not depend on start-up timing on a busy machine; fp32 greedy output is
    # the target's own either way.
    return SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=False)


@pytest.fixture(scope="module")
def chrome(tmp_path_factory):
    if webdriver is None:
        pytest.skip("selenium is not installed: pip install -e '.[test]'")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (browser and driver):
        pytest.skip("Debian's chromium and chromium-driver are not installed (make setup installs them as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    session = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))
    yield session
    session.quit()


@pytest.fixture(scope="module")
def default_server():
    engine = AsyncEngine(EngineConfig(dtype="float32", speculative=no_timing_speculation(8)))
    with LiveServer(create_app(engine)) as live:
        yield live


def tiny_server(model_dir, keys: tuple[str, ...] = ()) -> LiveServer:
    engine = AsyncEngine(EngineConfig(model=str(model_dir), dtype="float32", speculative=no_timing_speculation(4)))
    return LiveServer(create_app(engine, GatewaySettings(served_model_name="tiny", api_keys=keys)))


@pytest.fixture(scope="module")
def open_server(tiny_model_dir):
    with tiny_server(tiny_model_dir) as live:
        yield live


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir):
    with tiny_server(tiny_model_dir, (KEY,)) as live:
        yield live


# ------------------------------------------------------------------------------ helpers
def open_page(chrome, server, expect_status: str = "model ") -> None:
    chrome.get(f"{server.url}/")
    chrome.execute_script("sessionStorage.clear()")
    chrome.refresh()
    wait_for(chrome, lambda: expect_status in chrome.find_element(By.ID, "server-status").text, "the page's status")


def wait_for(chrome, condition, what: str, timeout: float = 60):
    wait = WebDriverWait(chrome, timeout, poll_frequency=0.1)
    return wait.until(lambda _: condition(), message=f"waiting for {what}")


def set_field(chrome, element_id: str, value: str) -> None:
    field = chrome.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def send(chrome, text: str) -> None:
    set_field(chrome, "prompt", text)
    chrome.find_element(By.ID, "send").click()


def last_reply_stats(chrome) -> str:
    stats = chrome.find_elements(By.CSS_SELECTOR, "#transcript .assistant .stats")
    return stats[-1].text if stats else ""


def wait_reply_done(chrome, timeout: float = 300) -> str:
    ended = re.compile(r"· (stop|length|stopped|error)$")
    wait_for(chrome, lambda: ended.search(last_reply_stats(chrome)), "the reply to end", timeout)
    return last_reply_stats(chrome)


def reply_texts(chrome) -> list[str]:
    script = "return [...document.querySelectorAll('#transcript .assistant .text')].map(e => e.textContent)"
    return chrome.execute_script(script)


def api_reply(server, model: str, prompt: str, max_tokens: int) -> dict:
    """The server's own greedy reply, as a plain API client gets it."""
    messages = [{"role": "user", "content": prompt}]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300).json()


def metric(server, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def tags_in_transcript_text(chrome) -> set[str]:
    script = "return [...document.querySelectorAll('#transcript .text *')].map(e => e.tagName)"
    return set(chrome.execute_script(script))


def severe_console_errors(chrome) -> list[str]:
    return [e["message"] for e in chrome.get_log("browser") if e["level"] == "SEVERE"]


# ------------------------------------------------------------------------------ the page
def test_reply_streams_in_coloured_by_how_its_tokens_arrived(chrome, default_server, tmp_path):
    open_page(chrome, default_server, "model smollm2-135m")
    set_field(chrome, "max-tokens", "64")
    send(chrome, GROUNDED)
    stats = wait_reply_done(chrome)

    # The page shows exactly the server's greedy reply, split by label with no leftovers.
    expected = api_reply(default_server, "smollm2-135m", GROUNDED, 64)
    assert reply_texts(chrome) == [expected["choices"][0]["message"]["content"]]
    drafted = chrome.find_elements(By.CSS_SELECTOR, "#transcript .assistant .tok-draft")
    own = chrome.find_elements(By.CSS_SELECTOR, "#transcript .assistant .tok-target")
    assert drafted and own, "a copy-heavy reply has both accepted drafts and the target's own tokens"
    assert not chrome.find_elements(By.CSS_SELECTOR, "#transcript .tok-mixed"), "byte-level BPE splits exactly"
    rounds = chrome.find_elements(By.CSS_SELECTOR, "#transcript .assistant .round")
    assert len(rounds) < expected["usage"]["completion_tokens"], "accepted runs arrive several tokens per round"

    assert f"{expected['usage']['completion_tokens']} tokens · " in stats
    assert re.search(r"\d+\.\d tok/s · first token \d+ ms · \d+\.\d\d accepted/round over \d+ rounds", stats), stats
    assert stats.endswith(f"· {expected['choices'][0]['finish_reason']}")

    # The live charts: acceptance bars per draft position and a tokens/s line from /metrics.
    wait_for(chrome, lambda: chrome.find_elements(By.CSS_SELECTOR, "#chart-acceptance rect.bar"), "acceptance bars")
    wait_for(chrome, lambda: chrome.find_elements(By.CSS_SELECTOR, "#chart-tps polyline"), "the tokens/s line")
    wait_for(chrome, lambda: "running 0" in chrome.find_element(By.ID, "metrics-status").text, "0 running on the page")
    assert severe_console_errors(chrome) == []

    shot = tmp_path / "playground.png"
    assert chrome.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("UPDATE_README_SCREENSHOT") == "1":
        README_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, README_SCREENSHOT)


def test_a_round_that_cannot_be_split_keeps_its_text_in_one_shade(chrome, open_server):
    # The tiny random model emits stray UTF-8 lead bytes; the server's detokenizer and the
    # browser's decoder replace them at different moments, so some rounds cannot be matched
    # to their tokens: those are drawn whole, shaded by their accepted share.
    open_page(chrome, open_server)
    set_field(chrome, "max-tokens", "40")
    send(chrome, TINY_PROMPT)
    stats = wait_reply_done(chrome)
    expected = api_reply(open_server, "tiny", TINY_PROMPT, 40)["choices"][0]["message"]["content"]
    assert reply_texts(chrome) == [expected] and "\ufffd" in expected
    shares = chrome.execute_script(
        "return [...document.querySelectorAll('#transcript .tok-mixed')].map(e => e.style.getPropertyValue('--share'))"
    )
    assert shares and all(0 <= float(share) <= 1 for share in shares)
    assert f"{len(shares)} rounds coloured by share" in stats


def test_stop_aborts_the_reply_and_the_server_frees_the_request(chrome, default_server):
    open_page(chrome, default_server)
    aborted = metric(default_server, 'specstream_request_success_total{finished_reason="abort"}')
    set_field(chrome, "max-tokens", "4000")
    chrome.find_element(By.ID, "ignore-eos").click()
    send(chrome, "Count from one to one thousand in words.")
    wait_for(chrome, lambda: len(reply_texts(chrome)[-1]) > 10, "the reply to start streaming")
    assert metric(default_server, "specstream_num_requests_running") == 1
    chrome.find_element(By.ID, "stop").click()
    assert wait_reply_done(chrome).endswith("· stopped")
    deadline = time.monotonic() + 10
    while metric(default_server, "specstream_num_requests_running") != 0:
        assert time.monotonic() < deadline, "the server still runs the stopped request"
        time.sleep(0.05)
    assert metric(default_server, 'specstream_request_success_total{finished_reason="abort"}') == aborted + 1
    assert chrome.find_element(By.ID, "send").is_enabled() and not chrome.find_element(By.ID, "stop").is_enabled()


def test_markup_in_the_models_reply_is_shown_as_text(chrome, default_server):
    open_page(chrome, default_server)
    set_field(chrome, "max-tokens", "12")
    # SmolLM2's greedy fp32 reply to this starts with "```javascript\n<script>\n".
    send(chrome, "Show the HTML tag that includes a JavaScript file named app.js.")
    wait_reply_done(chrome)
    assert "<script>" in reply_texts(chrome)[-1]
    assert tags_in_transcript_text(chrome) <= {"SPAN"}, "model text becomes text nodes in spans, never elements"


def test_markup_in_the_users_message_is_shown_as_text(chrome, open_server):
    open_page(chrome, open_server)
    set_field(chrome, "max-tokens", "4")
    user_text = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script> <b>bold?</b>'
    send(chrome, user_text)
    wait_reply_done(chrome)
    assert chrome.execute_script("return document.querySelector('#transcript .user .text').textContent") == user_text
    assert tags_in_transcript_text(chrome) <= {"SPAN"}
    assert chrome.execute_script("return window.pwned === undefined")


def test_usable_on_a_phone_sized_screen(chrome, open_server):
    chrome.set_window_size(390, 844)
    try:
        open_page(chrome, open_server)
        set_field(chrome, "max-tokens", "8")
        send(chrome, "The quick brown fox")
        wait_reply_done(chrome)
        width = chrome.execute_script("return window.innerWidth")
        assert chrome.execute_script("return document.documentElement.scrollWidth") <= width, "no sideways scrolling"
        for element_id in ("prompt", "send", "stop", "api-key", "chart-acceptance"):
            rect = chrome.find_element(By.ID, element_id).rect
            assert rect["x"] >= 0 and rect["x"] + rect["width"] <= width, element_id
    finally:
        chrome.set_window_size(1280, 1000)


def test_page_works_with_an_api_key_kept_in_session_storage(chrome, keyed_server):
    page = httpx.get(f"{keyed_server.url}/")
    assert page.status_code == 200 and KEY not in page.text, "the page is public and holds no secret"
    open_page(chrome, keyed_server, "needs an API key")
    send(chrome, TINY_PROMPT)  # without the key nothing is sent, and the message stays in the box
    prompt_box = chrome.find_element(By.ID, "prompt")
    wait_for(chrome, lambda: prompt_box.get_attribute("value") == TINY_PROMPT, "the message to be kept")
    assert not chrome.find_elements(By.CSS_SELECTOR, "#transcript .turn")
    chrome.find_element(By.ID, "api-key").send_keys(KEY, Keys.TAB)
    wait_for(chrome, lambda: "model tiny" in chrome.find_element(By.ID, "server-status").text, "the key to be accepted")
    set_field(chrome, "max-tokens", "16")
    send(chrome, TINY_PROMPT)
    assert re.search(r"tok/s .* length$", wait_reply_done(chrome))
    assert chrome.execute_script("return sessionStorage.getItem('specstream-api-key')") == KEY
    assert chrome.execute_script("return localStorage.length") == 0 and chrome.get_cookies() == []
    # /metrics needs no key, so the charts work for everyone who can load the page.
    wait_for(chrome, lambda: "running" in chrome.find_element(By.ID, "metrics-status").text, "metrics")


# ---------------------------------------------------------------------- without a browser
async def test_page_routes_and_the_no_playground_flag(tiny_model_dir):
    engine = AsyncEngine(EngineConfig(model=str(tiny_model_dir), speculative=no_timing_speculation(4)))
    on = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine)), base_url="http://t")
    off = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(engine, GatewaySettings(playground=False))), base_url="http://t"
    )
    async with on, off:
        for path in ("/", "/playground"):
            page = await on.get(path)
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            assert "script-src 'self'" in page.headers["content-security-policy"]
            assert (await off.get(path)).status_code == 404
        script = await on.get("/playground/static/playground.js")
        assert script.status_code == 200 and "textContent" in script.text and "innerHTML" not in script.text
        assert (await on.get("/playground/static/..%2Fapp.py")).status_code == 404
        assert (await on.get("/playground/server.json")).json() == {"speculative_method": "ngram"}
        missing = await off.get("/")
        assert missing.json()["error"]["type"] == "not_found_error"
    assert build_parser().parse_args(["serve", "--no-playground"]).no_playground
    assert not build_parser().parse_args(["serve"]).no_playground
