"""Structured outputs: decoding constrained by a grammar (llguidance), and logit bias.

A request's StructuredOutput (a JSON schema, any JSON object, a regex, a Lark grammar or a
choice list) is compiled once per distinct spec into an llguidance matcher, off the engine
thread and cached; each sequence gets its own copy (a Constraint, with the request's logit
bias). Per engine step:

1. drafts: tokens the grammar forces (``compute_ff_tokens``) lead the draft, followed by the
   n-gram continuation after them; any other proposer's draft is cut to the prefix the
   grammar accepts. Forced drafts are verified like any draft, so they cost one verified
   position each and change nothing in the output distribution.
2. masks: every verified row of a constrained sequence (draft positions and the bonus row)
   is masked to the tokens the grammar allows after the drafts before it, and biased, before
   penalties, argmax and probabilities: greedy, one-hot (n-gram, forced) and draft-model
   acceptance are then exact with respect to the constrained distribution p'. The draft
   model's own logits are masked the same way, so its q is the masked q.
3. commit: the tokens a sequence emits are consumed by its matcher. A matcher that refuses a
   committed token is a bug; it fails that request alone (GrammarViolation). A matcher that
   can take nothing more (the grammar is complete) finishes the request with "stop".
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf
import numpy as np
import torch

from specstream.errors import InvalidRequestError, SpecstreamError

# Compact, deterministic JSON layout ('{"a": 1, "b": [2, 3]}'): no free whitespace, so a small
# model cannot loop on blanks and more of the structure is forced.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FORCED_DRAFT_LIMIT = 8  # forced tokens drafted per round, on top of the proposer's k
MAX_LOGIT_BIAS = 300
CACHE_SIZE = 128

_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


class GrammarViolation(SpecstreamError):
    """A sequence's matcher refused a token the engine committed: the request ends with an error."""


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match: exactly one of the five kinds.

    json_schema: a JSON Schema (dict); json_object: any JSON object; regex: a regular
    expression (Rust regex syntax) for the whole output; grammar: a Lark grammar in
    llguidance's dialect (it may embed ``%json {...}`` schemas); choice: one of these strings.
    param names the request field this came from, for error messages.
    """

    json_schema: dict | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    param: str = "structured"

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(f"give exactly one of {', '.join(_KINDS)} (got {given or 'none'})", param=self.param)
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json_schema" and not isinstance(value, dict):
            raise InvalidRequestError("a JSON schema must be an object", param=self.param)
        if kind == "json_object" and value is not True:
            raise InvalidRequestError("json_object must be true", param=self.param)
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise InvalidRequestError(f"{kind} must be a non-empty string", param=self.param)
        if kind == "choice" and (not value or not all(isinstance(c, str) and c for c in value)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings", param=self.param)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """Identifies the compiled grammar (the cache key)."""
        value = getattr(self, self.kind)
        return self.kind, json.dumps(value, sort_keys=True) if not isinstance(value, str) else value

    def grammar_text(self) -> str:
        """The llguidance grammar for this spec."""
        kind = self.kind
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.json_schema, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(self.grammar)
        return llguidance.grammar_from("choice", json.dumps(list(self.choice)))


def check_logit_bias(bias: dict | None) -> dict[int, float] | None:
    """OpenAI's bounds: at most 300 entries, token ids >= 0, values in [-100, 100]."""
    if not bias:
        return None
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to values", param="logit_bias")
    out = {}
    for tok, value in bias.items():
        try:
            tok_id = int(tok)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {tok!r}", param="logit_bias") from None
        if isinstance(tok, bool) or tok_id < 0 or str(tok_id) != str(tok).strip():
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {tok!r}", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise InvalidRequestError(f"logit_bias values must be numbers in [-100, 100], got {value!r}", param="logit_bias")
        out[tok_id] = float(value)
    return out


class GrammarCompiler:
    """Compiles specs into matchers, once per distinct spec (an LRU of ready matchers), and
    hands each request a copy. Thread-safe: the async engine compiles from a worker pool."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int], capacity: int = CACHE_SIZE) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_ids = sorted(eos_ids)
        self._ll_tokenizer = None  # built on first use (~1 s for a 49k vocabulary)
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
            text = spec.grammar_text()
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


class StructuredDecoding:
    """The engine's side of structured outputs: constraints per sequence, forced drafts,
    masks for every verified row, and commits."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int], *, forced_drafts: bool = True) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids)
        self.vocab_size = vocab_size
        self.forced_drafts = forced_drafts
        self._executor = None

    # ------------------------------------------------------------------ admission
    def constraint_for(self, params) -> Constraint | None:
        """The constraint of a new sequence, or None when its params ask for none."""
        if params.structured is None and not params.logit_bias:
            return None
        constraint = Constraint()
        if params.structured is not None:
            constraint.matcher = self.compiler.compile(params.structured)
        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= self.vocab_size]
            if bad:
                raise InvalidRequestError(f"logit_bias token ids must be below {self.vocab_size}, got {bad[0]}", param="logit_bias")
            constraint.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            constraint.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        return constraint

    # --------------------------------------------------------------------- drafts
    def drafts(self, seqs: list, ks: list[int], drafts: list, lookup, reserve, budget: int) -> list:
        """Each constrained sequence's draft: forced tokens first (when enabled), then the
        proposer's tokens, cut to the prefix the grammar accepts.

        lookup(tokens, k) continues a token list with the n-gram proposer (None for other
        proposers, whose drafts cannot follow forced tokens and are dropped after them);
        reserve(seq, n) reserves KV for n drafts; budget bounds the forced tokens added to
        the step beyond the scheduler's ks.
        """
        from specstream.proposers import Draft  # here: proposers -> sampling -> this module

        out = []
        for seq, k, draft in zip(seqs, ks, drafts):
            constraint = seq.constraint
            if constraint is None or constraint.matcher is None:
                out.append(draft)
                continue
            forced = constraint.forced(min(FORCED_DRAFT_LIMIT, k + budget)) if self.forced_drafts else []
            if len(forced) > k:
                extra = len(forced) - k
                if not reserve(seq, len(forced)):
                    forced, extra = forced[:k], 0
                budget -= extra
            if forced:
                tail = lookup(seq.token_ids + forced, k - len(forced)) if lookup is not None and k > len(forced) else []
                tokens, probs = forced + tail, None
            else:
                tokens, probs = draft.tokens, draft.probs
            n = constraint.valid_prefix(tokens)
            cut = None if probs is None else probs[:n]
            out.append(Draft(tokens[:n], cut, method=draft.method, num_forced=min(len(forced), n)))
        return out

    # ---------------------------------------------------------------------- masks
    def mask_rounds(self, rounds: list) -> list:
        """rounds: verify.Round (sequence, draft, logits [len(draft) + 1, V]) -> the same with
        every constrained row masked to what the grammar allows there, and biased."""
        grammar = [i for i, r in enumerate(rounds) if r.seq.constraint is not None and r.seq.constraint.matcher is not None]
        allowed = self._masks([(rounds[i].seq.constraint.matcher, rounds[i].draft.tokens) for i in grammar]) if grammar else []
        out = list(rounds)
        for i, mask in zip(grammar, allowed):
            out[i] = dataclasses.replace(out[i], logits=self._apply(out[i].logits, mask))
        for i, rnd in enumerate(out):
            if rnd.seq.constraint is not None:
                out[i] = dataclasses.replace(rnd, logits=rnd.seq.constraint.bias(rnd.logits))
        return out

    def mask_draft_logits(self, logits: torch.Tensor, seqs: list, drafted: list[list[int]]) -> torch.Tensor:
        """The draft model's logits for its next position, masked like the target's (row j:
        seqs[j] after its drafted tokens), so that its q is the constrained q."""
        rows = [j for j, s in enumerate(seqs) if s.constraint is not None]
        if not rows:
            return logits
        logits = logits.clone()
        for j in rows:
            logits[j] = seqs[j].constraint.bias(logits[j : j + 1])[0]
        grammar = [j for j in rows if seqs[j].constraint.matcher is not None]
        if grammar:
            masks = self._masks([(seqs[j].constraint.matcher, drafted[j]) for j in grammar])
            # Each mask's last row is the state after all of that sequence's drafted tokens.
            logits[grammar] = self._apply(logits[grammar], torch.cat([m[-1:] for m in masks]))
        return logits

    def _masks(self, items: list[tuple[object, list[int]]]) -> list[torch.Tensor]:
        """Bool masks [len(tokens) + 1, V] per (matcher, draft tokens): row i is what the
        grammar allows after tokens[:i]. The matchers end where they started."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        words = (self.vocab_size + 31) // 32
        sizes = [len(t) + 1 for _, t in items]
        bitmask = np.zeros((sum(sizes), words), dtype=np.int32)
        with_drafts, plain, start = [], [], 0
        for (matcher, tokens), n in zip(items, sizes):
            if tokens:
                with_drafts.append((matcher, start, tokens))
            else:
                plain.append((matcher, start))
            start += n
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.ctypes.data, words * 4, len(bitmask))
        if with_drafts:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(with_drafts, bitmask.ctypes.data, words * 4, len(bitmask))
        return list(unpack_bitmask(bitmask, self.vocab_size).split(sizes))

    @staticmethod
    def _apply(rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return rows.masked_fill(~allowed.to(rows.device), float("-inf"))

    # --------------------------------------------------------------------- commit
    @staticmethod
    def commit(seq, tokens: list[int]) -> list[int]:
        """Feed a round's tokens to the sequence's matcher; return the ones to emit: none past
        the token that completes the grammar (the same in every speculation mode)."""
        return tokens if seq.constraint is None else seq.constraint.commit(tokens)

    @staticmethod
    def finish_if_complete(seq) -> None:
        """A sequence whose grammar can take nothing more ends with "stop" (without waiting for EOS)."""
        if seq.finish_reason is None and seq.constraint is not None and seq.constraint.done:
            seq.finish_reason = "stop"


def proposer_share(num_drafted: int, num_accepted: int, num_forced: int) -> tuple[int, int]:
    """The (drafted, accepted) counts of the proposer's own drafts, without the forced ones
    that lead the draft: what the k policy learns from."""
    if num_accepted < num_forced:
        return 0, 0  # the proposer's tokens were never reached
    return num_drafted - num_forced, num_accepted - num_forced
