"""How long `specstream serve` takes to serve: a first start with an empty cache, then restarts.

    .venv/bin/python benchmarks/startup.py                  # defaults: one first start, three restarts
    .venv/bin/python benchmarks/startup.py --flags "--speculative-method off" --restarts 1

Each start runs `specstream serve FLAGS` on a free loopback port with SPECSTREAM_CACHE_DIR pointed at one
new temporary directory (empty for the first start, as the first start left it for the restarts), and
times, from the moment the process is started:
- `/health` 200 (the model loaded: the server serves);
- the first chat answer (8 tokens), sent at once;
- the compiled forward installed (the log's "the forward runs compiled"), where it compiles in the background.
Then it stops the server with SIGTERM and checks that it exits 0.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _servers import free_port, wait_up  # noqa: E402

INSTALLED = "the forward runs compiled"


def start(flags: str, cache: Path, log: Path, compile_timeout: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SPECSTREAM_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    env.pop("SPECSTREAM_COMPILE", None)
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--no-playground", *shlex.split(flags)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        wait_up(url, proc, timeout=1800)
        health = time.monotonic() - t0
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        answer = time.monotonic() - t0
        installed = None
        while "--no-compile" not in flags and time.monotonic() - t0 < compile_timeout:
            if INSTALLED in log.read_text():
                installed = time.monotonic() - t0
                break
            time.sleep(0.2)
    finally:
        proc.terminate()
        code = proc.wait(timeout=120)
    return {"health": health, "answer": answer, "installed": installed, "exit": code}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flags", default="", help="specstream serve flags")
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--compile-timeout", type=float, default=900, help="seconds to wait for the compiled forward")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        cache.mkdir()
        for n in range(args.restarts + 1):
            name = "first start (empty cache)" if n == 0 else f"restart {n}"
            row = start(args.flags, cache, Path(tmp) / f"serve-{n}.log", args.compile_timeout)
            rows.append((name, row))
            print(f"{name}: {row}", file=sys.stderr)

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(f"\n`specstream serve {args.flags}`, seconds from the process's start\n")
    print("| start | /health 200 | first answer (8 tokens) | compiled forward installed | exit |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {s(r['health'])} | {s(r['answer'])} | {s(r['installed'])} | {r['exit']} |")


if __name__ == "__main__":
    main()
