"""Continuous batching: which sequences run this step, with how many tokens each.

Every step, in order:
1. each decoding sequence gets its next token's KV slot (preempting the newest sequences,
   which recompute later, when the pool is full);
2. prefill chunks (continuing prompts first, then newly admitted ones) take the token
   budget left after the decoders, so a long prompt is fed in pieces and never stalls
   running streams for more than one step;
3. where no chunk was scheduled, the k policy spreads what is left of the budget as drafts
   over the decoders (a step that feeds a prompt drafts nothing); each sequence's k slots
   are reserved in the pool, or its k shrinks.

With prefix caching, a step first publishes the full blocks each running sequence committed
in the last round (and a sequence publishes its blocks when freed), and a sequence being
admitted starts from the longest cached run of its blocks, so its prefill begins past them.

Every reservation names the first position the step feeds (the sequence's num_cached), so a
model's sliding-window layers hand back the blocks their window has left behind before the
pool is asked for more (memory/kv.py), and a chunk's size counts the room of every layer group.
Publishing comes first in a step, so those blocks are findable in the prefix cache before
they are handed back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specstream.spec_decode.policy import KPolicy
from specstream.config import EngineConfig
from specstream.memory.kv import KVPool
from specstream.memory.prefix_cache import PrefixCache
from specstream.sequence import Sequence, SequenceStatus


@dataclass
class StepPlan:
    decodes: list[Sequence] = field(default_factory=list)
    ks: list[int] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk length)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def base_tokens(self) -> int:
        """The tokens the step's forward feeds before drafts: each decoder's next token and the prefill chunks."""
        return len(self.decodes) + sum(n for _, n in self.prefills)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: KVPool, policy: KPolicy, on_release) -> None:
        self.config = config
        self.pool = pool
        self.policy = policy
        self.on_release = on_release  # called when a sequence's KV is freed (proposer state)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache = PrefixCache(pool) if config.enable_prefix_caching else None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def free(self, seq: Sequence) -> None:
        self._publish(seq)
        self.pool.free(seq.block_table)
        seq.num_cached = 0
        seq.prefix.num_published = 0
        self.on_release(seq)

    def _publish(self, seq: Sequence) -> None:
        """Make seq's committed full blocks findable (every position below num_cached holds the
        KV of a token the target accepted: drafts are only counted in once accepted)."""
        if self.prefix_cache is not None:
            state = seq.prefix
            state.num_published = self.prefix_cache.publish(seq.block_table, seq, seq.num_cached, state.num_published)

    def _take_cached_prefix(self, seq: Sequence) -> int:
        if self.prefix_cache is None:
            return 0
        seq.num_cached = self.prefix_cache.acquire(seq.block_table, seq)
        seq.prefix.num_published = len(seq.block_table)
        return seq.num_cached

    def finish(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free(seq)

    def _preempt_newest(self) -> Sequence:
        """Free the newest running sequence; it waits at the queue's head and recomputes."""
        victim = max(self.running, key=lambda s: s.arrival)
        self.running.remove(victim)
        self.num_preemptions += 1
        self.free(victim)
        victim.status = SequenceStatus.WAITING
        self.waiting.appendleft(victim)
        return victim

    def schedule(self) -> StepPlan:
        for seq in self.running:
            self._publish(seq)
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        # Oldest first, so a sequence preempted for space is always one not yet planned.
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq not in self.running or not seq.is_decoding:
                continue
            while not self.pool.reserve(seq.block_table, len(seq.token_ids), seq.num_cached):
                if self._preempt_newest() is seq:
                    break
            else:
                plan.decodes.append(seq)
        budget = self._schedule_prefills(plan, budget - len(plan.decodes))
        if plan.empty and len(self.running) > 1:
            # Prefilling sequences filled the pool between them: make room for the oldest.
            self._preempt_newest()
            return self.schedule()
        # Drafts never ride beside a prefill chunk: prompts take the whole budget, and the decodes draft once no
        # chunk is left to feed. Such a step runs long (eager past the compiled sizes), and at 32 agent streams its
        # draft rows cost more than they gave (docs/MEASUREMENTS.md, "No drafts beside a prefill chunk").
        plan.ks = [0] * len(plan.decodes) if plan.prefills else self.policy.choose(plan.decodes, plan.base_tokens, budget)
        for i, seq in enumerate(plan.decodes):
            while plan.ks[i] and not self.pool.reserve(seq.block_table, len(seq.token_ids) + plan.ks[i], seq.num_cached):
                plan.ks[i] -= 1
        return plan

    def _schedule_prefills(self, plan: StepPlan, budget: int) -> int:
        # Keep a block per running sequence free so decoders can grow without preempting.
        watermark = len(self.running)
        for seq in self.running:
            if seq.is_decoding or budget <= 0:
                continue
            chunk = self._reserve_chunk(seq, budget, 0)
            if chunk:
                plan.prefills.append((seq, chunk))
                budget -= chunk
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = self._take_cached_prefix(seq)
            chunk = self._reserve_chunk(seq, budget, watermark)
            if not chunk:
                self.pool.free(seq.block_table)
                seq.num_cached = seq.prefix.num_published = 0
                break
            if self.prefix_cache is not None:
                self.prefix_cache.record_admission(seq, hit)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.prefills.append((seq, chunk))
            budget -= chunk
            watermark += 1
        return budget

    def _reserve_chunk(self, seq: Sequence, budget: int, watermark: int) -> int:
        """Reserve KV for the largest prefill chunk of seq that fits; return its length."""
        room = self.pool.room(seq.block_table, seq.num_cached, watermark) - seq.num_cached
        chunk = min(seq.num_pending, budget, room)
        if chunk <= 0 or not self.pool.reserve(seq.block_table, seq.num_cached + chunk, seq.num_cached):
            return 0
        return chunk
