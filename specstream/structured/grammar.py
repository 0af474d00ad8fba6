"""Grammars: a request's StructuredOutput compiled into an llguidance matcher (once per distinct spec,
off the engine thread, cached), and each sequence's Constraint: its own matcher and logit bias."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf
import numpy as np
import torch

from specstream.errors import InvalidRequestError, SpecstreamError
from specstream.sampling import StructuredOutput

# Compact, deterministic JSON layout ('{"a": 1, "b": [2, 3]}'): no free whitespace, so a small
# model cannot loop on blanks and more of the structure is forced.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 128


class GrammarViolation(SpecstreamError):
    """A sequence's matcher refused a token the engine committed: the request ends with an error."""


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar for a spec."""
    kind = spec.kind
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(spec.json_schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))


class GrammarCompiler:
    """Compiles specs into matchers, once per distinct spec (an LRU of ready matchers), and
    hands each request a copy. Thread-safe: the async engine compiles from a worker pool."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int], capacity: int = CACHE_SIZE) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._ll_tokenizer = None  # built on first use: it walks the whole vocabulary
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_ids)
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutput):
        """A fresh matcher for spec. Raises InvalidRequestError (naming spec.param) for a
        grammar llguidance rejects: a bad schema, an unsupported keyword, a bad regex."""
        key = spec.key()
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template.deep_copy()
        tokenizer = self.ll_tokenizer
        try:
            text = grammar_text(spec)
        except (ValueError, TypeError) as exc:
            raise InvalidRequestError(f"invalid {spec.kind}: {exc}", param=spec.param) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if is_error:
            raise InvalidRequestError(f"invalid or unsupported {spec.kind}: {messages[0].strip()}"[:1000], param=spec.param)
        template = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if template.is_error():
            raise InvalidRequestError(f"invalid or unsupported {spec.kind}: {template.get_error()}"[:1000], param=spec.param)
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        return template.deep_copy()


@dataclass
class Constraint:
    """What restricts one sequence's next tokens: its grammar matcher and/or a logit bias."""

    matcher: object | None = None  # llguidance.LLMatcher
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        """The grammar is complete and can take nothing but EOS."""
        return self.matcher is not None and self.matcher.is_stopped()

    def forced(self, limit: int) -> list[int]:
        if self.matcher is None or limit <= 0:
            return []
        return self.matcher.compute_ff_tokens()[:limit]

    def valid_prefix(self, tokens: list[int]) -> int:
        if self.matcher is None or not tokens:
            return len(tokens)
        return self.matcher.validate_tokens(tokens)

    def commit(self, tokens: list[int]) -> list[int]:
        """Consume tokens up to and including the one that completes the grammar; return those."""
        if self.matcher is None:
            return tokens
        for i, tok in enumerate(tokens):
            if not self.matcher.consume_tokens([tok]):
                raise GrammarViolation(f"the grammar refused committed token {tok}: {self.matcher.get_error()}")
            if self.matcher.is_stopped():
                return tokens[: i + 1]
        return tokens

    def bias(self, rows: torch.Tensor) -> torch.Tensor:
        if self.bias_ids is None:
            return rows
        rows = rows.clone()
        rows[:, self.bias_ids.to(rows.device)] += self.bias_values.to(device=rows.device, dtype=rows.dtype)
        return rows


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> torch.Tensor:
    """llguidance's int32 bitmask [R, ceil(V/32)] (bit j of word w: token 32w + j) -> bool [R, V]."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bool)  # 0/1 bytes: a view, no copy
