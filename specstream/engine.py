"""Engine: the synchronous, in-process entry point.

It owns the models, the KV pools, the proposer, the k policy and the scheduler. ``step()``
runs one speculative round over every running sequence: schedule, propose, one packed
target forward, verify, commit. ``generate()`` loops steps until its requests finish.
"""

from __future__ import annotations

import itertools
import sys
import time
import uuid

import torch

from specstream import fast_llama, quant
from specstream.adaptive_k import CostModel, KPolicy, record_round
from specstream.attention import ATTN_IMPLEMENTATION, model_geometry
from specstream.config import EngineConfig
from specstream.detok import IncrementalDetokenizer
from specstream.kv import KVPool
from specstream.models import gguf_file, load_model, load_tokenizer, resolve_device, resolve_dtype, resolve_model
from specstream.errors import InvalidRequestError
from specstream.metrics import EngineMetrics
from specstream.outputs import RequestOutput, StreamChunk, TokenLogprob, Usage
from specstream.proposers import Draft, DraftModelProposer, NgramProposer, NoProposer, Proposer
from specstream.runner import ForwardItem, ModelRunner
from specstream.sampling import SamplingParams
from specstream.scheduler import Scheduler
from specstream.sequence import Sequence
from specstream.verify import verify_round

_CALIBRATION_CONTEXT = 64


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


def _log(msg: str) -> None:
    print(f"[specstream] {msg}", file=sys.stderr, flush=True)


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, log: bool = True) -> None:
        self.config = config = config or EngineConfig()
        spec = config.speculative
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        start = time.perf_counter()
        source = resolve_model(config.model)
        self.tokenizer = load_tokenizer(source)
        self.model = load_model(source, self.dtype, self.device, attn_implementation=ATTN_IMPLEMENTATION)
        self.model_name = config.model
        self.vocab_size = self.model.config.get_text_config().vocab_size
        self.eos_token_ids = self._eos_ids()

        num_tokens = self._pool_tokens(self.model, self.dtype)
        self.pool = KVPool(*model_geometry(self.model.config), num_tokens, config.kv_block_size, self.dtype, self.device)
        limit = getattr(self.model.config.get_text_config(), "max_position_embeddings", None) or self.pool.capacity
        self.max_model_len = config.max_model_len or min(limit, self.pool.capacity)
        if self.max_model_len > self.pool.capacity:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the KV pool ({self.pool.capacity} tokens)")
        self.runner, weights = self._make_runner(source)
        self.proposer = self._make_proposer()
        target_cost = None
        if spec.enabled and spec.adaptive:
            target_cost = self._calibrate(self.runner)
            if isinstance(self.proposer, DraftModelProposer):
                self.proposer.cost = self._calibrate(self.proposer.runner)
        k_max = spec.num_speculative_tokens if spec.enabled else 0
        self.policy = KPolicy(k_max, spec.adaptive, target_cost, self.proposer.pass_cost)
        self.scheduler = Scheduler(config, self.pool, self.policy, self.proposer.release)
        self._requests: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self.metrics = EngineMetrics()
        if log:
            _log(
                f"engine ready in {time.perf_counter() - start:.1f} s: {config.model} ({self.dtype}, {self.device}), "
                f"speculation {spec.method} k<={k_max}, KV pool {self.pool.capacity} tokens; weights {weights}; "
                f"resident memory {quant.resident_bytes() / 2**20:.0f} MiB"
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

    def _make_runner(self, source) -> tuple[ModelRunner, str]:
        """The target's runner with its projections held as config.quantization says (quant.py), and
        a line for the log."""
        mode = self.config.quantization
        if not fast_llama.supports(self.model):
            if mode in ("int4", "int8"):
                raise ValueError(f"quantization {mode} needs a Llama-architecture model (the lean forward)")
            return ModelRunner(self.model, self.pool), "dense"
        factory = quant.make_factory(mode, self.model, gguf_file(source), self.dtype, self.device)
        if factory is None:
            return ModelRunner(self.model, self.pool), "dense"
        runner = ModelRunner(self.model, self.pool, linear=factory)
        choices = quant.settle(factory, self.model, self.config.max_num_batched_tokens)
        return runner, quant.describe(factory, choices)

    def _make_proposer(self) -> Proposer:
        spec = self.config.speculative
        if not spec.enabled:
            return NoProposer()
        if spec.method == "ngram":
            return NgramProposer(spec.ngram_min, spec.ngram_max)
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
        pool = KVPool(*model_geometry(draft.config), self.pool.capacity, self.config.kv_block_size, dtype, self.device)
        return DraftModelProposer(draft, pool)

    def _calibrate(self, runner: ModelRunner) -> CostModel:
        """Forward time vs step size, measured on a throwaway sequence (rolled back each time)."""
        top = max(self.config.max_num_batched_tokens, 1)
        sizes = sorted({n for n in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128) if n <= top} | {min(top, 128)})
        table: list[int] = []
        pool = runner.pool
        context = min(_CALIBRATION_CONTEXT, pool.capacity - sizes[-1])
        if context < 0 or not pool.reserve(table, context + sizes[-1]):
            pool.free(table)
            return CostModel([1], [1.0])
        try:
            if context:
                runner.forward([ForwardItem(table, 0, [0] * context, 1)])
            return CostModel.measure(lambda n: runner.forward([ForwardItem(table, context, [0] * n, 1)]), sizes)
        finally:
            pool.free(table)

    # ---------------------------------------------------------------------- requests
    def encode_prompt(self, prompt) -> list[int]:
        """A string, a list of token ids, or a list of chat messages -> token ids.
        Raises InvalidRequestError for anything else."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            for m in prompt:
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise InvalidRequestError("each chat message needs a string 'role' and a string 'content'")
            try:
                ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, return_dict=False)
            except Exception as exc:  # noqa: BLE001 - templates raise what they like (jinja errors, ValueError)
                raise InvalidRequestError(f"the model's chat template rejected these messages: {exc}", param="messages") from exc
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size})")
        else:
            raise InvalidRequestError("a prompt must be a string, a list of token ids, or a list of chat messages")
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return ids

    def prepare(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> Sequence:
        """Validate and tokenize a request without touching engine state (safe from any
        thread); submit() then queues it."""
        params = params or SamplingParams()
        ids = self.encode_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens, "
                f"so at most {self.max_model_len - 1} prompt tokens leave room for output",
                param="messages",
                code="context_length_exceeded",
            )
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"this model's context is {self.max_model_len} tokens, but {len(ids) + params.max_tokens} were "
                f"requested ({len(ids)} in the prompt, {params.max_tokens} for the completion); lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        seq = Sequence(request_id or uuid.uuid4().hex, ids, params, arrival=-1)
        seq.max_tokens = params.max_tokens or self.max_model_len - len(ids)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens)
        return seq

    def submit(self, seq: Sequence) -> str:
        if seq.request_id in self._requests:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
        seq.arrival = next(self._arrivals)
        self._requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self.metrics.prompt_tokens.inc(seq.num_prompt_tokens)
        return seq.request_id

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        return self.submit(self.prepare(prompt, params, request_id))

    def abort(self, request_id: str) -> StreamChunk | None:
        """Stop a request now and free its KV. Returns its last chunk (finish_reason
        "abort", with usage), or None when the request is not in the engine."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        self.scheduler.finish(seq)
        self.metrics.finished.labels(finished_reason="abort").inc()
        return StreamChunk(request_id, seq.detokenizer.take(final=True), [], 0, 0, "abort", Usage(seq.num_prompt_tokens, seq.num_output_tokens))

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
        """One round over every running sequence; a chunk per sequence that gained tokens."""
        preempted = self.scheduler.num_preemptions
        plan = self.scheduler.schedule()
        self.metrics.preemptions.inc(self.scheduler.num_preemptions - preempted)
        if plan.empty:
            self._update_gauges()
            return []
        if any(plan.ks):
            drafts = self.proposer.propose(plan.decodes, plan.ks)
            drafts = [Draft(d.tokens[:k], None if d.probs is None else d.probs[:k]) for d, k in zip(drafts, plan.ks)]
        else:
            drafts = [Draft([]) for _ in plan.decodes]
        items = [ForwardItem(s.block_table, s.num_cached, [s.token_ids[-1]] + d.tokens, 1 + len(d.tokens)) for s, d in zip(plan.decodes, drafts)]
        completing = []
        for seq, n in plan.prefills:
            done = seq.num_cached + n == len(seq.token_ids)
            items.append(ForwardItem(seq.block_table, seq.num_cached, seq.token_ids[seq.num_cached : seq.num_cached + n], int(done)))
            if done:
                completing.append(seq)
        logits = self.runner.forward(items)
        for seq, n in plan.prefills:
            seq.num_cached += n
        rows = logits.split([1 + len(d.tokens) for d in drafts] + [1] * len(completing))
        rounds = [(s, d, r) for s, d, r in zip(plan.decodes, drafts, rows)]
        rounds += [(s, Draft([]), r) for s, r in zip(completing, rows[len(drafts) :])]
        outputs = []
        for (seq, draft, rows), (accepted, tokens) in zip(rounds, verify_round(rounds)):
            try:
                chunk = self._commit(seq, draft, accepted, tokens, decoding=seq in plan.decodes)
                if seq.params.logprobs is not None:
                    chunk.logprobs = token_logprobs(rows, chunk.token_ids, seq.params.logprobs)
                outputs.append(chunk)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others
                outputs.append(self._fail(seq, exc))
        self._update_gauges()
        return outputs

    def _update_gauges(self) -> None:
        self.metrics.num_running.set(len(self.scheduler.running))
        self.metrics.num_waiting.set(len(self.scheduler.waiting))
        self.metrics.kv_usage.set(self.pool.usage)

    def _fail(self, seq: Sequence, exc: Exception) -> StreamChunk:
        seq.finish_reason = "error"
        self._requests.pop(seq.request_id, None)
        if not seq.is_finished:
            self.scheduler.finish(seq)
        self.metrics.finished.labels(finished_reason="error").inc()
        return StreamChunk(seq.request_id, "", [], 0, 0, "error", Usage(seq.num_prompt_tokens, seq.num_output_tokens), error=f"{type(exc).__name__}: {exc}")

    def _commit(self, seq: Sequence, draft: Draft, accepted: int, tokens: list[int], decoding: bool) -> StreamChunk:
        if decoding:
            # The last token and the accepted drafts now have KV; the rejected ones' slots
            # are simply past the length.
            seq.num_cached += 1 + accepted
        params = seq.params
        new: list[int] = []
        for tok in tokens:
            seq.token_ids.append(tok)
            new.append(tok)
            if tok in self.eos_token_ids and not params.ignore_eos or tok in params.stop_token_ids:
                seq.finish_reason = "stop"
            elif seq.detokenizer.add(tok):
                seq.finish_reason = "stop"
            elif seq.num_output_tokens >= seq.max_tokens or len(seq.token_ids) >= self.max_model_len:
                seq.finish_reason = "length"
            if seq.finish_reason:
                break
        seq.stats.record(len(draft.tokens), accepted)
        if decoding:
            record_round(seq, len(draft.tokens), accepted)
        self.metrics.record_round(len(draft.tokens), accepted, len(new))
        finished = seq.finish_reason is not None
        text = seq.detokenizer.take(final=finished)
        if finished:
            self._requests.pop(seq.request_id, None)
            self.scheduler.finish(seq)
            self.metrics.finished.labels(finished_reason=seq.finish_reason).inc()
        else:
            self.proposer.on_commit(seq)
            self.pool.trim(seq.block_table, len(seq.token_ids))
        return StreamChunk(
            request_id=seq.request_id,
            text=text,
            token_ids=new,
            num_drafted=len(draft.tokens),
            num_accepted=accepted,
            finish_reason=seq.finish_reason,
            usage=Usage(seq.num_prompt_tokens, seq.num_output_tokens) if finished else None,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens] if seq.num_output_tokens == len(new) else None,
        )

    # ---------------------------------------------------------------------- generate
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion. prompts: one prompt or a list (strings, token-id
        lists, chat message lists); params: one for all or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError("give one SamplingParams, or one per prompt")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        seqs = [self._requests[i] for i in ids]
        while any(not s.is_finished for s in seqs):
            self.step()
        return [
            RequestOutput(s.request_id, s.token_ids[: s.num_prompt_tokens], s.detokenizer.text, s.output_ids, s.finish_reason, s.stats)
            for s in seqs
        ]
