"""Incremental detokenization with stop strings.

Text is produced by decoding a short window of tokens (a few before the new ones, so that
leading spaces and multi-token characters come out right) and keeping only what the window
adds. Text that ends in an incomplete UTF-8 character (U+FFFD) is held back until the next
token completes it. Text that could still be the start of a stop string is held back too,
so a stop string split across two rounds is never emitted.
"""

from __future__ import annotations

# Tokens of context decoded in front of new ones.
_CONTEXT_TOKENS = 6
# A UTF-8 character has at most 4 bytes, so text still ending in U+FFFD after this many
# held tokens is invalid output from the model, not a character in progress: emit it.
_MAX_HELD_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True, min_tokens: int = 0
    ) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens  # stop strings are looked for from this many output tokens on (vLLM's)
        self._outputs = 0
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._tokens = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""  # decoded output so far (truncated at a stop string)
        self._emitted = 0  # characters of text already handed out
        self._searched = 0  # characters of text already searched for stop strings
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped the text (the earliest found)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> bool:
        """Append one token; return True when it completed a stop string."""
        self._tokens.append(token_id)
        self._outputs += 1
        prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset :])
        held = len(self._tokens) - self._read_offset
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and held < _MAX_HELD_TOKENS):
            return False
        return self._append(full[len(prefix) :])

    def _append(self, new: str) -> bool:
        self.text += new
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        if self.stop and self._outputs < self.min_tokens:
            self._searched = len(self.text)  # text of the first min_tokens tokens never stops the output
        elif self.stop:
            start = max(0, self._searched - self._hold)
            hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stop) if i >= 0]
            self._searched = len(self.text)
            if hits:
                index, self.matched = min(hits, key=lambda hit: hit[0])
                self.text = self.text[:index]
                self.stopped = True
        return self.stopped

    def _flush(self) -> None:
        """At the end: text of tokens still held back, without a trailing incomplete character."""
        prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset :])
        if len(full) > len(prefix):
            self._append(full[len(prefix) :].rstrip("\ufffd"))

    def take(self, final: bool = False) -> str:
        """Text not yet handed out that is safe to emit (everything when final or stopped)."""
        if final and not self.stopped:
            self._flush()
        end = len(self.text) if final or self.stopped else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
