"""Side by side on loopback: `specstream serve` vs Hugging Face's own OpenAI-compatible
server (`transformers serve --continuous-batching`), same model (the bundled SmolLM2-135M
converted to a local directory), same prompts, greedy. Each server is started, warmed up,
measured with the same load generator as `specstream bench serve`, and stopped before the
next one starts, so they never share the CPU.

    .venv/bin/python benchmarks/serve_comparison.py                   # ~15 min on 2 cores
    .venv/bin/python benchmarks/serve_comparison.py --concurrency 1 8 --num-requests 8

Needs `pip install "transformers[serving]"` for the peer (the script says so if missing).
Writes bench-results/peer/results.json and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _servers import free_port, stop_process, wait_up  # noqa: E402

from gateway.bench.loadgen import bench, print_table, write_json
from gateway.bench.plots import plot
from specstream.model.loader import resolve_model


def run_server(cmd: list[str], url: str, label: str, model: str, args, env: dict, log: Path) -> dict:
    print(f"starting {label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        try:
            wait_up(url, proc)
            # Warm-up (a peer may load the model on its first request).
            warm = httpx.post(f"{url}/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}, timeout=600)
            warm.raise_for_status()
            return asyncio.run(
                bench(f"{url}/v1", model=model, concurrency=args.concurrency, num_requests=args.num_requests, max_tokens=args.max_tokens, label=label)
            )
        finally:
            stop_process(proc)


def find(report: dict, prompt_set: str, concurrency: int) -> dict | None:
    for run in report["runs"]:
        if run["prompt_set"] == prompt_set and run.get("concurrency") == concurrency:
            return run["summary"]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench-results/peer")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model("smollm2-135m").path
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    reports = []

    port = free_port()
    ours = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--dtype", "bfloat16", "--log-level", "warning"]
    reports.append(run_server(ours, f"http://127.0.0.1:{port}", "specstream", "smollm2-135m", args, env, out / "specstream.log"))

    hf_cli = shutil.which("transformers", path=os.path.dirname(sys.executable)) or shutil.which("transformers")
    try:
        import fastapi  # noqa: F401  (the serving extra)
    except ImportError:
        hf_cli = None
    if hf_cli is None:
        print('transformers serve needs the serving extra: pip install "transformers[serving]"', file=sys.stderr)
    else:
        port = free_port()
        peer = [hf_cli, "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--continuous-batching", "--dtype", "bfloat16", "--log-level", "warning"]
        reports.append(run_server(peer, f"http://127.0.0.1:{port}", "transformers serve", model_dir, args, env, out / "transformers.log"))

    write_json(reports, out / "results.json")
    print()
    print_table(reports)
    for path in plot(reports, out):
        print(f"wrote {path}")
    if len(reports) == 2:
        ours_r, peer_r = reports
        print("\n## Goals")
        top = max(args.concurrency)
        for name in ("grounded", "chat"):
            a, b = find(ours_r, name, top), find(peer_r, name, top)
            if a and b and a["throughput_tok_s"] and b["throughput_tok_s"]:
                ratio = a["throughput_tok_s"] / b["throughput_tok_s"]
                print(f"- {name} c={top}: throughput {ratio:.2f}x the peer's (goal >= 1.5x: {'met' if ratio >= 1.5 else 'NOT met'}); "
                      f"p99 TTFT {a['ttft_ms'][99]} vs {b['ttft_ms'][99]} ms ({'lower' if a['ttft_ms'][99] < b['ttft_ms'][99] else 'NOT lower'})")
        a, b = find(ours_r, "grounded", 1), find(peer_r, "grounded", 1)
        if a and b and a["throughput_tok_s"] and b["throughput_tok_s"]:
            ratio = a["throughput_tok_s"] / b["throughput_tok_s"]
            print(f"- grounded c=1: {ratio:.2f}x the peer's tokens/s (goal >= 2x: {'met' if ratio >= 2 else 'NOT met'})")


if __name__ == "__main__":
    main()
