"""EagleProposer: drafts from a trained EAGLE-3-style head (see draft_head.py): where the target verifies
trees, EAGLE-2's dynamic tree (_grow_trees: the likeliest branches at each depth for a greedy request,
draws without replacement from the head's q for a sampled one, kept while each node's chance pays for its
row); else a chain. A sampled request's drafts carry the head's q for rejection sampling.

The head keeps its own one-layer KV pool. Row t of a sequence's head cache is computed from
the target's features at position t and token t + 1, so it can be written once both are
final: the target hands over the features of every prompt chunk and of each round's
accepted rows (observe), and they wait, copied into one buffer a sequence, until the sequence
next drafts; at most MAX_WAITING rows wait (_wait). A drafting round then
1. feeds the waiting rows (in chunks, so a long prompt never makes one huge pass); the last
   row's output is the first draft;
2. runs one more packed head step per further draft, each reading the previous step's own
   output and the token it just drafted, at the next position (a tree's step feeds each node it
   expands with the node's ancestors, under a tree mask: a node's row sees only its own path);
3. trims the head's table back to the rows computed from target features: the draft rows
   are overwritten next round (the same O(1) rollback as the target's pool).
Preemption frees everything (release); the recomputed prefill hands the features over again.

The head does not use the prefix cache. When the target's admission skips a cached prefix,
no features exist for those positions, so the head's cache starts at the first position it
is handed (base): its row i holds position base + i, and its context is the text from there
on (its rotary positions count from base too: attention with rotary embeddings depends only
on relative positions). Its drafts then see less context, which can only lower their
acceptance, never change the output (verification decides that); no head row is ever stale
or unwritten. A later prompt that shares the prefix gets the same, shorter head context.
A sequence that has not drafted with the head for MAX_WAITING rows (a long prompt; auto drafting with other
methods) likewise starts the head's cache again at the newest KEPT_WAITING rows, and one whose features stopped
for a while (auto's head dormant: no features tapped) at the first position handed over again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from specstream.calibration import CostModel, throwaway_tables
from specstream.spec_decode.draft_head import DraftHead
from specstream.spec_decode.head_files import load_for_target, resolve_head_dir
from specstream.memory.kv import KVPool
from specstream.spec_decode.head_tree import Node, keep_best, node_children, path_nodes
from specstream.spec_decode.policy import ChainJudge, ChanceTrust, sampling_bucket, trusted
from specstream.spec_decode.proposer import Draft, DraftMask, Proposer, ProposerContext, choose_drafts
from specstream.model.runner import ForwardItem, pack
from specstream.sequence import Sequence

logger = logging.getLogger("specstream.spec_decode.eagle")

# Most head rows fed in one pass while catching up on a prompt.
FEED_CHUNK = 256
# Most target rows a sequence keeps waiting for the head (features of positions it has not fed), and how many of
# the newest stay when more come: the head's context then starts at them, as past a cached prefix.
MAX_WAITING = 2 * FEED_CHUNK
KEPT_WAITING = FEED_CHUNK
# A head tree's branching: each expanded node's likeliest children, and the nodes expanded per depth.
TREE_WIDTH = 3


@dataclass
class _HeadState:
    base: int  # the sequence position of head row 0: the first position whose features came
    table: list[int] = field(default_factory=list)
    fed: int = 0  # head rows 0 .. fed - 1 (positions base ..) are computed from the target's features
    # The sequence's own buffer, grown up to MAX_WAITING rows: its first num_pending rows are the features of
    # positions base + fed, ... waiting to be fed.
    waiting: torch.Tensor | None = None
    num_pending: int = 0

    @property
    def pending(self) -> torch.Tensor:
        return self.waiting[: self.num_pending]


class EagleProposer(Proposer):
    def __init__(self, head: DraftHead, pool: KVPool, trees: bool = False, width: int = TREE_WIDTH) -> None:
        self.head = head
        self.pool = pool
        self.trees = trees  # draft trees (EAGLE-2) where the target verifies them; else chains
        self.width = width
        self.aux_layers = head.cfg.aux_layers
        self._mask: DraftMask | None = None  # [structured]
        # One head pass over n sequences (or n rows of one), timed by calibrate() and corrected by every round
        # the head drafts (_learn): timed at start-up its pass runs from hot caches, and in serving it follows
        # the target's forward, which has pushed the head's weights and cache out of them.
        self.cost: CostModel | None = None
        self._passes: list[int] | None = None  # while a round drafts: the rows of each head pass it ran
        # The target's forward time by tokens, set by the engine after its calibration: with it,
        # each chain stops where its drafts stop paying (ChainJudge); without it chains run to k.
        self.target_cost: CostModel | None = None
        # How far the head's chances are to be believed (each depth's, lately): its drafts are judged at that.
        self.trust = ChanceTrust()
        self._trust_now: dict[tuple[str, int], float] = {}  # this round's factors by (bucket, depth)
        self._state: dict[str, _HeadState] = {}

    @classmethod
    def build(cls, ctx: ProposerContext) -> EagleProposer:
        """The head config.speculative.draft_model names, else the one bundled for the model (HeadError
        when there is none, or it does not fit the target)."""
        spec = ctx.config.speculative
        head = load_for_target(
            resolve_head_dir(spec.draft_model, ctx.config.model), ctx.target, ctx.config.model, ctx.dtype, ctx.device
        )
        # Below float32 the head's step reads 8-bit weights where the CPU kernels serve them (drafts
        # only: output is unchanged). float32 keeps the head as trained.
        if ctx.dtype != torch.float32 and head.serve_in_8_bits():
            logger.info("draft head: projections served in 8-bit blocks")
        cfg = head.cfg
        pool = KVPool(
            1, cfg.num_key_value_heads, cfg.head_dim, ctx.pool_positions, ctx.config.kv_block_size, ctx.dtype, ctx.device
        )
        return cls(head, pool, trees=ctx.trees)

    def pass_cost(self, num_seqs: int) -> float:
        return self.cost(num_seqs) if self.cost is not None else 0.0

    def calibrate(self, target_cost: CostModel, max_pass_tokens: int) -> None:
        self.time_steps()
        self.target_cost = target_cost  # chains stop where drafts stop paying

    def constrain(self, mask: DraftMask) -> None:
        self._mask = mask

    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        state = self._state.get(seq.request_id)
        if state is None:
            # The first features may start past a prefix the target took from its cache.
            state = self._state[seq.request_id] = _HeadState(base=start)
        expected = state.base + state.fed + state.num_pending
        if start > expected:  # features were not tapped for a while (auto's head dormant): start again here
            self.pool.free(state.table)
            state.base, state.fed, state.num_pending, expected = start, 0, 0, start
        if start + len(features) > expected:
            self._wait(state, features[expected - start :])

    def _wait(self, state: _HeadState, rows: torch.Tensor) -> None:
        """Copy rows into the sequence's waiting buffer: one buffer a sequence, grown by doubling, not a tensor
        a step (a view would keep the step's features alive; a copy a step is thousands of small allocations
        alive at many streams, among which the target's forward ran slower: docs/MEASUREMENTS.md). Past MAX_WAITING rows the
        oldest go (KEPT_WAITING stay): a sequence that drafts with the head rarely, or never, holds a bounded
        buffer, and its next head round a bounded catch-up. Where the head has fed rows, its cache starts again
        at the rows kept: a gap in its positions would leave rows unwritten."""
        total = state.num_pending + len(rows)
        if total > MAX_WAITING:
            drop = total - KEPT_WAITING
            if state.fed:
                self.pool.free(state.table)
                state.base, state.fed = state.base + state.fed, 0
            kept = state.num_pending - drop  # waiting rows that stay; where none, the oldest new rows go too
            if kept > 0:
                state.waiting[:kept] = state.waiting[drop : state.num_pending].clone()
            else:
                rows = rows[drop - state.num_pending :]
            state.base += drop
            state.num_pending = max(kept, 0)
        need = state.num_pending + len(rows)
        if state.waiting is None or need > len(state.waiting):
            size = min(max(need, 2 * len(state.waiting) if state.waiting is not None else 0), MAX_WAITING)
            grown = rows.new_empty((size, rows.shape[1]))
            if state.num_pending:
                grown[: state.num_pending] = state.pending
            state.waiting = grown
        state.waiting[state.num_pending : need] = rows
        state.num_pending = need

    def on_commit(self, seq: Sequence) -> None:
        self.trust.committed(seq)

    def release(self, seq: Sequence) -> None:
        self.trust.release(seq)
        state = self._state.pop(seq.request_id, None)
        if state is not None:
            self.pool.free(state.table)

    def drop_states(self) -> None:
        """Forget every sequence's head cache and waiting rows (auto, as its head goes dormant): a sequence's
        state starts again from the next features it is handed."""
        for state in self._state.values():
            self.pool.free(state.table)
        self._state.clear()

    # ------------------------------------------------------------------ drafting
    def catch_up_cost(self, seq: Sequence) -> float:
        """Seconds the head spends before seq's first draft feeding the target's rows it has not seen, beyond
        the one row a round drafting every step feeds (a sequence that has not drafted for a while piles them
        up: its first draft then costs a pass over all of them)."""
        state = self._state.get(seq.request_id)
        if state is None or self.cost is None or state.num_pending <= 1:
            return 0.0
        return max(self.cost(state.num_pending) - self.cost(1), 0.0)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        started, self._passes = time.perf_counter(), []
        try:
            return self._propose(seqs, ks)
        finally:
            self._learn(time.perf_counter() - started)

    def _learn(self, seconds: float) -> None:
        """The round's passes took `seconds` in all, with the host work around them (feeding the waiting rows,
        choosing each depth's tokens, growing trees): each pass's share of it, in proportion to its price, corrects
        the cost curve (CostModel.observe), as the target's steps correct the target's. auto prices the head's
        rounds from this curve (a head step per draft, the waiting rows' catch-up pass): priced as timed at
        start-up they looked several times cheaper than they ran, and a head that rarely paid was picked."""
        passes, self._passes = self._passes, None
        if self.cost is None or not passes:
            return
        priced = [self.cost(n) for n in passes]
        total = sum(priced)
        for n, price in zip(passes, priced):
            self.cost.observe(n, seconds * price / total)

    def _propose(self, seqs: list[Sequence], ks: list[int]) -> list[Draft]:
        drafts = [Draft([], None, "eagle") for _ in seqs]
        base = self.take_step_base(len(seqs))
        self._trust_now.clear()
        active = [i for i, (s, k) in enumerate(zip(seqs, ks)) if k > 0 and self._ready(s, k)]
        if not active:
            return drafts
        judge = ChainJudge(self.target_cost, self.cost, len(seqs), base) if self.target_cost is not None else None
        logits, hidden = self._catch_up([seqs[i] for i in active])
        grows = [self._grows_tree(seqs[i]) for i in active]
        if any(grows):
            tree = [j for j, g in enumerate(grows) if g]
            self._grow_trees(seqs, ks, [active[j] for j in tree], logits[tree], hidden[tree], judge, drafts)
            chain = [j for j, g in enumerate(grows) if not g]
            active, logits, hidden = [active[j] for j in chain], logits[chain], hidden[chain]
        step = 0
        while active:
            if judge is not None:
                judge.head_step(len(active))
            confidence = self._choose(
                logits, [seqs[i] for i in active], [drafts[i] for i in active], step, judge is not None
            )
            kept = [True] * len(active)
            if judge is not None:
                for j, i in enumerate(active):
                    if judge.keep(i, confidence[j], self._trusted(seqs[i], step + 1)):
                        drafts[i].chances = (drafts[i].chances or []) + [judge.chance[i]]
                        continue
                    kept[j] = False
                    drafts[i].tokens.pop()
                    if drafts[i].probs:
                        drafts[i].probs.pop()
            step += 1
            still = [j for j, i in enumerate(active) if ks[i] > step and kept[j]]
            if not still:
                break
            active, hidden = [active[j] for j in still], hidden[still]
            states = [self._state[seqs[i].request_id] for i in active]
            items = [
                ForwardItem(st.table, st.fed + step - 1, [drafts[i].tokens[-1]], 1) for i, st in zip(active, states)
            ]
            logits, hidden = self._step(items, hidden)
        for s in seqs:
            state = self._state.get(s.request_id)
            if state is not None:
                self.pool.trim(state.table, state.fed)
        for seq, d in zip(seqs, drafts):
            if isinstance(d.probs, list):  # a chain's q, gathered row by row (a tree's is stacked already)
                d.probs = torch.stack(d.probs) if d.probs else None
            if d.tokens and d.chances and seq.constraint is None:  # judged, and verified as drafted
                self.trust.drafted(seq, d.chances, d.depths())
        return drafts

    def _trusted(self, seq: Sequence, depth: int) -> float:
        """What a depth-`depth` draft's chance for seq is taken at (ChanceTrust), looked up once a round."""
        key = (sampling_bucket(seq.params), depth)
        factor = self._trust_now.get(key)
        if factor is None:
            factor = self._trust_now[key] = self.trust.factor(*key)
        return factor

    def ready(self, seq: Sequence) -> bool:
        """Whether the head can draft for seq now: every row but the last has its features, some not fed yet."""
        state = self._state.get(seq.request_id)
        if state is None or not state.num_pending:
            return False
        return state.base + state.fed + state.num_pending == len(seq.token_ids) - 1

    def _ready(self, seq: Sequence, k: int) -> bool:
        """ready, and the pool holds the chain's rows."""
        if not self.ready(seq):
            return False
        state = self._state[seq.request_id]
        rows = self.width * max(k - 1, 0) if self._grows_tree(seq) else k - 1
        return self.pool.reserve(state.table, len(seq.token_ids) - state.base - 1 + rows)

    def _grows_tree(self, seq: Sequence) -> bool:
        """Whether seq's drafts this round are a tree (_grow_trees; its passes feed up to `width` paths of
        k - 1 rows) rather than a chain: where the target verifies trees, the drafts are judged (a
        forward-time curve), and the request is under no grammar (a grammar masks a chain's drafts one by
        one). A sampled request's tree is drawn from the head's q and verified by recursive rejection
        sampling (verify.py)."""
        return self.trees and self.target_cost is not None and seq.constraint is None

    def _grow_trees(
        self,
        seqs: list[Sequence],
        ks: list[int],
        active: list[int],
        logits: torch.Tensor,
        hidden: torch.Tensor,
        judge: ChainJudge,
        drafts: list[Draft],
    ) -> None:
        """EAGLE-2's dynamic draft tree for each active sequence, in drafts.

        Each depth expands the `width` likeliest nodes of the depth before (their chance: the product of the
        head's probabilities along the path), each into its `width` likeliest next tokens (a sampled
        request's: `width` draws from q without replacement, head_tree.node_children), in one head pass over
        every sequence: a pass feeds each expanded node with its ancestors as a tree (attention.py's tree
        mask, over the head's own pool), so every row sees exactly its path. A node is expanded only while
        its chance would still pay for a verified row and its share of the pass (its children are less
        likely still); growth stops at depth k. Then the nodes of every sequence are kept best first while
        they pay for their rows (ChainJudge.take), at most k per sequence: as likely as its path, a node is
        kept after its parent (head_tree.keep_best). Verification walks the tree by the target's argmax at
        each row, or for a sampled request by recursive rejection sampling against each node's q
        (verify.py)."""
        width = self.width

        def trust(i: int, depth: int) -> float:
            return self._trusted(seqs[i], depth)

        # Per sequence: nodes (token, parent, chance, depth); the input hidden of a node's children.
        nodes: dict[int, list[Node]] = {i: [] for i in active}
        q_of: dict[tuple[int, int], torch.Tensor] = {}  # [sampled] the q a node's children were drawn from
        child_hidden: dict[tuple[int, int], torch.Tensor] = {}
        out_logits = {(i, -1): logits[j] for j, i in enumerate(active)}  # -1: the root (the sequence's next token)
        for j, i in enumerate(active):
            child_hidden[(i, -1)] = hidden[j]
        frontier = [(i, -1) for i in active]
        depth = 0
        while frontier:
            depth += 1
            owners = [(seqs[i], parent) for i, parent in frontier]
            rows_in = torch.stack([out_logits[f] for f in frontier])
            children = node_children(self.head, self.width, rows_in, owners, depth)
            grown: dict[int, list[int]] = {}
            for (i, parent), (tokens, probs, q) in zip(frontier, children):
                if q is not None:
                    q_of[(i, parent)] = q
                base = 1.0 if parent < 0 else nodes[i][parent][2]
                for tok, p in zip(tokens, probs):
                    nodes[i].append((tok, parent, base * p, depth))
                    grown.setdefault(i, []).append(len(nodes[i]) - 1)
            if depth >= max(ks[i] for i in active):
                break
            # The next depth: each sequence's likeliest new nodes that could still pay for a row and a pass.
            picks = {
                i: sorted(new, key=lambda n, i=i: -nodes[i][n][2])[:width] for i, new in grown.items() if ks[i] > depth
            }
            rows = sum(len(path_nodes(nodes[i], ps)) for i, ps in picks.items())
            share = self.cost(rows) / max(rows, 1) if self.cost is not None else 0.0
            picks = {
                i: [n for n in ps if judge.worth(trusted(nodes[i][n][2], trust(i, nodes[i][n][3])), share)]
                for i, ps in picks.items()
            }
            frontier = [(i, n) for i, ps in picks.items() for n in ps]
            if not frontier:
                break
            step_logits, step_hidden = self._tree_pass(seqs, nodes, picks, child_hidden)
            for r, f in enumerate(frontier):
                out_logits[f], child_hidden[f] = step_logits[r], step_hidden[r]
        keep_best(nodes, q_of, ks, judge, drafts, trust)

    def _tree_pass(
        self,
        seqs: list[Sequence],
        nodes: dict[int, list[Node]],
        picks: dict[int, list[int]],
        child_hidden: dict[tuple[int, int], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head pass over every sequence's picked nodes, each fed with its ancestors as a tree from the
        head's first draft row (the picks last, so theirs are the rows returned, in picks' order)."""
        items, feed = [], []
        for i, ps in picks.items():
            if not ps:
                continue
            order = path_nodes(nodes[i], ps)
            index = {n: r for r, n in enumerate(order)}
            state = self._state[seqs[i].request_id]
            parents = [index.get(nodes[i][n][1], -1) for n in order]
            items.append(ForwardItem(state.table, state.fed, [nodes[i][n][0] for n in order], len(ps), parents))
            feed.extend(child_hidden[(i, nodes[i][n][1])] for n in order)
        return self._step(items, torch.stack(feed))

    def _catch_up(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each sequence's waiting rows; return its last row's (logits, pre-norm output)."""
        states = [self._state[s.request_id] for s in seqs]
        feats = [st.pending for st in states]  # views of the buffers, read before this returns
        out_logits: list[torch.Tensor | None] = [None] * len(seqs)
        out_hidden: list[torch.Tensor | None] = [None] * len(seqs)
        done = [0] * len(seqs)
        while any(d < len(f) for d, f in zip(done, feats)):
            items, rows, owners, budget = [], [], [], FEED_CHUNK
            for j, (seq, st, f) in enumerate(zip(seqs, states, feats)):
                n = min(len(f) - done[j], max(budget, 1))
                if n <= 0 or (budget <= 0 and items):
                    continue
                start = st.fed + done[j]  # a head row; its position is base + start
                last = done[j] + n == len(f)
                first = st.base + start + 1
                items.append(ForwardItem(st.table, start, seq.token_ids[first : first + n], int(last)))
                rows.append(f[done[j] : done[j] + n])
                if last:
                    owners.append(j)
                done[j] += n
                budget -= n
            with torch.inference_mode():
                hidden_in = self.head.fc(torch.cat(rows).to(self.head.fc.weight.dtype))
            logits, hidden = self._step(items, hidden_in)
            for r, j in enumerate(owners):
                out_logits[j], out_hidden[j] = logits[r], hidden[r]
        for st, f in zip(states, feats):
            st.fed += len(f)
            st.num_pending = 0
        return torch.stack(out_logits), torch.stack(out_hidden)

    def _step(self, items: list[ForwardItem], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._passes is not None:  # a drafting round's pass, priced as cost(its rows) (calibrate's are not)
            self._passes.append(sum(len(item.tokens) for item in items))
        tokens, positions, ctx, keep = pack(self.pool, items)
        return self.head.step(tokens, hidden, positions, ctx, keep)

    def _choose(
        self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[Draft], step: int, judged: bool
    ) -> list[float]:
        """Append each sequence's draft token `step`. With `judged`, return the head's confidence in each, its
        top probability (of the sampled distribution q for a sampled request); else nothing is computed for it.

        A sampled draft's confidence must not be q of the token drawn: whether the draft is verified would then
        depend on which token was drawn, and rejection sampling is lossless only for a draft verified whatever
        it is (p = (.5, .5), q = (.9, .1), the draft kept only where q > .5: the first token comes out .55/.45).
        The top of q is fixed before the draw, as the draft's position is."""
        greedy = self.head.target_ids[logits.argmax(-1)].tolist()
        constrained = self._mask is not None and any(s.constraint is not None for s in seqs)
        masked = None  # the rows a grammar masked, over the whole vocabulary
        if not constrained and all(s.params.greedy for s in seqs):
            tokens, probs = greedy, [None] * len(seqs)
        else:
            full = self.head.full_logits(logits)
            if constrained:
                full, greedy = self._constrained(full, seqs, drafts, greedy)
                masked = full
            tokens, probs = choose_drafts(full, seqs, step, greedy)
        # Unmasked, the softmax over the draft vocabulary is the full row's (q is 0 outside it).
        source = logits if masked is None else masked
        confidence = source.float().softmax(-1).amax(-1).tolist() if judged else []
        for j, (d, tok, q) in enumerate(zip(drafts, tokens, probs)):
            d.tokens.append(tok)
            if q is not None:
                d.probs = (d.probs or []) + [q]
                if judged:
                    confidence[j] = float(q.max())
        return confidence

    def _constrained(self, full: torch.Tensor, seqs: list[Sequence], drafts: list[Draft], greedy: list[int]):
        """[structured] The head's logits masked by each sequence's grammar after its drafted
        tokens, so that a sampled draft's q is the constrained q (rejection sampling against the
        masked target stays lossless). A row the grammar leaves empty within the draft
        vocabulary becomes one-hot on the head's own choice: that draft is invalid and gets cut,
        which for a one-hot q is the same as rejecting it (the residual is then p itself)."""
        full = self._mask(full, seqs, [d.tokens for d in drafts])
        empty = (~torch.isfinite(full).any(-1)).nonzero().flatten()
        if len(empty):
            full[empty] = float("-inf")
            full[empty, torch.tensor(greedy, device=full.device)[empty]] = 0.0
        return full, full.argmax(-1).tolist()

    # ------------------------------------------------------------------ cost
    def time_steps(self, sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), context: int = 64) -> None:
        """Time one head step over n sequences (throwaway tables, freed after): pass_cost."""
        with throwaway_tables(self.pool, max(sizes), context + 1) as tables:
            sizes = tuple(n for n in sizes if n <= len(tables))
            if not sizes:
                return
            hidden = torch.zeros(
                (max(sizes), self.head.cfg.hidden_size), dtype=self.head.fc.weight.dtype, device=self.pool.device
            )

            def run(n: int) -> None:
                self._step([ForwardItem(t, context, [0], 1) for t in tables[:n]], hidden[:n])

            self.cost = CostModel.measure(run, list(sizes))
        logger.info(
            "draft head step: %.2f ms at 1 sequence, %.2f ms at %d", 1e3 * self.cost(1), 1e3 * self.cost(sizes[-1]), sizes[-1]
        )
