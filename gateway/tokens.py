"""The text and raw bytes of single tokens, for logprobs: a token that holds part of a UTF-8
character decodes to U+FFFD on its own, but its bytes let a client rebuild the character."""

from __future__ import annotations

import json
import re

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-character table used by byte-level BPE vocabularies."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class TokenBytes:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = False
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            decoder = json.loads(backend.to_str()).get("decoder") or {}
            parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
            self.byte_level = any(p.get("type") == "ByteLevel" for p in parts)
        self._unbyte = {ch: b for b, ch in _bytes_to_unicode().items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id])
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if self.byte_level and piece is not None and all(ch in self._unbyte for ch in piece):
                raw = bytes(self._unbyte[ch] for ch in piece)
            elif piece is not None and _BYTE_FALLBACK.match(piece):
                raw = bytes([int(_BYTE_FALLBACK.match(piece).group(1), 16)])
            else:
                raw = text.encode("utf-8")
            hit = self._cache[token_id] = (text, list(raw))
        return hit
