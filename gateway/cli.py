"""The `specstream` command line: `serve` runs the OpenAI-compatible server; `chat` and
`bench serve` talk to any OpenAI-compatible server through specstream_client's public API.

Every flag has an environment variable (SPECSTREAM_<FLAG>, e.g. SPECSTREAM_PORT); flags win. The engine's
choices and defaults come from specstream.config (which imports no torch), so they are declared once.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from gateway.drain import DEFAULT_SHUTDOWN_TIMEOUT, MAX_SHUTDOWN_TIMEOUT, check_shutdown_timeout
from specstream.config import DTYPES, QUANTIZATION_MODES, SPECULATIVE_METHODS, EngineConfig, SpeculativeConfig

if TYPE_CHECKING:  # the CLI imports torch (through specstream) only for the commands that need it
    from gateway.settings import GatewaySettings
    from specstream import AsyncEngine


def _env(name: str, default=None):
    return os.environ.get(f"SPECSTREAM_{name.upper().replace('-', '_')}", default)


def _add_serve(sub) -> None:
    engine, spec = EngineConfig(), SpeculativeConfig()  # the defaults
    p = sub.add_parser("serve", help=f"serve a model over the OpenAI API (default: the bundled {engine.model})")
    a = p.add_argument
    a("--model", default=_env("model", engine.model), help="bundled alias, HF directory, .gguf path or hub id")
    a(
        "--served-model-name",
        default=_env("served_model_name"),
        help="the name clients send as 'model' (default: --model)",
    )
    a(
        "--speculative-method",
        default=_env("speculative_method", spec.method),
        choices=SPECULATIVE_METHODS,
    )
    a("--num-speculative-tokens", type=int, default=int(_env("num_speculative_tokens", spec.num_speculative_tokens)))
    a(
        "--draft-model",
        default=_env("draft_model"),
        help="draft model (method draft) or draft-head directory (eagle, auto; default: the bundled head)",
    )
    a(
        "--suffix-max-cached-requests",
        type=int,
        default=int(_env("suffix_max_cached_requests", spec.suffix_max_cached_requests)),
        help="earlier requests whose outputs suffix decoding (methods suffix, auto) drafts from; oldest dropped first",
    )
    a(
        "--no-tree-drafts",
        action="store_true",
        default=_env("no_tree_drafts", "") in ("1", "true"),
        help="verify only chains: the likeliest path where a proposer has several continuations (suffix "
        "decoding, n-gram lookup's several occurrences)",
    )
    a("--suffix-max-depth", type=int, default=int(_env("suffix_max_depth", spec.suffix_max_depth)))
    a(
        "--suffix-max-spec-factor",
        type=float,
        default=float(_env("suffix_max_spec_factor", spec.suffix_max_spec_factor)),
    )
    a("--suffix-min-token-prob", type=float, default=float(_env("suffix_min_token_prob", spec.suffix_min_token_prob)))
    a("--chat-template", default=_env("chat_template"), help="Jinja chat template, file or inline")
    a("--dtype", default=_env("dtype", engine.dtype), choices=DTYPES)
    a(
        "--quantization",
        default=_env("quantization", engine.quantization),
        choices=QUANTIZATION_MODES,
        help="weights of the projections: auto (default) = the model file's own 4/8-bit blocks where it has "
        "them, on CPU; a8 = those blocks times 8-bit activation blocks, as integers (faster "
        "verification with VNNI or AMX, less accurate)",
    )
    a("--device", default=_env("device", engine.device))
    a("--host", default=_env("host", "127.0.0.1"))
    a("--port", type=int, default=int(_env("port", "8000")))
    a(
        "--api-key",
        action="append",
        default=None,
        help="accepted Bearer key; repeat for several (env: SPECSTREAM_API_KEYS, comma-separated)",
    )
    _add_engine_flags(a, engine)
    a("--max-waiting", type=int, default=int(_env("max_waiting", "256")), help="queued requests before 429")
    a("--max-n", type=int, default=int(_env("max_n", "8")))
    a("--max-body-bytes", type=int, default=int(_env("max_body_bytes", str(4 * 2**20))))
    a(
        "--shutdown-timeout",
        type=float,
        default=float(_env("shutdown_timeout", str(DEFAULT_SHUTDOWN_TIMEOUT))),
        help="on SIGTERM, seconds that requests in flight have to finish before they are cut "
        f"(new ones get 503 meanwhile; 0..{MAX_SHUTDOWN_TIMEOUT:g}, default {DEFAULT_SHUTDOWN_TIMEOUT:g})",
    )
    a("--log-level", default=_env("log_level", "info"))
    no_playground = _env("no_playground", "") not in ("", "0")
    a("--no-playground", action="store_true", default=no_playground, help="do not serve the chat page at /")
    p.set_defaults(func=_serve)


def _add_engine_flags(a, engine: EngineConfig) -> None:
    """serve's flags for the engine's batching, caching, numerics and compile (defaults: EngineConfig's)."""
    a("--max-num-seqs", type=int, default=int(_env("max_num_seqs", engine.max_num_seqs)))
    a("--max-num-batched-tokens", type=int, default=int(_env("max_num_batched_tokens", engine.max_num_batched_tokens)))
    a("--max-model-len", type=int, default=int(_env("max_model_len", "0")) or None)
    a("--kv-cache-tokens", type=int, default=int(_env("kv_cache_tokens", "0")) or None)
    a(
        "--no-prefix-caching",
        action="store_true",
        default=_env("no_prefix_caching", "") in ("1", "true"),
        help="recompute every prompt instead of reusing the KV of earlier requests' shared prefixes",
    )
    a(
        "--deterministic",
        action="store_true",
        default=_env("deterministic", "") in ("1", "true"),
        help="batch- and speculation-invariant numerics: the same tokens whatever the batch and drafts; about free "
        "where the kernels compute a row alone (a GGUF model on a CPU with AVX512-BF16 and no AMX), slower "
        "elsewhere (attention, or the whole step, in padded tiles, drafts verified as chains)",
    )
    a(
        "--no-compile",
        dest="compile",
        action="store_false",
        default=engine.compile,  # SPECSTREAM_COMPILE, read by EngineConfig
        help="run the forward eager: skip torch.compile of decode/verification steps (compiled in the background "
        "while the eager forward serves, and cached on disk)",
    )
    a(
        "--compile-before-serving",
        action="store_true",
        default=_env("compile_before_serving", "") in ("1", "true"),
        help="compile before /health answers 200, not in the background while serving (a first start on a "
        "machine then takes about two minutes more before it serves)",
    )
    a(
        "--allow-special-tokens-in-content",
        action="store_true",
        default=_env("allow_special_tokens_in_content", "") in ("1", "true"),
        help="let chat message text that spells a special token become that token (off: it stays text)",
    )
    a(
        "--max-prompt-chars",
        type=int,
        default=int(_env("max_prompt_chars", "0")) or None,
        help="characters a prompt may have before it is tokenized (default: 32 per token of context)",
    )
    a(
        "--seed",
        type=int,
        default=int(_env("seed", engine.seed)),
        help="seeds the draws for requests that bring no seed",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration `specstream serve` flags describe."""
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_tokens=args.kv_cache_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        chat_template=args.chat_template,
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
        max_prompt_chars=args.max_prompt_chars,
        seed=args.seed,
        quantization=args.quantization,
        deterministic=args.deterministic,
        compile=args.compile,
        compile_in_background=not args.compile_before_serving,
        speculative=SpeculativeConfig(
            method=args.speculative_method,
            num_speculative_tokens=args.num_speculative_tokens,
            draft_model=args.draft_model,
            suffix_max_depth=args.suffix_max_depth,
            suffix_max_spec_factor=args.suffix_max_spec_factor,
            suffix_min_token_prob=args.suffix_min_token_prob,
            suffix_max_cached_requests=args.suffix_max_cached_requests,
            tree_drafts=not args.no_tree_drafts,
        ),
    )


def _serve(args: argparse.Namespace) -> int:
    from gateway.settings import GatewaySettings
    from specstream import AsyncEngine

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = args.api_key or [k.strip() for k in (_env("api_keys") or "").split(",") if k.strip()]
    try:
        config = engine_config(args)
        settings = GatewaySettings(
            served_model_name=args.served_model_name,
            api_keys=tuple(keys),
            max_body_bytes=args.max_body_bytes,
            max_n=args.max_n,
            playground=not args.no_playground,
        )
        check_shutdown_timeout(args.shutdown_timeout)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The port first: a server that cannot listen exits now, before it loads anything.
    sock = _listen_or_say_why(args.host, args.port)
    if sock is None:
        return 1
    from specstream import ModelError, check_draft_head, resolve_model
    from specstream.engine.builder import EngineBuilder
    from specstream.model.loader import read_chat_template

    try:
        EngineBuilder(config).build_kernels_ahead()  # the compiler runs while the model converts
        # Fail fast on a bad name or template (and convert the bundled model) before the server starts.
        resolve_model(args.model)
        if args.chat_template:
            read_chat_template(args.chat_template)
        if args.speculative_method in ("eagle", "auto"):
            # A draft head for another target fails here, naming both.
            check_draft_head(args.model, args.draft_model, args.speculative_method)
        elif args.draft_model:
            resolve_model(args.draft_model)
    except (ModelError, ValueError) as exc:
        sock.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("specstream.gateway").info(
        "loading '%s' (%s speculation); /health answers 503 until it is ready", args.model, args.speculative_method
    )
    engine = AsyncEngine(config, max_waiting=args.max_waiting)
    code = serve(
        engine,
        settings,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        sock=sock,
        shutdown_timeout=args.shutdown_timeout,
    )
    if engine.engine is not None and engine.engine.compiling:
        # A background compile cannot be stopped, and finalizing the interpreter under its threads aborts
        # the process (C++ terminate): with the server done and the logs flushed, end here.
        logging.getLogger("specstream.gateway").info("leaving the background compile unfinished")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (OSError when it cannot be: the port is taken, the address is
    not this machine's), for uvicorn to listen on."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _listen_or_say_why(host: str, port: int) -> socket.socket | None:
    """listen_socket, or None after saying on stderr why it could not be bound."""
    try:
        return listen_socket(host, port)
    except OSError as exc:
        print(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return None


def serve(
    engine: AsyncEngine,
    settings: GatewaySettings,
    *,
    host: str,
    port: int,
    log_level: str = "info",
    sock: socket.socket | None = None,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
) -> int:
    """Run the server until it is stopped (0) or the engine fails to load or fails fatally
    later (1, with the error on stderr), so that a supervisor restarts a failed server
    instead of leaving it answering 503 forever. sock: a socket bound already (listen_socket);
    else one is bound here, and a port in use is an error before the engine starts. SIGTERM
    drains: requests in flight get shutdown_timeout seconds to finish (gateway/drain.py)."""
    import uvicorn

    from gateway.app import create_app
    from gateway.drain import DrainingServer

    failures: list[BaseException] = []

    def stop_on_failure(exc: BaseException) -> None:
        failures.append(exc)
        server.should_exit = True

    sock = sock or _listen_or_say_why(host, port)
    if sock is None:
        return 1
    app = create_app(engine, settings, on_engine_failure=stop_on_failure)
    # The drain is the graceful period; what uvicorn's own shutdown then finds still open is cut.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), timeout_graceful_shutdown=1)
    server = DrainingServer(config, app.state.drain, shutdown_timeout)
    server.run(sockets=[sock])
    if failures:
        print(f"error: the engine failed, exiting: {failures[0]}", file=sys.stderr)
        return 1
    return 0 if server.started else 1


def _add_chat(sub) -> None:
    p = sub.add_parser("chat", help="chat in the terminal with a running server (ours or any OpenAI-compatible one)")
    p.add_argument("--url", default=_env("url", "http://127.0.0.1:8000/v1"), help="the server's /v1 base URL")
    p.add_argument("--api-key", default=_env("api_key"))
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=None)
    p.set_defaults(func=_chat)


def _chat(args: argparse.Namespace) -> int:
    from gateway.chat_repl import run_chat
    from specstream_client import Client

    with Client(args.url, args.api_key, max_retries=2) as client:
        return run_chat(
            client, model=args.model, system=args.system, max_tokens=args.max_tokens, temperature=args.temperature
        )


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    p = bench.add_parser("serve", help="load-test a running OpenAI-compatible server; writes JSON and PNG plots")
    p.add_argument("--url", default=_env("url", "http://127.0.0.1:8000/v1"), help="the server's /v1 base URL")
    p.add_argument("--api-key", default=_env("api_key"))
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--label", default="server", help="name of this server in tables and plots")
    level = p.add_mutually_exclusive_group()
    level.add_argument("--concurrency", type=int, nargs="+", default=None, help="closed-loop levels (default 1 4 8)")
    level.add_argument("--rate", type=float, default=None, help="open-loop Poisson arrivals, requests/s")
    p.add_argument("--num-requests", type=int, default=16, help="requests per level (at least the concurrency)")
    p.add_argument("--prompt-sets", nargs="+", default=["grounded", "chat"], choices=["grounded", "chat"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--out", default="bench-results", help="directory for results.json and the plots")
    p.set_defaults(func=_bench_serve)


def _bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from gateway.bench.loadgen import bench, print_table, write_json
    from gateway.bench.plots import plot

    report = asyncio.run(
        bench(
            args.url,
            api_key=args.api_key,
            model=args.model,
            concurrency=args.concurrency,
            rate=args.rate,
            num_requests=args.num_requests,
            prompt_sets=args.prompt_sets,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            label=args.label,
        )
    )
    out = Path(args.out)
    write_json([report], out / "results.json")
    print_table([report])
    for path in [out / "results.json", *plot([report], out)]:
        print(f"wrote {path}")
    return 0 if all(run["summary"]["errors"] == 0 for run in report["runs"]) else 1


def _add_train_draft(sub) -> None:
    p = sub.add_parser("train-draft", help="train an EAGLE-3 draft head for a model (CPU, no downloads)")
    p.add_argument(
        "--model", default=_env("model", "smollm2-135m"), help="target: bundled alias, HF directory or .gguf path"
    )
    p.add_argument("--out", required=True, help="directory for the head (EAGLE-3 format), report.json and work/")
    p.add_argument(
        "--prompts",
        default=None,
        help="JSONL of prompts (strings or chat messages); default: the target writes its own",
    )
    p.add_argument("--minutes", type=float, default=45.0, help="wall-clock budget of the whole run")
    p.add_argument(
        "--tokens", type=int, default=None, help="budget of training token-passes (default: --minutes decides)"
    )
    p.add_argument("--resume", action="store_true", help="continue from DIR/work (data and checkpoint)")
    p.add_argument("--num-prompts", type=int, default=1500)
    p.add_argument("--max-answer-tokens", type=int, default=256)
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per training step")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument(
        "--data-share",
        type=float,
        default=0.4,
        help="most of --minutes that writing prompts and answers may take (the rest: features, training)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_train_draft)


def _train_draft(args: argparse.Namespace) -> int:
    import json

    from specstream import TrainConfig, train_draft

    logging.basicConfig(level="INFO", format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    cfg = TrainConfig(
        model=args.model,
        out=args.out,
        prompts=args.prompts,
        minutes=args.minutes,
        tokens=args.tokens,
        resume=args.resume,
        num_prompts=args.num_prompts,
        max_answer_tokens=args.max_answer_tokens,
        draft_vocab_size=args.draft_vocab_size,
        ttt_steps=args.ttt_steps,
        batch_size=args.batch_size,
        lr=args.lr,
        data_share=args.data_share,
        threads=args.threads,
        seed=args.seed,
    )
    try:
        report = train_draft(cfg)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    print(f"head written to {args.out} (serve it with --speculative-method eagle --draft-model {args.out})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specstream", description="Speculative decoding LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_chat(sub)
    _add_bench(sub)
    _add_train_draft(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
