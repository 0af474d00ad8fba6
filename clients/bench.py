"""`specstream bench serve`: load-test a running OpenAI-compatible server (specstream's or
any other) over HTTP, at fixed concurrency levels or an open-loop request rate.

Per request it records TTFT, the gaps between streamed chunks (ITL), TPOT, end-to-end
latency and tokens; per run, throughput; and when the server exposes specstream's
Prometheus metrics, draft acceptance per position (from /metrics before and after).
Results go to a JSON file and PNG plots (latency CDFs, throughput and speedup vs
concurrency, acceptance per position).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from clients._client import AsyncClient
from clients._exceptions import APIError
from clients.bench_prompts import PROMPT_SETS


@dataclass
class RequestResult:
    prompt_set: str
    ok: bool
    error: str | None = None
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def one_request(client: AsyncClient, model: str, prompt_set: str, prompt: str, max_tokens: int, temperature: float) -> RequestResult:
    result = RequestResult(prompt_set, ok=False)
    start = time.perf_counter()
    last = None
    counted = 0
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=temperature,
            stream=True,
            stream_options={"include_usage": True},
        )
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage:
                    result.tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.delta.content:
                        counted += 1
                        if last is None:
                            result.ttft = now - start
                        else:
                            result.gaps.append(now - last)
                        last = now
        result.e2e = time.perf_counter() - start
        result.tokens = result.tokens or counted
        result.ok = True
    except (APIError, httpx.HTTPError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.tokens for r in ok)

    def ms(v):
        return None if v is None else round(v * 1000, 1)

    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "wall_s": round(wall, 3),
        "tokens": tokens,
        "throughput_tok_s": round(tokens / wall, 2) if wall else None,
        "requests_per_s": round(len(ok) / wall, 3) if wall else None,
        "ttft_ms": {q: ms(percentile([r.ttft for r in ok], q)) for q in (50, 90, 99)},
        "itl_ms": {q: ms(percentile(gaps, q)) for q in (50, 90, 99)},
        "tpot_ms": {q: ms(percentile([r.tpot for r in ok if r.tpot is not None], q)) for q in (50, 99)},
        "e2e_ms": {q: ms(percentile([r.e2e for r in ok], q)) for q in (50, 99)},
    }


def _progress(label: str, done: int, total: int) -> None:
    print(f"\r  {label}: {done}/{total} requests", end="" if done < total else "\n", file=sys.stderr, flush=True)


async def run_concurrency(client, model, prompts, concurrency: int, num_requests: int, max_tokens: int, temperature: float, label: str):
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(num_requests):
        queue.put_nowait(prompts[i % len(prompts)])
    results: list[RequestResult] = []

    async def worker():
        while True:
            try:
                prompt_set, prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await one_request(client, model, prompt_set, prompt, max_tokens, temperature))
            _progress(label, len(results), num_requests)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


async def run_rate(client, model, prompts, rate: float, num_requests: int, max_tokens: int, temperature: float, label: str, seed: int = 0):
    """Open loop: Poisson arrivals at `rate` requests/s, whatever the server's speed."""
    rng = random.Random(seed)
    results: list[RequestResult] = []

    async def fire(prompt_set, prompt):
        results.append(await one_request(client, model, prompt_set, prompt, max_tokens, temperature))
        _progress(label, len(results), num_requests)

    start = time.perf_counter()
    tasks = []
    for i in range(num_requests):
        tasks.append(asyncio.create_task(fire(*prompts[i % len(prompts)])))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def _labels(line: str) -> dict[str, str]:
    inner = line[line.index("{") + 1 : line.index("}")]
    return {k: v.strip('"') for k, v in (part.split("=", 1) for part in inner.split(",") if "=" in part)}


def parse_acceptance(metrics_text: str) -> dict | None:
    """Counters of specstream's spec-decode metrics from Prometheus text, or None. Per-position
    counters carry a method label (eagle, ngram, draft); per_pos sums over methods."""
    drafts = draft_tokens = accepted = None
    per_pos: dict[int, float] = {}
    by_method: dict[str, dict[str, dict[int, float]]] = {}
    for line in metrics_text.splitlines():
        if line.startswith("specstream_spec_decode_num_drafts_total "):
            drafts = float(line.split()[-1])
        elif line.startswith("specstream_spec_decode_num_draft_tokens_total "):
            draft_tokens = float(line.split()[-1])
        elif line.startswith("specstream_spec_decode_num_accepted_tokens_total "):
            accepted = float(line.split()[-1])
        elif line.startswith(("specstream_spec_decode_num_accepted_tokens_per_pos_total{", "specstream_spec_decode_num_draft_tokens_per_pos_total{")):
            labels = _labels(line)
            pos, value = int(labels["position"]), float(line.split()[-1])
            kind = "accepted" if "_accepted_" in line else "drafted"
            if kind == "accepted":
                per_pos[pos] = per_pos.get(pos, 0.0) + value
            if labels.get("method"):
                counts = by_method.setdefault(labels["method"], {"accepted": {}, "drafted": {}})
                counts[kind][pos] = value
    if drafts is None:
        return None
    return {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted, "per_pos": per_pos, "by_method": by_method}


async def scrape(http: httpx.AsyncClient, metrics_url: str) -> dict | None:
    try:
        r = await http.get(metrics_url, timeout=10)
    except httpx.HTTPError:
        return None
    return parse_acceptance(r.text) if r.status_code == 200 else None


def acceptance_delta(before: dict | None, after: dict | None) -> dict | None:
    if not before or not after:
        return None
    drafts = after["drafts"] - before["drafts"]
    if drafts <= 0:
        return None
    positions = sorted(after["per_pos"])
    return {
        "rounds_with_drafts": drafts,
        "acceptance_rate": (after["accepted"] - before["accepted"]) / max(after["draft_tokens"] - before["draft_tokens"], 1),
        # P(draft at position i accepted | a round drafted), the vLLM definition.
        "per_position": [(after["per_pos"][p] - before["per_pos"].get(p, 0)) / drafts for p in positions],
        # Per proposer: P(draft at position i accepted | that method drafted position i).
        "per_method": {m: _method_delta(before.get("by_method", {}).get(m), c) for m, c in after.get("by_method", {}).items()},
    }


def _method_delta(before: dict | None, after: dict) -> list[float]:
    before = before or {"accepted": {}, "drafted": {}}
    out = []
    for p in sorted(after["drafted"]):
        drafted = after["drafted"][p] - before["drafted"].get(p, 0)
        if drafted > 0:
            out.append(round((after["accepted"].get(p, 0) - before["accepted"].get(p, 0)) / drafted, 4))
    return out


async def bench(
    base_url: str,
    *,
    api_key: str | None = None,
    model: str | None = None,
    concurrency: list[int] | None = None,
    rate: float | None = None,
    num_requests: int = 16,
    prompt_sets: list[str] | None = None,
    max_tokens: int = 128,
    temperature: float = 0.0,
    label: str = "server",
) -> dict:
    """Run every level for every prompt set; return the report (JSON-ready)."""
    sets = prompt_sets or list(PROMPT_SETS)
    metrics_url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    report = {"label": label, "base_url": base_url, "max_tokens": max_tokens, "temperature": temperature, "runs": []}
    async with AsyncClient(base_url, api_key, max_retries=0, timeout=600) as client, httpx.AsyncClient() as http:
        model = model or (await client.models.list())[0].id
        report["model"] = model
        for name in sets:
            prompts = [(name, p) for p in PROMPT_SETS[name]]
            levels = [("rate", rate)] if rate else [("concurrency", c) for c in (concurrency or [1, 4, 8])]
            for kind, level in levels:
                before = await scrape(http, metrics_url)
                tag = f"{label} {name} {kind}={level}"
                if kind == "rate":
                    results, wall = await run_rate(client, model, prompts, level, num_requests, max_tokens, temperature, tag)
                else:
                    results, wall = await run_concurrency(client, model, prompts, level, max(num_requests, level), max_tokens, temperature, tag)
                after = await scrape(http, metrics_url)
                report["runs"].append(
                    {
                        "prompt_set": name,
                        kind: level,
                        "summary": summarize(results, wall),
                        "acceptance": acceptance_delta(before, after),
                        "ttft_s": [r.ttft for r in results if r.ok],
                        "itl_s": [g for r in results if r.ok for g in r.gaps],
                        "errors": [r.error for r in results if not r.ok][:5],
                    }
                )
    return report


def plot(reports: list[dict], out_dir: Path) -> list[Path]:
    """Latency CDFs, throughput and speedup vs concurrency, acceptance per position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    sets = sorted({run["prompt_set"] for rep in reports for run in rep["runs"]})

    fig, axes = plt.subplots(len(sets), 2, figsize=(11, 4 * len(sets)), squeeze=False)
    for row, name in enumerate(sets):
        for col, key in enumerate(("ttft_s", "itl_s")):
            ax = axes[row][col]
            for rep in reports:
                for run in rep["runs"]:
                    if run["prompt_set"] != name or not run[key]:
                        continue
                    values = sorted(v * 1000 for v in run[key])
                    level = run.get("concurrency", run.get("rate"))
                    ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=f"{rep['label']} @{level}")
            ax.set_xlabel(("TTFT" if key == "ttft_s" else "inter-chunk latency") + " (ms)")
            ax.set_ylabel("fraction of requests" if key == "ttft_s" else "fraction of chunks")
            ax.set_xscale("log")
            ax.set_title(f"{name}: {'TTFT' if key == 'ttft_s' else 'ITL'} CDF")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "latency_cdf.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for rep in reports:
        for name in sets:
            runs = sorted((r for r in rep["runs"] if r["prompt_set"] == name and "concurrency" in r), key=lambda r: r["concurrency"])
            if not runs:
                continue
            xs = [r["concurrency"] for r in runs]
            ys = [r["summary"]["throughput_tok_s"] or 0 for r in runs]
            axes[0].plot(xs, ys, marker="o", label=f"{rep['label']} {name}")
            axes[1].plot(xs, [y / ys[0] if ys[0] else 0 for y in ys], marker="o", label=f"{rep['label']} {name}")
    axes[0].set_title("throughput vs concurrency")
    axes[0].set_ylabel("tokens/s")
    axes[1].set_title("speedup vs its own concurrency-1 throughput")
    axes[1].set_ylabel("x")
    for ax in axes:
        ax.set_xlabel("concurrent streams")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "throughput.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    accepted = [(rep["label"], run) for rep in reports for run in rep["runs"] if run.get("acceptance")]
    if accepted:
        fig, ax = plt.subplots(figsize=(8, 4))
        for label, run in accepted:
            per = run["acceptance"]["per_position"]
            level = run.get("concurrency", run.get("rate"))
            ax.plot(range(1, len(per) + 1), per, marker="o", label=f"{label} {run['prompt_set']} @{level}")
        ax.set_xlabel("draft position")
        ax.set_ylabel("P(accepted | round drafted)")
        ax.set_title("acceptance per draft position")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(out_dir / "acceptance.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def print_table(reports: list[dict]) -> None:
    print("| server | prompts | level | tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | TPOT p50 (ms) | acceptance | errors |")
    print("|---|---|---|---:|---|---|---:|---:|---:|")
    for rep in reports:
        for run in rep["runs"]:
            s = run["summary"]
            level = f"c={run['concurrency']}" if "concurrency" in run else f"{run['rate']} req/s"
            acc = f"{run['acceptance']['acceptance_rate']:.0%}" if run.get("acceptance") else "-"
            methods = (run.get("acceptance") or {}).get("per_method") or {}
            if methods:
                # First three positions of each proposer: P(accepted | drafted there).
                acc += " (" + "; ".join(f"{m} " + "/".join(f"{a:.0%}" for a in per[:3]) for m, per in methods.items() if per) + ")"
            print(
                f"| {rep['label']} | {run['prompt_set']} | {level} | {s['throughput_tok_s']} | {s['ttft_ms'][50]} / {s['ttft_ms'][99]} | "
                f"{s['itl_ms'][50]} / {s['itl_ms'][99]} | {s['tpot_ms'][50]} | {acc} | {s['errors']} |"
            )


def write_json(reports: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(reports, indent=1))

