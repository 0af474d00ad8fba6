"""The `specstream` command line."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _serve(args: argparse.Namespace) -> int:
    import torch

    import specstream

    start = time.perf_counter()
    print(f"[specstream] loading model '{args.model}'", file=sys.stderr, flush=True)
    try:
        source = specstream.resolve_model(args.model)
        tokenizer = specstream.load_tokenizer(source)
        model = specstream.load_model(source, dtype=getattr(torch, args.dtype))
    except specstream.ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"[specstream] model loaded in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    # A short greedy self-check proves the weights and chat template work end to end.
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say hello in one short sentence."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    reply = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"[specstream] self-check reply: {reply.strip()!r}", file=sys.stderr, flush=True)
    print(
        f"[specstream] the HTTP gateway ({args.host}:{args.port}) is not part of this build yet; exiting",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specstream", description="Speculative decoding LLM server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="load a model and serve it")
    serve.add_argument("--model", default=os.environ.get("SPECSTREAM_MODEL", "smollm2-135m"))
    serve.add_argument("--dtype", default=os.environ.get("SPECSTREAM_DTYPE", "bfloat16"), choices=["bfloat16", "float16", "float32"])
    serve.add_argument("--host", default=os.environ.get("SPECSTREAM_HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(os.environ.get("SPECSTREAM_PORT", "8000")))
    serve.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
