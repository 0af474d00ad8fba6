"""A small draft model sharing the target's vocabulary, with its own KV pool and prefix cache."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specstream.calibration import CostModel, forward_cost
from specstream.memory.kv import KVPool
from specstream.memory.prefix_cache import PrefixCache
from specstream.model.attention import ATTN_IMPLEMENTATION, model_geometry
from specstream.model.loader import load_model, load_tokenizer, resolve_dtype, resolve_model
from specstream.model.runner import ForwardItem, ModelRunner
from specstream.sequence import Sequence
from specstream.spec_decode.proposer import Draft, DraftMask, Proposer, ProposerContext, choose_drafts


@dataclass
class _DraftKV:
    """One sequence's KV in the draft pool."""

    table: list[int] = field(default_factory=list)  # its block table
    fed: int = 0  # positions fed (their KV is in the pool)
    published: int = 0  # leading blocks of table already in the draft's prefix cache


class DraftModelProposer(Proposer):
    """A small causal LM sharing the target's vocabulary, run batched: one packed pass per
    draft position over all drafting sequences, with its own KV pool and rollback.

    Its cache follows the target's: prompts are fed in the target's prefill chunks, and a
    sequence that did not draft for a while (k = 0 rounds feed nothing) catches up by at most
    max_pass_tokens per step, drafting only once it is level, so no pass is longer than a
    target step may be.

    With prefix caching its pool has a prefix cache of its own, keyed by the same block
    digests as the target's: a sequence starts past the draft KV cached for its prefix, and
    the draft publishes only positions fed with tokens the target committed."""

    def __init__(
        self, model, pool: KVPool, max_pass_tokens: int, cost: CostModel | None = None, prefix_caching: bool = True
    ) -> None:
        self.runner = ModelRunner(model, pool)
        self.pool = pool
        self.max_pass_tokens = max_pass_tokens
        self.cost = cost  # one packed draft pass, set by calibrate()
        self.prefix_cache = PrefixCache(pool) if prefix_caching else None
        self._state: dict[str, _DraftKV] = {}  # by request_id
        self._mask: DraftMask | None = None  # [structured]

    @classmethod
    def build(cls, ctx: ProposerContext) -> DraftModelProposer:
        """Load config.speculative.draft_model; refuse one whose vocabulary is not the target's."""
        spec = ctx.config.speculative
        source = resolve_model(spec.draft_model)
        draft_tokenizer = load_tokenizer(source)
        dtype = resolve_dtype(spec.draft_dtype, ctx.device) if spec.draft_dtype else ctx.dtype
        draft = load_model(source, dtype, ctx.device, attn_implementation=ATTN_IMPLEMENTATION)
        draft_vocab = draft.config.get_text_config().vocab_size
        if draft_tokenizer.get_vocab() != ctx.tokenizer.get_vocab() or draft_vocab != ctx.vocab_size:
            raise ValueError(
                f"draft model '{spec.draft_model}' does not share the target's vocabulary "
                f"(draft {len(draft_tokenizer)} tokens / {draft_vocab} logits, target "
                f"{len(ctx.tokenizer)} / {ctx.vocab_size}); speculative decoding needs the same tokenizer"
            )
        block_size = ctx.config.kv_block_size
        pool = KVPool(*model_geometry(draft.config), ctx.pool_positions, block_size, dtype, ctx.device)
        return cls(
            draft,
            pool,
            max_pass_tokens=ctx.config.max_num_batched_tokens,
            prefix_caching=ctx.config.enable_prefix_caching,
        )

    def pass_cost(self, num_seqs: int) -> float:
        return self.cost(num_seqs) if self.cost is not None else 0.0

    def calibrate(self, target_cost: CostModel, max_pass_tokens: int) -> None:
        self.cost = forward_cost(self.runner, max_pass_tokens)

    def constrain(self, mask: DraftMask) -> None:
        self._mask = mask

    def prefill(self, chunks):
        items = []
        for seq, n in chunks:
            kv = self._kv(seq)
            end = seq.num_cached + n
            # A cache level with the target's (or ahead of it, when the draft pool held more of
            # the prefix) follows its chunks; one behind catches up in propose().
            if seq.num_cached <= kv.fed < end and self.pool.reserve(kv.table, end):
                items.append(ForwardItem(kv.table, kv.fed, seq.token_ids[kv.fed : end], 0))
                kv.fed = end
        if items:
            self.runner.forward(items)

    def propose(self, seqs, ks):
        drafts = [Draft([], None, "draft") for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active, items = self._first_pass(seqs, ks)
        step = 0
        while active or items:
            for i, new in active.items():
                kv = self._state[seqs[i].request_id]
                items.append(ForwardItem(kv.table, kv.fed, new, 1))
                kv.fed += len(new)
            started = time.perf_counter()
            logits = self.runner.forward(items)
            rows = list(active)
            if self._mask is not None:  # [structured]
                logits = self._mask(logits, [seqs[i] for i in rows], [drafts[i].tokens for i in rows])
            self._choose(logits, [seqs[i] for i in rows], [drafts[i] for i in rows], [probs[i] for i in rows], step)
            if self.cost is not None:  # the pass as it ran, its choice included: timed at start-up, from hot caches,
                # it looked cheaper than it runs after the target's forward (EagleProposer._learn)
                self.cost.observe(sum(len(item.tokens) for item in items), time.perf_counter() - started)
            step += 1
            active = {i: [drafts[i].tokens[-1]] for i in active if ks[i] > step}
            items = []
        for d, p in zip(drafts, probs):
            if p:
                d.probs = torch.stack(p)
        return drafts

    def _first_pass(self, seqs: list[Sequence], ks: list[int]) -> tuple[dict[int, list[int]], list[ForwardItem]]:
        """What each drafting sequence feeds first: everything not yet fed, within
        max_pass_tokens. A sequence that does not fit catches up by what room is left (an
        item without logits, returned to ride along in the first pass) and drafts nothing
        this round."""
        active: dict[int, list[int]] = {}
        catch_up: list[ForwardItem] = []
        room = self.max_pass_tokens
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            if k <= 0 or room <= 0:
                continue
            kv = self._kv(seq)
            # Positions up to len + k - 2 are fed (the last draft is never fed).
            if not self.pool.reserve(kv.table, len(seq.token_ids) + k - 1):
                continue
            new = seq.token_ids[kv.fed :]
            if len(new) <= room:
                active[i] = new
            else:
                catch_up.append(ForwardItem(kv.table, kv.fed, new[:room], 0))
                kv.fed += room
            room -= len(new)
        return active, catch_up

    def _kv(self, seq: Sequence) -> _DraftKV:
        """seq's draft KV; a new one starts past the longest run of its blocks cached in the pool."""
        kv = self._state.get(seq.request_id)
        if kv is None:
            kv = self._state[seq.request_id] = _DraftKV()
            if self.prefix_cache is not None:
                kv.fed = self.prefix_cache.acquire(kv.table, seq)
                kv.published = len(kv.table)
        return kv

    def _publish(self, seq: Sequence, kv: _DraftKV) -> None:
        # Fed positions below the first one whose token the target did not accept hold
        # committed tokens: at least min(fed, len - 1) of them (see on_commit).
        if self.prefix_cache is not None:
            committed = min(kv.fed, len(seq.token_ids) - 1)
            kv.published = self.prefix_cache.publish(kv.table, seq, committed, kv.published)

    def _choose(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[Draft], probs: list[list], step: int
    ) -> None:
        """Append each sequence's next draft (argmax, or a sample from q) and, when sampled, its q."""
        tokens, qs = choose_drafts(logits, seqs, step)
        for j, d in enumerate(drafts):
            d.tokens.append(tokens[j])
            if qs[j] is not None:
                probs[j].append(qs[j])

    def on_commit(self, seq):
        kv = self._state.get(seq.request_id)
        if kv is not None:
            # Everything fed before the first position where the accepted tokens differ from
            # what was fed stays valid; that is at most len - 1 positions.
            kv.fed = min(kv.fed, len(seq.token_ids) - 1)
            self.pool.trim(kv.table, kv.fed)
            self._publish(seq, kv)

    def release(self, seq):
        kv = self._state.pop(seq.request_id, None)
        if kv is not None:
            self._publish(seq, kv)
            self.pool.free(kv.table)
