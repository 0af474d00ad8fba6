"""Structured outputs: decoding constrained by a grammar (llguidance), and logit bias.

A request's StructuredOutput (a JSON schema, any JSON object, a regex, a Lark grammar or a
choice list) is compiled once per distinct spec into an llguidance matcher (grammar.py), off the engine
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

import llguidance
import llguidance.hf
import numpy as np
import torch

from specstream.errors import InvalidRequestError
from specstream.spec_decode.proposer import Draft
from specstream.structured.grammar import Constraint, GrammarCompiler, unpack_bitmask

FORCED_DRAFT_LIMIT = 8  # forced tokens drafted per round, on top of the proposer's k


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
        out = []
        for seq, k, draft in zip(seqs, ks, drafts):
            constraint = seq.constraint
            if constraint is None or constraint.matcher is None:
                out.append(draft)
                continue
            limit = min(FORCED_DRAFT_LIMIT, k + budget)
            if seq.draft_room is not None:  # a forced row past max_tokens is verified and thrown away
                limit = min(limit, seq.draft_room)
            forced = constraint.forced(limit) if self.forced_drafts else []
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
