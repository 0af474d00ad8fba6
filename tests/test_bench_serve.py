"""`specstream bench serve` against a live gateway: metrics per level, acceptance from
/metrics, JSON and PNG output."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.bench.loadgen import RequestResult, acceptance_delta, bench, parse_acceptance, summarize
from gateway.bench.plots import plot


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    from gateway.app import create_app
    from gateway.settings import GatewaySettings
    from gateway_server import LiveServer
    from specstream import AsyncEngine, EngineConfig, SpeculativeConfig

    engine = AsyncEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False),
        )
    )
    with LiveServer(create_app(engine, GatewaySettings(served_model_name="tiny"))) as server:
        yield server


def test_summary_percentiles_and_throughput():
    rs = [
        RequestResult("chat", True, ttft=0.1 * i, e2e=1.0 + 0.1 * i, tokens=11, gaps=[0.05] * 10) for i in range(1, 5)
    ]
    rs.append(RequestResult("chat", False, error="boom"))
    s = summarize(rs, wall=2.0)
    assert s["tokens"] == 44 and s["throughput_tok_s"] == 22.0 and s["errors"] == 1
    assert s["ttft_ms"][50] in (200.0, 300.0) and s["itl_ms"][99] == 50.0 and s["tpot_ms"][50] == 100.0


def test_acceptance_from_prometheus_text():
    before = parse_acceptance(
        "specstream_spec_decode_num_drafts_total 10.0\nspecstream_spec_decode_num_draft_tokens_total 40.0\n"
        "specstream_spec_decode_num_accepted_tokens_total 20.0\n"
        'specstream_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 8.0\n'
    )
    after = parse_acceptance(
        "specstream_spec_decode_num_drafts_total 20.0\nspecstream_spec_decode_num_draft_tokens_total 80.0\n"
        "specstream_spec_decode_num_accepted_tokens_total 30.0\n"
        'specstream_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 14.0\n'
        'specstream_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 4.0\n'
    )
    delta = acceptance_delta(before, after)
    assert delta["per_position"] == [0.6, 0.4] and delta["acceptance_rate"] == 0.25
    labelled = 'specstream_spec_decode_num_{0}_tokens_per_pos_total{{method="{2}",position="{1}"}} {3}\n'
    text = "specstream_spec_decode_num_drafts_total 10.0\nspecstream_spec_decode_num_draft_tokens_total 30.0\n"
    text += "specstream_spec_decode_num_accepted_tokens_total 12.0\n"
    text += labelled.format("draft", 0, "eagle", 8.0) + labelled.format("accepted", 0, "eagle", 6.0)
    text += labelled.format("draft", 1, "eagle", 4.0) + labelled.format("accepted", 1, "eagle", 1.0)
    text += labelled.format("draft", 0, "ngram", 2.0) + labelled.format("accepted", 0, "ngram", 2.0)
    zero = parse_acceptance(
        "specstream_spec_decode_num_drafts_total 0.0\nspecstream_spec_decode_num_draft_tokens_total 0.0\n"
        "specstream_spec_decode_num_accepted_tokens_total 0.0\n"
    )
    by_method = acceptance_delta(zero, parse_acceptance(text))
    assert by_method["per_method"] == {"eagle": [0.75, 0.25], "ngram": [1.0]}
    assert by_method["per_position"] == [0.8, 0.1]
    assert parse_acceptance("other_metric 1\n") is None


def test_bench_serve_end_to_end_writes_json_and_plots(live, tmp_path):
    report = asyncio.run(
        bench(f"{live.url}/v1", concurrency=[1, 2], num_requests=3, max_tokens=12, label="tiny-server")
    )
    assert report["model"] == "tiny"
    assert [(r["prompt_set"], r["concurrency"]) for r in report["runs"]] == [
        ("grounded", 1),
        ("grounded", 2),
        ("chat", 1),
        ("chat", 2),
    ]
    for run in report["runs"]:
        s = run["summary"]
        assert s["errors"] == 0 and s["requests"] == 3 and s["tokens"] == 36 and s["throughput_tok_s"] > 0
        assert s["ttft_ms"][50] > 0 and run["acceptance"] is not None
    files = plot([report], tmp_path)
    assert {f.name for f in files} == {"latency_cdf.png", "throughput.png", "acceptance.png"}
    assert all(f.stat().st_size > 10_000 for f in files)


def test_cli_bench_serve(live, tmp_path, capsys):
    from gateway.cli import main

    rc = main(
        [
            "bench",
            "serve",
            "--url",
            f"{live.url}/v1",
            "--concurrency",
            "2",
            "--num-requests",
            "2",
            "--max-tokens",
            "6",
            "--prompt-sets",
            "chat",
            "--label",
            "cli",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data[0]["label"] == "cli" and data[0]["runs"][0]["summary"]["tokens"] == 12
    assert "| cli | chat | c=2 |" in capsys.readouterr().out
