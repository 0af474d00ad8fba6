"""Engine: the synchronous, in-process entry point.

It holds the models, the KV pools, the proposer, the k policy, the scheduler and the input processor (built by
builder.py). ``step()`` runs one speculative round over every running sequence: schedule, propose, one packed
target forward, verify, update. ``generate()`` loops steps until its requests finish.

Failures (docs/ARCHITECTURE.md, the fault model): a request with bad parameters never gets here (the input
processor refuses it); an exception while proposing for or verifying one request fails that
request alone (the batch is retried one sequence at a time) and the step goes on; an
exception in the target's forward escapes step(), since the batch cannot go on without it.
"""

from __future__ import annotations

import logging
import time
import uuid

import torch

from specstream.config import EngineConfig
from specstream.engine.builder import EngineBuilder
from specstream.engine.metrics import CacheConfigInfo, EngineMetrics
from specstream.engine.outputs import RequestOutput, StreamChunk, TokenLogprob, Usage
from specstream.engine.processor import ChatPrompt
from specstream.engine.scheduler import StepPlan
from specstream.memory.heap import release_free_heap
from specstream.sequence import Sequence
from specstream.errors import InvalidRequestError
from specstream.model.runner import ForwardItem
from specstream.sampling import SamplingParams
from specstream.spec_decode.policy import StepBase
from specstream.spec_decode.prediction import propose_with_predictions
from specstream.spec_decode.proposer import Draft
from specstream.spec_decode.verify import Round, RoundResult, verify_round
from specstream.structured.decoding import proposer_share

logger = logging.getLogger(__name__)


def token_logprobs(rows: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """Logprobs of the emitted tokens from the verification logits (row i predicts token i)."""
    if not token_ids:
        return []
    logp = rows[: len(token_ids)].float().log_softmax(-1)
    chosen = logp.gather(1, torch.tensor(token_ids, device=logp.device)[:, None]).squeeze(1).tolist()
    if top:
        values, indices = logp.topk(top, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(t, lp, tp) for t, lp, tp in zip(token_ids, chosen, tops)]


def _usage(seq: Sequence) -> Usage:
    return Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.prefix.hit_tokens or 0, *seq.stats.prediction_usage)


class Engine:
    """The step loop over parts that builder.EngineBuilder makes from an EngineConfig."""

    def __init__(self, config: EngineConfig | None = None, *, log: bool = True) -> None:
        parts = EngineBuilder(config or EngineConfig()).build(log=log)
        self.config = parts.config
        self.device, self.dtype = parts.device, parts.dtype
        self.tokenizer, self.model = parts.tokenizer, parts.model
        self.vocab_size, self.eos_token_ids = parts.vocab_size, parts.eos_token_ids
        self.pool, self.max_model_len = parts.pool, parts.max_model_len
        self.runner, self.proposer, self.structured = parts.runner, parts.proposer, parts.structured
        self.policy, self.scheduler, self.processor = parts.policy, parts.scheduler, parts.processor
        self.calibration_file = parts.calibration_file
        self.pricing = parts.pricing
        self.forward_description = parts.forward
        # False: the forward changed (a background compile) since it was last priced, or its price is a
        # kept curve scaled at start-up (calibration.forward_cost's `later`)
        self.priced = not getattr(self.policy.target_cost, "stale", False)
        self.resident_memory = parts.resident_memory  # bytes after each start-up phase
        self._requests: dict[str, Sequence] = {}
        cache = CacheConfigInfo(
            self.pool.block_size,
            self.pool.num_blocks,
            self.scheduler.prefix_cache is not None,
            str(self.dtype).removeprefix("torch."),
        )
        self.metrics = EngineMetrics(model_name=self.config.model, cache=cache)

    # ---------------------------------------------------------------------- requests
    def prepare(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> Sequence:
        """Validate and tokenize a request into a Sequence, without touching engine state
        (InvalidRequestError when it is refused); submit() then queues it."""
        return self.processor.process(prompt, params, request_id or uuid.uuid4().hex)

    def submit(self, seq: Sequence) -> str:
        if seq.request_id in self._requests:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
        self._requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self.metrics.prompt_tokens.inc(seq.num_prompt_tokens)
        self._update_gauges()
        return seq.request_id

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        return self.submit(self.prepare(prompt, params, request_id))

    def abort(self, request_id: str) -> StreamChunk | None:
        """Stop a request now and free its KV. Returns its last chunk (finish_reason
        "abort", with usage), or None when the request is not in the engine."""
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        self._finish(seq)
        self._update_gauges()
        return StreamChunk(request_id, seq.detokenizer.take(final=True), [], 0, 0, "abort", _usage(seq))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---------------------------------------------------------------- between steps
    def upgrade(self, wait: bool = False) -> bool:
        """Install a background compile once it has finished (wait: once it finishes); whether the forward
        changed. Its price is measured again at the next idle() (the eager forward's serves until then)."""
        forward = self.runner.install_compiled(wait)
        if forward is None:
            return False
        self.priced = False
        self.forward_description = forward
        return True

    @property
    def compiling(self) -> bool:
        return self.runner.compiling

    def idle(self) -> None:
        """Work for a moment without requests: install a finished background compile, price a forward that
        changed once no compile runs (timing steps on scratch blocks: a few seconds the first time,
        milliseconds with a kept curve) or time a suspect curve's small sizes again (Pricing.refine), and
        hand freed heap memory back to the system."""
        self.upgrade()
        # Not while a compile runs beside: its load would skew the timings, which are kept.
        if not self.priced and not self.compiling:
            self.priced = True
            cost, kept = self.pricing.price(self.forward_description)
            self.calibration_file = kept
            if cost is not None:
                self.policy.target_cost = cost
        elif self.policy.target_cost is not None and not self.compiling:
            self.pricing.refine(self.policy.target_cost, self.calibration_file)  # a suspect curve, now and then
        release_free_heap()

    # -------------------------------------------------------------------------- step
    def step(self) -> list[StreamChunk]:
        """One round over every running sequence: schedule, propose, forward, verify, update. Returns a chunk
        per sequence that gained tokens or failed."""
        self.upgrade()
        began = time.perf_counter()
        plan = self._schedule()
        if plan.empty:
            self._update_gauges()
            return []
        proposing = time.perf_counter()
        decodes, drafts, outputs = self._propose(plan)
        proposing = time.perf_counter() - proposing
        completing = [seq for seq, n in plan.prefills if seq.num_cached + n == len(seq.token_ids)]
        items = self._pack(decodes, drafts, plan.prefills)
        aux_layers = self.proposer.aux_layers
        started = time.perf_counter()
        logits, aux = self.runner.forward(items, aux_layers) if aux_layers else (self.runner.forward(items), None)
        for seq, n in plan.prefills:
            seq.num_cached += n
        rounds = self._rounds(decodes + completing, drafts + [Draft([]) for _ in completing], logits)
        results = self._verify(rounds)  # reads the logits back: the forward has finished, on any device
        forward = time.perf_counter() - started
        self._observe_cost(rows := sum(len(item.tokens) for item in items), forward)
        if aux is not None:
            self._hand_features(decodes, plan.prefills, items, results, aux)
        for i, (rnd, result) in enumerate(zip(rounds, results)):
            outputs.append(self._update(rnd, result, decoding=i < len(decodes)))
        if not plan.prefills and decodes and not self.compiling and self.policy.target_cost is not None:
            # the step beyond its rows' price (host work, and the forward's shape), which drafting adds to
            priced = self.policy.target_cost(rows)
            beyond = time.perf_counter() - began - proposing - priced
            self.policy.surcharge.observe(len(decodes), sum(bool(d.tokens) for d in drafts), beyond, priced)
        self._update_gauges()
        return outputs

    def _observe_cost(self, tokens: int, seconds: float) -> None:
        """Each step corrects the forward-time curve drafts are priced from (calibration.CostModel.observe)."""
        cost = self.policy.target_cost
        if cost is not None and not self.compiling:  # a compile beside slows steps for a while only
            cost.observe(tokens, seconds)
            if cost.observed % 32 == 1:  # the gauges now and then: a few dozen label lookups
                self.metrics.observe_cost(cost)

    def _schedule(self) -> StepPlan:
        preempted = self.scheduler.num_preemptions
        plan = self.scheduler.schedule()
        self.metrics.preemptions.inc(self.scheduler.num_preemptions - preempted)
        return plan

    def _hand_features(
        self,
        decodes: list[Sequence],
        prefills: list[tuple[Sequence, int]],
        items: list[ForwardItem],
        results: list[RoundResult | Exception],
        aux: torch.Tensor,
    ) -> None:
        """Give the proposer the target's aux hidden states of the rows that are now final:
        each decoder's last token and accepted drafts, and every prefill chunk. A round that
        failed hands nothing (its sequence is finished with an error)."""
        rows = aux.split([len(item.tokens) for item in items])
        for i, seq in enumerate(decodes):
            if not isinstance(results[i], Exception):
                self._observe(seq, items[i].start, results[i].take_rows(rows[i]))
        for j, (seq, _) in enumerate(prefills, start=len(decodes)):
            self._observe(seq, items[j].start, rows[j])

    def _observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        try:
            self.proposer.observe(seq, start, features)
        except Exception:  # noqa: BLE001 - drafting is an optimisation: drop its state, keep the request
            logger.warning(
                "proposer state of %s dropped; it restarts from the next features", seq.request_id, exc_info=True
            )
            self.proposer.release(seq)

    def _propose(self, plan: StepPlan) -> tuple[list[Sequence], list[Draft], list[StreamChunk]]:
        """Drafts for the decoding sequences, each cut to its k: (the sequences still
        decoding, their drafts, the chunks of those that failed)."""
        self._prefill_proposer(plan.prefills)
        decodes, drafts, failed = self._draft(plan)
        kept = {id(s) for s in decodes}
        ks = [k for s, k in zip(plan.decodes, plan.ks) if id(s) in kept]
        decodes, drafts, refused = self._constrain_drafts(decodes, ks, drafts, self._spare_tokens(plan))
        return decodes, drafts, failed + refused

    def _prefill_proposer(self, chunks: list[tuple[Sequence, int]]) -> None:
        try:
            self.proposer.prefill(chunks)
        except Exception:  # noqa: BLE001 - drafting is an optimisation: drop its state, keep the requests
            logger.warning("proposer state of %d prefilling sequences dropped", len(chunks), exc_info=True)
            for seq, _ in chunks:
                self.proposer.release(seq)

    def _constrain_drafts(
        self, seqs: list[Sequence], ks: list[int], drafts: list[Draft], spare: int
    ) -> tuple[list[Sequence], list[Draft], list[StreamChunk]]:
        """[structured] Grammar-forced tokens lead constrained drafts, and drafts are cut to what the
        grammar accepts; where that fails, sequence by sequence, so a failure stays with its request."""
        lookup, reserve = self.proposer.lookup, self._reserve_drafts
        # [structured] a grammar's masks follow one path: a constrained sequence's tree is cut to its likeliest
        drafts = [d.main_chain() if d.is_tree and s.constraint is not None and s.constraint.matcher is not None else d
                  for s, d in zip(seqs, drafts)]
        try:
            return seqs, self.structured.drafts(seqs, ks, drafts, lookup, reserve, spare), []
        except Exception:  # noqa: BLE001 - find the sequence it belongs to
            kept, out, failed = [], [], []
            for seq, k, draft in zip(seqs, ks, drafts):
                try:
                    (draft,) = self.structured.drafts([seq], [k], [draft], lookup, reserve, spare)
                except Exception as exc:  # noqa: BLE001 - this request fails alone
                    failed.append(self._fail(seq, exc))
                    continue
                spare -= max(len(draft.tokens) - k, 0)  # forced tokens beyond k spend the step's spare budget
                kept.append(seq)
                out.append(draft)
            return kept, out, failed

    def _draft(self, plan: StepPlan) -> tuple[list[Sequence], list[Draft], list[StreamChunk]]:
        if not any(plan.ks):
            return plan.decodes, [Draft([]) for _ in plan.decodes], []
        base = StepBase(plan.base_tokens, float(len(plan.decodes)), plan.base_tokens - len(plan.decodes))
        self.proposer.begin_step(base)
        try:
            drafts = propose_with_predictions(self.proposer, plan.decodes, plan.ks)
        except Exception:  # noqa: BLE001 - find the sequence it belongs to
            return self._propose_one_by_one(plan.decodes, plan.ks, base)
        return plan.decodes, [d.cut(k) for d, k in zip(drafts, plan.ks)], []

    # [structured] what forced drafts beyond k need: KV room and the step's spare token budget
    def _reserve_drafts(self, seq: Sequence, n: int) -> bool:
        return self.pool.reserve(seq.block_table, len(seq.token_ids) + n, seq.num_cached)

    def _spare_tokens(self, plan: StepPlan) -> int:
        used = sum(1 + k for k in plan.ks) + sum(n for _, n in plan.prefills)
        return max(self.config.max_num_batched_tokens - used, 0)

    def _propose_one_by_one(
        self, seqs: list[Sequence], ks: list[int], base: StepBase
    ) -> tuple[list[Sequence], list[Draft], list[StreamChunk]]:
        # The failed pass may have left the proposer's state half-advanced: start it afresh.
        for seq in seqs:
            self.proposer.release(seq)
        decodes, drafts, failed = [], [], []
        for seq, k in zip(seqs, ks):
            try:
                if k:
                    self.proposer.begin_step(base)
                draft = propose_with_predictions(self.proposer, [seq], [k])[0] if k else Draft([])
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                failed.append(self._fail(seq, exc))
                continue
            decodes.append(seq)
            drafts.append(draft.cut(k))
        return decodes, drafts, failed

    @staticmethod
    def _pack(decodes: list[Sequence], drafts: list[Draft], prefills: list[tuple[Sequence, int]]) -> list[ForwardItem]:
        """The step's one target forward: each decoding sequence's last token and drafts
        (logits for all of them), then each prefill chunk (logits for its last token only
        when the chunk completes the prompt)."""
        items = [
            ForwardItem(
                s.block_table,
                s.num_cached,
                [s.token_ids[-1]] + d.tokens,
                1 + len(d.tokens),
                [-1] + [p + 1 for p in d.parents] if d.is_tree else None,  # row 0 is the tree's root
            )
            for s, d in zip(decodes, drafts)
        ]
        for seq, n in prefills:
            start, end = seq.num_cached, seq.num_cached + n
            items.append(ForwardItem(seq.block_table, start, seq.token_ids[start:end], int(end == len(seq.token_ids))))
        return items

    @staticmethod
    def _rounds(seqs: list[Sequence], drafts: list[Draft], logits: torch.Tensor) -> list[Round]:
        """Split the forward's logits by sequence, in the order _pack laid them out."""
        rows = logits.split([1 + len(d.tokens) for d in drafts])
        return [Round(s, d, r) for s, d, r in zip(seqs, drafts, rows)]

    def _verify(self, rounds: list[Round]) -> list[RoundResult | Exception]:
        """Grammar masks and logit bias on every verified row (logprobs keep the unmasked
        rows), then verify_round over the batch; when either fails, round by round, so that
        a failure stays with the sequence it belongs to."""
        try:
            return verify_round(self.structured.mask_rounds(rounds))
        except Exception:  # noqa: BLE001 - find the round it belongs to
            results: list[RoundResult | Exception] = []
            for rnd in rounds:
                try:
                    results.append(verify_round(self.structured.mask_rounds([rnd]))[0])
                except Exception as exc:  # noqa: BLE001 - this request fails alone
                    results.append(exc)
            return results

    def _update(self, rnd: Round, result: RoundResult | Exception, decoding: bool) -> StreamChunk:
        if isinstance(result, Exception):
            return self._fail(rnd.seq, result)
        try:
            return self._commit(rnd, result, decoding)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
            return self._fail(rnd.seq, exc)

    def _commit(self, rnd: Round, result: RoundResult, decoding: bool) -> StreamChunk:
        seq = rnd.seq
        if decoding:
            # The last token and the accepted drafts now have KV; the rejected ones' slots
            # are simply past the length. [trees] The accepted path's KV moves to follow the last token.
            start = seq.num_cached + 1
            if result.path is not None and result.path != list(range(len(result.path))):
                self.pool.move(seq.block_table, [start + j for j in result.path], list(range(start, start + len(result.path))))
            seq.num_cached += 1 + result.num_accepted
        tokens = self.structured.commit(seq, result.tokens)  # [structured] a refused token fails this request alone
        new = self._append(seq, tokens)
        self.structured.finish_if_complete(seq)  # [structured] "stop" once the grammar is complete
        # Accepted drafts cut off by a stop or the length limit were never emitted.
        accepted = min(result.num_accepted, len(new))
        forced = rnd.draft.num_forced
        # The k policy's acceptance is geometric along one path: a round saw a rejection unless its walk ended
        # at a leaf (a chain's last draft; [trees] side branches left behind are not rejections of the path it
        # took) and nothing accepted was cut off by a stop.
        ended = result.at_leaf and accepted == result.num_accepted
        self._record(seq, rnd.k, accepted, len(new), decoding, rnd.draft.method, not ended, forced)
        logits = rnd.logits if result.path is None else rnd.logits[result.rows()]  # the emitted tokens' rows
        chunk = self._chunk(seq, new, rnd.k, accepted, logits, forced, rnd.draft.method if rnd.k else "")
        if seq.finish_reason is not None:
            self._finish(seq)
        else:
            self.proposer.on_commit(seq)
            self.pool.trim(seq.block_table, len(seq.token_ids))
        return chunk

    def _append(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Append tokens to seq up to the one that finishes it (EOS, a stop token or string,
        the length limit), setting its finish_reason; return the tokens appended."""
        params = seq.params
        for n, tok in enumerate(tokens, 1):
            seq.token_ids.append(tok)
            if tok in self.eos_token_ids and not params.ignore_eos or tok in params.stop_token_ids:
                seq.finish_reason = "stop"
            elif seq.detokenizer.add(tok):
                seq.finish_reason = "stop"
            elif seq.num_output_tokens >= seq.max_tokens or len(seq.token_ids) >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finish_reason is not None:
                return tokens[:n]
        return list(tokens)

    def _record(
        self,
        seq: Sequence,
        num_drafted: int,
        num_accepted: int,
        num_emitted: int,
        decoding: bool,
        method: str,
        rejected: bool,
        num_forced: int = 0,
    ) -> None:
        seq.stats.record(num_drafted, num_accepted, num_forced, method)
        if decoding:  # [structured] the k policy learns from the proposer's own drafts only
            drafted, accepted = proposer_share(num_drafted, num_accepted, num_forced)
            if drafted:
                drafted = accepted + int(rejected)  # one path: its accepted drafts, then the rejection if any
            self.policy.record(seq, drafted, accepted)
        self.metrics.record_round(num_drafted, num_accepted, num_emitted, method, num_forced, decoding)

    @staticmethod
    def _chunk(
        seq: Sequence,
        new: list[int],
        num_drafted: int,
        num_accepted: int,
        logits: torch.Tensor,
        num_forced: int = 0,
        method: str = "",
    ) -> StreamChunk:
        finished = seq.finish_reason is not None
        top = seq.params.logprobs
        return StreamChunk(
            request_id=seq.request_id,
            text=seq.detokenizer.take(final=finished),
            token_ids=new,
            num_drafted=num_drafted,
            num_accepted=num_accepted,
            num_forced=num_forced,
            finish_reason=seq.finish_reason,
            usage=_usage(seq) if finished else None,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens] if seq.num_output_tokens == len(new) else None,
            logprobs=token_logprobs(logits, new, top) if top is not None else None,
            stop_string=seq.detokenizer.matched if finished else None,
            method=method,
        )

    def _finish(self, seq: Sequence) -> None:
        self._requests.pop(seq.request_id, None)
        self.scheduler.finish(seq)
        self.metrics.finished.labels(finished_reason=seq.finish_reason).inc()

    def _fail(self, seq: Sequence, exc: Exception) -> StreamChunk:
        logger.error("request %s failed while generating; the others go on", seq.request_id, exc_info=exc)
        usage = _usage(seq)
        seq.finish_reason = "error"
        if seq.is_finished:
            self._requests.pop(seq.request_id, None)
        else:
            self._finish(seq)
        error = f"an internal error ({type(exc).__name__}) stopped this request; the engine's log has the details"
        return StreamChunk(seq.request_id, "", [], 0, 0, "error", usage, error=error)

    def _update_gauges(self) -> None:
        self.metrics.observe_batch(len(self.scheduler.running), len(self.scheduler.waiting), self.pool.usage)
        self.metrics.observe_prefix_cache(self.scheduler.prefix_cache)

    # ---------------------------------------------------------------------- generate
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion. prompts: one prompt or a list (strings, token-id
        lists, chat message lists, ChatPrompts); params: one for all or one per prompt."""
        if isinstance(prompts, (str, ChatPrompt)) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError("give one SamplingParams, or one per prompt")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        seqs = [self._requests[i] for i in ids]
        while any(not s.is_finished for s in seqs):
            self.step()
        return [
            RequestOutput(
                s.request_id,
                s.token_ids[: s.num_prompt_tokens],
                s.detokenizer.text,
                s.output_ids,
                s.finish_reason,
                s.stats,
                num_cached_tokens=s.prefix.hit_tokens or 0,
            )
            for s in seqs
        ]
