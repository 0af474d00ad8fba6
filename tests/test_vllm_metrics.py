"""/metrics carries the series that routers built for vLLM score pods by (the Gateway API Inference
Extension's endpoint picker, vLLM's production-stack router), named, typed and labelled as vLLM
exposes them, and they move under load as their definitions say."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import create_app
from gateway.settings import GatewaySettings
from gateway_server import LiveServer
from specstream import AsyncEngine, EngineConfig, SpeculativeConfig

MODEL = "tiny-served"
LOAD_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
USAGE_SERIES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_SERIES = (
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:gpu_prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits",
)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    # One running sequence at a time, so a second request waits while the first generates.
    config = EngineConfig(
        model=str(tiny_model_dir),
        dtype="float32",
        max_num_seqs=1,
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4),
    )
    engine = AsyncEngine(config)
    with LiveServer(create_app(engine, GatewaySettings(served_model_name=MODEL))) as live:
        yield live


def scrape(url: str) -> dict[str, tuple[str, dict[str, str], float]]:
    """Each family of /metrics by the name its TYPE line gives: (type, labels, value) of its one sample."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    families = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("vllm:"):
            [sample] = [s for s in family.samples if not s.name.endswith("_created")]
            families[family.name] = (family.type, sample.labels, sample.value)
    return families


def value(families, name: str) -> float:
    return families[name][2]


def chat(url: str, content: str, max_tokens: int) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_each_series_exists_with_vllm_type_and_labels(server):
    families = scrape(server.url)
    for name in LOAD_SERIES + USAGE_SERIES:
        kind, labels, _ = families[name]
        assert kind == "gauge" and labels == {"model_name": MODEL, "engine": "0"}, name
    for name in PREFIX_SERIES:
        kind, labels, _ = families[name]
        assert kind == "counter" and labels == {"model_name": MODEL, "engine": "0"}, name
    kind, info, one = families["vllm:cache_config_info"]
    assert kind == "gauge" and one == 1
    assert int(info["block_size"]) == 16 and int(info["num_gpu_blocks"]) > 0
    assert info["enable_prefix_caching"] == "True"
    text = httpx.get(f"{server.url}/metrics").text
    # The names routers match on, sample by sample (counters gain _total as in vLLM).
    for name in ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total", "vllm:kv_cache_usage_perc{"):
        assert name in text


def test_running_waiting_and_kv_usage_move_under_load_and_return_to_zero(server):
    idle = scrape(server.url)
    assert [value(idle, n) for n in LOAD_SERIES + USAGE_SERIES] == [0, 0, 0, 0]
    prompts = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France."]
    threads = [threading.Thread(target=chat, args=(server.url, p, 600)) for p in prompts]
    for t in threads:
        t.start()
    seen = []
    deadline = time.monotonic() + 60
    # With one sequence running at a time, the other request waits: both gauges show it.
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        families = scrape(server.url)
        seen.append([value(families, n) for n in LOAD_SERIES + USAGE_SERIES])
        if seen[-1][:2] == [1, 1]:
            break
        time.sleep(0.005)
    for t in threads:
        t.join(120)
    busy = [s for s in seen if s[:2] == [1, 1]]
    assert busy, f"never saw one request running and one waiting: {seen[-5:]}"
    running, waiting, usage, gpu_usage = busy[0]
    assert 0 < usage <= 1 and gpu_usage == usage
    after = scrape(server.url)
    # Finished requests' blocks stay in the prefix cache but count as free, as in vLLM.
    assert [value(after, n) for n in LOAD_SERIES + USAGE_SERIES] == [0, 0, 0, 0]


def test_prefix_cache_counters_count_prompt_tokens_looked_up_and_found(server):
    before = scrape(server.url)
    content = "Answer from this document. " + "Speculative decoding drafts tokens a large model verifies. " * 8
    first = chat(server.url, content, 2)["usage"]
    middle = scrape(server.url)
    again = chat(server.url, content, 2)["usage"]
    after = scrape(server.url)
    prompt = first["prompt_tokens"]
    for old, new, hits in ((before, middle, 0), (middle, after, again["prompt_tokens_details"]["cached_tokens"])):
        for prefix in ("vllm:", "vllm:gpu_"):
            assert value(new, f"{prefix}prefix_cache_queries") - value(old, f"{prefix}prefix_cache_queries") == prompt
            assert value(new, f"{prefix}prefix_cache_hits") - value(old, f"{prefix}prefix_cache_hits") == hits
    # The second time every full block but the one holding the prompt's last token was found.
    assert again["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // 16 * 16 > 0
