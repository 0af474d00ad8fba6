"""Engine: the synchronous, in-process entry point.

It owns the models, the KV pools, the proposer, the k policy, the scheduler and the input
processor. ``step()`` runs one speculative round over every running sequence: schedule,
propose, one packed target forward, verify, update. ``generate()`` loops steps until its
requests finish.

Failures (DESIGN's fault model): a request with bad parameters never gets here (the input
processor refuses it); an exception while proposing for or verifying one request fails that
request alone (the batch is retried one sequence at a time) and the step goes on; an
exception in the target's forward escapes step(), since the batch cannot go on without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
import uuid
from pathlib import Path

import torch

from specstream import fast_llama, quant
from specstream.adaptive_k import CostModel, KPolicy, record_round
from specstream.attention import ATTN_IMPLEMENTATION, model_geometry
from specstream.config import EngineConfig
from specstream.auto_proposer import AutoProposer
from specstream.draft_head import HeadError
from specstream.eagle import EagleProposer, load_for_target, resolve_head_dir
from specstream.errors import InvalidRequestError
from specstream.kv import KVPool
from specstream.metrics import EngineMetrics
from specstream.models import (
    cache_dir,
    converted_source,
    gguf_file,
    load_model,
    load_tokenizer,
    processor_name,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from specstream.outputs import RequestOutput, StreamChunk, TokenLogprob, Usage
from specstream.processor import ChatPrompt, InputProcessor
from specstream.proposers import Draft, DraftModelProposer, NgramProposer, NoProposer, Proposer
from specstream.runner import INVARIANT_TILE, ForwardItem, ModelRunner, layer_windows
from specstream.sampling import SamplingParams
from specstream.scheduler import Scheduler, StepPlan
from specstream.sequence import Sequence
from specstream.structured import StructuredDecoding, proposer_share
from specstream.verify import Round, RoundResult, verify_round

logger = logging.getLogger(__name__)

_CALIBRATION_CONTEXT = 64
# How far a one-token step timed at start may be from the cached curve's before it is measured again
# (repeated timings here vary by about 10%).
CALIBRATION_TOLERANCE = 0.15


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
    return Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.prefix.hit_tokens or 0)


def _cut(draft: Draft, k: int) -> Draft:
    return Draft(draft.tokens[:k], None if draft.probs is None else draft.probs[:k], draft.method)


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, log: bool = True) -> None:
        self.config = config = config or EngineConfig()
        spec = config.speculative
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        start = time.perf_counter()
        source = resolve_model(config.model)
        self.tokenizer = load_tokenizer(source, chat_template=config.chat_template)
        self.model = load_model(source, self.dtype, self.device, attn_implementation=ATTN_IMPLEMENTATION)
        self.vocab_size = self.model.config.get_text_config().vocab_size
        self.eos_token_ids = self._eos_ids()

        self.kv_tokens = self._pool_tokens(self.model, self.dtype)
        self.pool = KVPool(
            *model_geometry(self.model.config),
            self.kv_tokens,
            config.kv_block_size,
            self.dtype,
            self.device,
            windows=layer_windows(self.model),
        )
        # A pool whose every layer is windowed holds a sequence of any length: then its memory's worth.
        limit = getattr(self.model.config.get_text_config(), "max_position_embeddings", None) or self._pool_positions()
        self.max_model_len = config.max_model_len or min(limit, self.pool.capacity)
        if self.max_model_len > self.pool.capacity:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the KV pool ({self.pool.capacity} tokens)")
        self.runner, weights = self._make_runner(source)
        forward = self._compile()
        self.proposer = self._make_proposer()
        # [structured] grammars, forced drafts, masks; the draft model's logits are masked too
        self.structured = StructuredDecoding(
            self.tokenizer, self.vocab_size, self.eos_token_ids, forced_drafts=spec.forced_drafts
        )
        for drafter in (self.proposer, getattr(self.proposer, "head", None)):  # auto: its head
            if isinstance(drafter, (DraftModelProposer, EagleProposer)):
                drafter.constrain = self.structured.mask_draft_logits
        target_cost = None
        # where the forward-time curve is kept between starts (None: not cached)
        self.calibration_file = self._calibration_file(source, f"{weights}; {forward}")
        if spec.enabled and spec.adaptive:
            target_cost = self._calibrate(self.runner, self.calibration_file)
            if isinstance(self.proposer, DraftModelProposer):
                self.proposer.cost = self._calibrate(self.proposer.runner)
            elif isinstance(self.proposer, EagleProposer):
                self.proposer.calibrate()
                self.proposer.target_cost = target_cost  # chains stop where drafts stop paying
            elif isinstance(self.proposer, AutoProposer):
                if self.proposer.head is not None:
                    self.proposer.head.calibrate()
                    self.proposer.head.target_cost = target_cost
                self.proposer.target_cost = target_cost
        k_max = spec.num_speculative_tokens if spec.enabled else 0
        self.policy = KPolicy(k_max, spec.adaptive, target_cost, self.proposer.pass_cost)
        self.scheduler = Scheduler(config, self.pool, self.policy, self.proposer.release)
        self.processor = InputProcessor(
            tokenizer=self.tokenizer,
            output_tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            rng=random.Random(config.seed),
            max_prompt_chars=config.max_prompt_chars,
            allow_special_tokens_in_content=config.allow_special_tokens_in_content,
            structured=self.structured,
        )
        self._requests: dict[str, Sequence] = {}
        self.metrics = EngineMetrics()
        if log:
            logger.info(
                "engine ready in %.1f s: %s (%s, %s), speculation %s k<=%d, KV pool %s; weights %s; "
                "forward %s; resident memory %.0f MiB",
                time.perf_counter() - start,
                config.model,
                self.dtype,
                self.device,
                spec.method,
                k_max,
                self.pool.describe(),
                weights,
                forward,
                quant.resident_bytes() / 2**20,
            )

    # ----------------------------------------------------------------- set-up helpers
    def _eos_ids(self) -> set[int]:
        ids = set()
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _pool_tokens(self, model, dtype: torch.dtype) -> int:
        if self.config.kv_cache_tokens is not None:
            return self.config.kv_cache_tokens
        per_token = KVPool.bytes_per_token(*model_geometry(model.config), dtype)
        tokens = self.config.kv_cache_bytes // per_token
        # No point holding more than every sequence at full context.
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if limit:
            tokens = min(tokens, limit * self.config.max_num_seqs)
        return max(tokens, self.config.kv_block_size)

    def _pool_positions(self) -> int:
        """The positions one sequence may take in the target's pool: its capacity, but at most its memory's
        worth (a pool whose every layer is windowed holds any length). A proposer's own pool holds as many."""
        return min(self.pool.capacity, self.kv_tokens)

    def _make_runner(self, source) -> tuple[ModelRunner, str]:
        """The target's runner with its projections held as config.quantization says (quant.py), and
        a line for the log."""
        mode = self.config.quantization
        tile = INVARIANT_TILE if self.config.deterministic else 0
        if not fast_llama.supports(self.model):
            if mode in ("int4", "int8"):
                raise ValueError(f"quantization {mode} needs a Llama-architecture model (the lean forward)")
            return ModelRunner(self.model, self.pool, tile=tile), "dense"
        factory = quant.make_factory(mode, self.model, gguf_file(source), self.dtype, self.device)
        if factory is None:
            return ModelRunner(self.model, self.pool, tile=tile), "dense"
        runner = ModelRunner(self.model, self.pool, linear=factory, tile=tile)
        # Invariant mode: a fixed route (the packed kernel), not one timed at start-up.
        routes = self._cache_file(source, "routes", [mode, self.config.max_num_batched_tokens, factory.kernel_kinds])
        choices = quant.settle(
            factory, self.model, self.config.max_num_batched_tokens, timed=not self.config.deterministic, routes_file=routes
        )
        return runner, quant.describe(factory, choices)

    def _compile(self) -> str:
        """The forward's compiled steps (runner.compile), after the kernel routes are settled; a line
        for the log."""
        if not self.config.compile:
            return "eager"
        if self.config.deterministic:
            return "eager (invariant mode)"
        return self.runner.compile()

    def _make_proposer(self) -> Proposer:
        spec = self.config.speculative
        if not spec.enabled:
            return NoProposer()
        if spec.method == "ngram":
            return NgramProposer(spec.ngram_min, spec.ngram_max)
        if spec.method in ("eagle", "auto"):
            return self._make_head_proposer()
        source = resolve_model(spec.draft_model)
        draft_tokenizer = load_tokenizer(source)
        dtype = resolve_dtype(spec.draft_dtype, self.device) if spec.draft_dtype else self.dtype
        draft = load_model(source, dtype, self.device, attn_implementation=ATTN_IMPLEMENTATION)
        draft_vocab = draft.config.get_text_config().vocab_size
        if draft_tokenizer.get_vocab() != self.tokenizer.get_vocab() or draft_vocab != self.vocab_size:
            raise ValueError(
                f"draft model '{spec.draft_model}' does not share the target's vocabulary "
                f"(draft {len(draft_tokenizer)} tokens / {draft_vocab} logits, target "
                f"{len(self.tokenizer)} / {self.vocab_size}); speculative decoding needs the same tokenizer"
            )
        pool = KVPool(*model_geometry(draft.config), self._pool_positions(), self.config.kv_block_size, dtype, self.device)
        return DraftModelProposer(
            draft,
            pool,
            max_pass_tokens=self.config.max_num_batched_tokens,
            prefix_caching=self.config.enable_prefix_caching,
        )

    def _make_head_proposer(self) -> Proposer:
        spec = self.config.speculative
        ngram = NgramProposer(spec.ngram_min, spec.ngram_max)
        try:
            head_dir = resolve_head_dir(spec.draft_model, self.config.model)
        except HeadError as exc:
            if spec.method == "eagle":
                raise
            logger.info("speculation auto: n-gram only (%s)", exc)
            return AutoProposer(None, ngram)
        head = load_for_target(head_dir, self.model, self.config.model, self.dtype, self.device)
        # Below float32 the head's step reads 8-bit weights where the CPU kernels serve them (drafts
        # only: output is unchanged). float32 keeps the head as trained.
        if self.dtype != torch.float32 and head.serve_in_8_bits():
            logger.info("draft head: projections served in 8-bit blocks")
        cfg = head.cfg
        capacity, block_size = self._pool_positions(), self.config.kv_block_size
        pool = KVPool(1, cfg.num_key_value_heads, cfg.head_dim, capacity, block_size, self.dtype, self.device)
        eagle = EagleProposer(head, pool)
        if spec.method == "eagle":
            return eagle
        # The head's held-out first-position acceptance is the best prior for its drafts.
        accept = (cfg.target.get("report") or {}).get("acceptance_per_position") or [None]
        return AutoProposer(eagle, ngram, head_prior=accept[0]) if accept[0] else AutoProposer(eagle, ngram)

    def _calibrate(self, runner: ModelRunner, cache: Path | None = None) -> CostModel:
        """Forward time vs step size, measured on a throwaway sequence (rolled back each time).
        With a cache file, a curve measured by an earlier start is read from it instead, once a
        one-token step timed now agrees with it: a curve measured while the machine was busy, or
        before a kernel changed, would misprice every draft for as long as the file lives."""
        if cache is not None and (cost := CostModel.load(cache)) is not None:
            now = self._time_steps(runner, [1], repeats=5)
            if now is None or abs(now(1) / cost(1) - 1.0) <= CALIBRATION_TOLERANCE:
                return cost
            logger.info(
                "a one-token step takes %.2f ms now, %.2f ms in the cached forward-time curve: measuring it again",
                1e3 * now(1),
                1e3 * cost(1),
            )
        cost = self._measure_forward(runner)
        if cache is not None:
            try:
                cost.save(cache)
            except OSError as exc:
                logger.warning("could not cache the forward-time calibration in %s: %s", cache, exc)
        return cost

    def _calibration_file(self, source, weights: str) -> Path | None:
        """Where the target's forward-time curve is kept between starts, keyed by the weight
        kernels, invariant mode and step sizes besides what _cache_file keys on."""
        return self._cache_file(source, "forward", [weights, self.config.deterministic, *self._calibration_plan()])

    def _cache_file(self, source, kind: str, key: list) -> Path | None:
        """A file under ~/.cache/specstream/calibration for what start-up measures on this machine (the
        kernel routes, the forward-time curve): only for models that specstream holds in its own
        content-keyed cache (the bundled model, any GGUF file), so the file names exactly these weights;
        keyed by everything else a timing depends on (dtype, device and processor, threads, torch) and
        by `key`. Delete that directory to measure again."""
        models = (cache_dir() / "models").resolve()
        path = Path(converted_source(source).path).resolve()
        if models not in path.parents:
            return None
        full = json.dumps(
            [kind, path.name, str(self.dtype), str(self.device), processor_name(self.device), torch.get_num_threads(),
             torch.__version__, *key]
        )
        return cache_dir() / "calibration" / f"{kind}-{hashlib.sha256(full.encode()).hexdigest()[:32]}.json"

    def _calibration_plan(self, pool: KVPool | None = None) -> tuple[list[int], int]:
        """The step sizes timed, and the context (cached tokens) they are timed over."""
        top = max(self.config.max_num_batched_tokens, 1)
        sizes = sorted({n for n in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128) if n <= top} | {min(top, 128)})
        return sizes, min(_CALIBRATION_CONTEXT, (pool or self.pool).capacity - sizes[-1])

    def _measure_forward(self, runner: ModelRunner) -> CostModel:
        return self._time_steps(runner, self._calibration_plan(runner.pool)[0]) or CostModel([1], [1.0])

    def _time_steps(self, runner: ModelRunner, sizes: list[int], repeats: int = 3) -> CostModel | None:
        """Steps of each size over the calibration context, timed; None where the pool cannot hold them."""
        pool = runner.pool
        context = self._calibration_plan(pool)[1]
        table = pool.new_table()
        if context < 0 or not pool.reserve(table, context + max(sizes)):
            pool.free(table)
            return None
        try:
            if context:
                runner.forward([ForwardItem(table, 0, [0] * context, 1)])
            return CostModel.measure(lambda n: runner.forward([ForwardItem(table, context, [0] * n, 1)]), sizes, repeats)
        finally:
            pool.free(table)

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

    # -------------------------------------------------------------------------- step
    def step(self) -> list[StreamChunk]:
        """One round over every running sequence: schedule, propose, forward, verify, update.
        Returns a chunk per sequence that gained tokens or failed."""
        plan = self._schedule()
        if plan.empty:
            self._update_gauges()
            return []
        decodes, drafts, outputs = self._propose(plan)
        completing = [seq for seq, n in plan.prefills if seq.num_cached + n == len(seq.token_ids)]
        items = self._pack(decodes, drafts, plan.prefills)
        aux_layers = self.proposer.aux_layers
        logits, aux = self.runner.forward(items, aux_layers) if aux_layers else (self.runner.forward(items), None)
        for seq, n in plan.prefills:
            seq.num_cached += n
        rounds = self._rounds(decodes + completing, drafts + [Draft([]) for _ in completing], logits)
        results = self._verify(rounds)
        if aux is not None:
            self._hand_features(decodes, plan.prefills, items, results, aux)
        for i, (rnd, result) in enumerate(zip(rounds, results)):
            outputs.append(self._update(rnd, result, decoding=i < len(decodes)))
        self._update_gauges()
        return outputs

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
                self._observe(seq, items[i].start, rows[i][: 1 + results[i].num_accepted])
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
        self.proposer.prefill(plan.prefills)
        decodes, drafts, failed = self._draft(plan)
        # [structured] grammar-forced tokens lead constrained drafts; drafts cut to what the grammar accepts
        kept = {id(s) for s in decodes}
        ks = [k for s, k in zip(plan.decodes, plan.ks) if id(s) in kept]
        ngram = self.proposer.ngram if isinstance(self.proposer, AutoProposer) else self.proposer
        lookup = ngram.lookup if isinstance(ngram, NgramProposer) else None
        drafts = self.structured.drafts(decodes, ks, drafts, lookup, self._reserve_drafts, self._spare_tokens(plan))
        return decodes, drafts, failed

    def _draft(self, plan: StepPlan) -> tuple[list[Sequence], list[Draft], list[StreamChunk]]:
        if not any(plan.ks):
            return plan.decodes, [Draft([]) for _ in plan.decodes], []
        try:
            drafts = self.proposer.propose(plan.decodes, plan.ks)
        except Exception:  # noqa: BLE001 - find the sequence it belongs to
            return self._propose_one_by_one(plan.decodes, plan.ks)
        return plan.decodes, [_cut(d, k) for d, k in zip(drafts, plan.ks)], []

    # [structured] what forced drafts beyond k need: KV room and the step's spare token budget
    def _reserve_drafts(self, seq: Sequence, n: int) -> bool:
        return self.pool.reserve(seq.block_table, len(seq.token_ids) + n, seq.num_cached)

    def _spare_tokens(self, plan: StepPlan) -> int:
        used = sum(1 + k for k in plan.ks) + sum(n for _, n in plan.prefills)
        return max(self.config.max_num_batched_tokens - used, 0)

    def _propose_one_by_one(
        self, seqs: list[Sequence], ks: list[int]
    ) -> tuple[list[Sequence], list[Draft], list[StreamChunk]]:
        # The failed pass may have left the proposer's state half-advanced: start it afresh.
        for seq in seqs:
            self.proposer.release(seq)
        decodes, drafts, failed = [], [], []
        for seq, k in zip(seqs, ks):
            try:
                draft = self.proposer.propose([seq], [k])[0] if k else Draft([])
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                failed.append(self._fail(seq, exc))
                continue
            decodes.append(seq)
            drafts.append(_cut(draft, k))
        return decodes, drafts, failed

    @staticmethod
    def _pack(decodes: list[Sequence], drafts: list[Draft], prefills: list[tuple[Sequence, int]]) -> list[ForwardItem]:
        """The step's one target forward: each decoding sequence's last token and drafts
        (logits for all of them), then each prefill chunk (logits for its last token only
        when the chunk completes the prompt)."""
        items = [
            ForwardItem(s.block_table, s.num_cached, [s.token_ids[-1]] + d.tokens, 1 + len(d.tokens))
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
            # are simply past the length.
            seq.num_cached += 1 + result.num_accepted
        tokens = self.structured.commit(seq, result.tokens)  # [structured] a refused token fails this request alone
        new = self._append(seq, tokens)
        self.structured.finish_if_complete(seq)  # [structured] "stop" once the grammar is complete
        # Accepted drafts cut off by a stop or the length limit were never emitted.
        accepted = min(result.num_accepted, len(new))
        forced = rnd.draft.num_forced
        self._record(seq, rnd.k, accepted, len(new), decoding, rnd.draft.method, forced)
        chunk = self._chunk(seq, new, rnd.k, accepted, rnd.logits, forced)
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
        num_forced: int = 0,
    ) -> None:
        seq.stats.record(num_drafted, num_accepted, num_forced)
        if decoding:  # [structured] the k policy learns from the proposer's own drafts only
            record_round(seq, *proposer_share(num_drafted, num_accepted, num_forced))
        self.metrics.record_round(num_drafted, num_accepted, num_emitted, method, num_forced)

    @staticmethod
    def _chunk(
        seq: Sequence, new: list[int], num_drafted: int, num_accepted: int, logits: torch.Tensor, num_forced: int = 0
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
        self.metrics.num_running.set(len(self.scheduler.running))
        self.metrics.num_waiting.set(len(self.scheduler.waiting))
        self.metrics.kv_usage.set(self.pool.usage)
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
