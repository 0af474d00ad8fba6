"""Where `specstream serve`'s resident memory goes: start-up phase by phase (the engine's own log line),
then after a load of concurrent chat streams, for each configuration given.

    .venv/bin/python benchmarks/memory.py                               # the defaults, then speculation off
    .venv/bin/python benchmarks/memory.py --configs "" "--speculative-method ngram" --streams 8

Each configuration is a string of `specstream serve` flags; the server runs with its own log in a
temporary directory, on a free loopback port. Resident memory is the server process's VmRSS (now)
and VmHWM (its peak), from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import free_port, wait_up  # noqa: E402

from gateway.bench.prompts import GROUNDED, OPEN_CHAT  # noqa: E402


def memory_mib(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def load(url: str, streams: int, max_tokens: int) -> int:
    """streams concurrent streamed chats (open chat and grounded prompts, alternating); tokens received."""
    prompts = [(OPEN_CHAT + GROUNDED)[i % (len(OPEN_CHAT) + len(GROUNDED))] for i in range(streams)]

    async def one(client: httpx.AsyncClient, prompt: str) -> int:
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        tokens = 0
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage": {' in line:
                    tokens = int(re.search(r'"completion_tokens": (\d+)', line).group(1))
        return tokens

    async with httpx.AsyncClient() as client:
        return sum(await asyncio.gather(*(one(client, p) for p in prompts)))


def run(flags: str, streams: int, max_tokens: int, settle: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--no-playground", *shlex.split(flags)],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        try:
            wait_up(url, proc, timeout=900)
            ready = memory_mib(proc.pid, "VmRSS")
            tokens = asyncio.run(load(url, streams, max_tokens))
            after, peak = memory_mib(proc.pid, "VmRSS"), memory_mib(proc.pid, "VmHWM")
            time.sleep(settle)  # idle: the engine gives freed heap back (Engine.idle)
            settled = memory_mib(proc.pid, "VmRSS")
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        phases = re.search(r"resident memory (.*)$", log.read_text(), re.M)
    return {"flags": flags or "(defaults)", "ready": ready, "after": after, "settled": settled, "peak": peak, "tokens": tokens,
            "phases": phases.group(1) if phases else "?"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["", "--speculative-method off"], help="serve flags, one string each")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds idle after the load before the last reading")
    args = ap.parse_args()
    rows = [run(flags, args.streams, args.max_tokens, args.settle) for flags in args.configs]
    print(f"\n| serve flags | resident MiB when ready | after {args.streams} streams (peak) | {args.settle:g} s later | tokens "
          "| start-up phases |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['flags']} | {r['ready']:.0f} | {r['after']:.0f} ({r['peak']:.0f}) | {r['settled']:.0f} | {r['tokens']} "
              f"| {r['phases']} |")


if __name__ == "__main__":
    main()
