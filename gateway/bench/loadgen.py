"""`specstream bench serve`: load-test a running OpenAI-compatible server (specstream's or
any other) over HTTP, at fixed concurrency levels or an open-loop request rate.

Per request it records TTFT, the gaps between streamed chunks (ITL), TPOT, end-to-end
latency and tokens; per run, throughput; and when the server exposes specstream's
Prometheus metrics, draft acceptance per position (from /metrics before and after).
Results go to a JSON file and, through gateway.bench.plots, PNG plots. It talks to the
server only through the SDK's public API and plain HTTP.
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

from gateway.bench.prompts import PROMPT_SETS
from specstream_client import AsyncClient, APIError


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


async def one_request(
    client: AsyncClient, model: str, prompt_set: str, prompt: str, max_tokens: int, temperature: float
) -> RequestResult:
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


async def run_concurrency(
    client, model, prompts, concurrency: int, num_requests: int, max_tokens: int, temperature: float, label: str
):
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


async def run_rate(
    client,
    model,
    prompts,
    rate: float,
    num_requests: int,
    max_tokens: int,
    temperature: float,
    label: str,
    seed: int = 0,
):
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
        elif line.startswith(
            (
                "specstream_spec_decode_num_accepted_tokens_per_pos_total{",
                "specstream_spec_decode_num_draft_tokens_per_pos_total{",
            )
        ):
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
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted": accepted,
        "per_pos": per_pos,
        "by_method": by_method,
    }


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
        "acceptance_rate": (after["accepted"] - before["accepted"])
        / max(after["draft_tokens"] - before["draft_tokens"], 1),
        # P(draft at position i accepted | a round drafted), the vLLM definition.
        "per_position": [(after["per_pos"][p] - before["per_pos"].get(p, 0)) / drafts for p in positions],
        # Per proposer: P(draft at position i accepted | that method drafted position i).
        "per_method": {
            m: _method_delta(before.get("by_method", {}).get(m), c) for m, c in after.get("by_method", {}).items()
        },
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
                    results, wall = await run_rate(
                        client, model, prompts, level, num_requests, max_tokens, temperature, tag
                    )
                else:
                    results, wall = await run_concurrency(
                        client, model, prompts, level, max(num_requests, level), max_tokens, temperature, tag
                    )
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


TABLE_HEADER = (
    "| server | prompts | level | tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | TPOT p50 (ms) "
    "| acceptance | errors |\n|---|---|---|---:|---|---|---:|---:|---:|"
)


def print_table(reports: list[dict]) -> None:
    print(TABLE_HEADER)
    for rep in reports:
        for run in rep["runs"]:
            s = run["summary"]
            level = f"c={run['concurrency']}" if "concurrency" in run else f"{run['rate']} req/s"
            acc = f"{run['acceptance']['acceptance_rate']:.0%}" if run.get("acceptance") else "-"
            methods = (run.get("acceptance") or {}).get("per_method") or {}
            if methods:
                # First three positions of each proposer: P(accepted | drafted there).
                acc += (
                    " ("
                    + "; ".join(f"{m} " + "/".join(f"{a:.0%}" for a in per[:3]) for m, per in methods.items() if per)
                    + ")"
                )
            cells = [
                rep["label"],
                run["prompt_set"],
                level,
                s["throughput_tok_s"],
                f"{s['ttft_ms'][50]} / {s['ttft_ms'][99]}",
                f"{s['itl_ms'][50]} / {s['itl_ms'][99]}",
                s["tpot_ms"][50],
                acc,
                s["errors"],
            ]
            print("| " + " | ".join(str(c) for c in cells) + " |")


def write_json(reports: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(reports, indent=1))
