"""`specstream chat`: a terminal chat on the SDK. Replies stream as chunks arrive; after each
one it prints tokens/s and, against a specstream server, the draft acceptance."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from specstream_client import APIError, Client

HELP = "commands: /reset clears the conversation, /exit quits"


def run_chat(
    client: Client,
    *,
    model: str | None = None,
    system: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    read: Callable[[str], str] = input,
    out=sys.stdout,
) -> int:
    try:
        model = model or client.models.list()[0].id
    except (APIError, IndexError) as exc:
        print(f"error: cannot list the server's models: {exc}", file=out)
        return 1
    base = [{"role": "system", "content": system}] if system else []
    messages = list(base)
    print(f"chatting with {model} at {client.base_url} ({HELP})", file=out)
    while True:
        try:
            line = read("you> ")
        except (EOFError, KeyboardInterrupt):
            print(file=out)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            messages = list(base)
            print("(conversation cleared)", file=out)
            continue
        messages.append({"role": "user", "content": text})
        reply, tokens, drafted, accepted = [], 0, 0, 0
        start = time.perf_counter()
        first = None
        print("assistant> ", end="", file=out, flush=True)
        try:
            with client.chat.completions.create(
                model=model,
                messages=messages,
                stream=True,
                max_tokens=max_tokens,
                temperature=temperature,
                stream_options={"include_usage": True},
            ) as stream:
                for chunk in stream:
                    if chunk.usage:
                        tokens = chunk.usage.completion_tokens
                    for choice in chunk.choices:
                        if choice.delta.content:
                            first = first or time.perf_counter()
                            reply.append(choice.delta.content)
                            print(choice.delta.content, end="", file=out, flush=True)
                        if choice.speculative:
                            drafted += choice.speculative.drafted
                            accepted += choice.speculative.accepted
        except APIError as exc:
            print(f"\n[error: {exc}]", file=out)
            messages.pop()
            continue
        elapsed = time.perf_counter() - start
        messages.append({"role": "assistant", "content": "".join(reply)})
        stats = f"{tokens} tokens, {tokens / elapsed:.1f} tok/s" if tokens else f"{elapsed:.1f} s"
        if first is not None:
            stats += f", first token {1000 * (first - start):.0f} ms"
        if drafted:
            stats += f", acceptance {accepted / drafted:.0%} ({accepted}/{drafted} drafts)"
        print(f"\n[{stats}]", file=out, flush=True)
