"""Train an EAGLE-3-style draft head for a target, on CPU, with no downloaded data.

Phases (each resumable from the work directory DIR/work):
1. prompts: the target writes its own questions from the user-turn prefix of its chat
   template (deduplicated), or they come from a JSONL file (chat messages or plain strings);
2. answers: the target answers them with specstream's own batched engine, mostly greedy and
   some sampled, so the head learns the target's own distribution;
3. features: one packed forward per group of sequences captures the target's residual
   stream entering the three aux layers and its argmax at every position, into a
   memory-mapped file;
4. training: the training-time test (the head unrolled on its own outputs for several
   steps, loss weighted 0.8^step) with AdamW under bf16 autocast, checkpointed so
   ``resume`` continues;
5. report: held-out acceptance per draft position, mean accepted length and coverage of the
   reduced vocabulary, printed and written as DIR/report.json; the head goes to DIR in the
   EAGLE-3 format (draft_head.py).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specstream.config import EngineConfig, SpeculativeConfig
from specstream.draft_head import DraftHead, HeadConfig, save_head
from specstream.engine import Engine
from specstream.runner import ForwardItem
from specstream.sampling import SamplingParams
from specstream.sequence import Sequence

logger = logging.getLogger("specstream.train_draft")

_MARK = "\x00QUESTION\x00"


@dataclass
class TrainConfig:
    model: str
    out: str
    prompts: str | None = None  # JSONL file; None: the target writes its own
    minutes: float = 45.0  # wall budget of the whole run
    tokens: int | None = None  # training token-passes budget (None: time decides)
    resume: bool = False
    num_prompts: int = 1500
    max_prompt_tokens: int = 64
    max_answer_tokens: int = 256
    sampled_fraction: float = 0.2
    sample_temperature: float = 0.7
    seq_len: int = 512
    draft_vocab_size: int = 8192
    ttt_steps: int = 3
    eval_steps: int = 6
    # Small batches and a high rate: on a CPU the head sees few optimizer steps in a run's budget, and
    # more of them beat bigger ones (measured on SmolLM2-135M, 5 minutes each: batch 8 at 3e-4 reached
    # 0.21 held-out acceptance at the first position, 8 at 1.5e-3 0.28, 4 at 1.5e-3 0.36).
    batch_size: int = 4
    lr: float = 1.5e-3
    heldout_fraction: float = 0.05
    # Most of the budget prompts + answers may take. Training time is what a head lacks most here: six
    # times the data at the same training steps moved acceptance by 0.01.
    data_share: float = 0.4
    dtype: str = "auto"
    threads: int | None = None
    seed: int = 0
    checkpoint_seconds: float = 120.0
    engine_overrides: dict = field(default_factory=dict)


class _Clock:
    def __init__(self, minutes: float, spent: float = 0.0) -> None:
        self.start = time.perf_counter() - spent
        self.budget = minutes * 60.0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def left(self) -> float:
        return self.budget - self.elapsed


def _progress(label: str, done: float, total: float, started: float, unit: str) -> None:
    spent = time.perf_counter() - started
    rate = done / spent if spent > 0 else 0.0
    eta = (total - done) / rate if rate > 0 else float("inf")
    pct = 100.0 * done / total if total else 100.0
    logger.info("%s: %.0f/%.0f %s (%.0f%%), %.0f %s/s, ETA %s", label, done, total, unit, pct, rate, unit, _fmt(eta))


def _fmt(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


# ---------------------------------------------------------------------- generation
def _generate(engine: Engine, prompts: list, params: list[SamplingParams], deadline: float, label: str):
    """Run prompts through the engine until done or the deadline; return every sequence that
    produced output (those cut off by the deadline are aborted, their output kept)."""
    seqs: list[Sequence] = []
    for prompt, p in zip(prompts, params):
        seq = engine.prepare(prompt, p)
        engine.submit(seq)
        seqs.append(seq)
    started = last = time.perf_counter()
    total = sum(p.max_tokens for p in params)
    while engine.has_unfinished() and time.perf_counter() < deadline:
        engine.step()
        if time.perf_counter() - last > 15:
            last = time.perf_counter()
            _progress(label, sum(s.num_output_tokens for s in seqs), total, started, "tokens")
    # At the deadline, a half-written answer is still the target's own text: keep it.
    done = [s for s in seqs if s.finish_reason in ("stop", "length") or (not s.is_finished and s.num_output_tokens)]
    for s in seqs:
        if not s.is_finished:
            engine.abort(s.request_id)
    logger.info(
        "%s: %d of %d kept, %d tokens in %.0f s",
        label,
        len(done),
        len(seqs),
        sum(s.num_output_tokens for s in done),
        time.perf_counter() - started,
    )
    return done


def user_turn_prefix(tokenizer) -> str:
    """The chat template's text up to where a user's message starts."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=False
    )
    return text[: text.index(_MARK)]


def self_prompts(engine: Engine, cfg: TrainConfig, deadline: float) -> list[str]:
    """Questions the target writes itself (Magpie): given only the user-turn prefix, it
    continues with a user message. Deduplicated, in the order written."""
    prefix = engine.tokenizer.encode(user_turn_prefix(engine.tokenizer), add_special_tokens=False)
    seen, prompts, round_ = set(), [], 0
    while len(prompts) < cfg.num_prompts and time.perf_counter() < deadline:
        want = int((cfg.num_prompts - len(prompts)) * 1.3) + 8
        params = [
            SamplingParams(
                max_tokens=cfg.max_prompt_tokens, temperature=1.0, seed=cfg.seed * 1_000_003 + round_ * 100_000 + i
            )
            for i in range(want)
        ]
        for seq in _generate(engine, [prefix] * want, params, deadline, "prompts"):
            # A question cut off at max_prompt_tokens is still a prompt worth answering.
            text = engine.tokenizer.decode(seq.output_ids, skip_special_tokens=True).strip()
            key = " ".join(text.lower().split())
            if len(key) >= 12 and key not in seen:
                seen.add(key)
                prompts.append(text)
        round_ += 1
    return prompts[: cfg.num_prompts]


def read_prompts(path: str) -> list:
    """JSONL: each line a string, a list of chat messages, or {"messages": [...]} / {"prompt": "..."}."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if isinstance(item, dict):
            item = item.get("messages") or item.get("prompt")
        if not (isinstance(item, str) or (isinstance(item, list) and all(isinstance(m, dict) for m in item))):
            raise ValueError(f"{path}:{n}: expected a string or a list of chat messages")
        out.append(item)
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def make_answers(engine: Engine, prompts: list, cfg: TrainConfig, deadline: float) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(cfg.seed)
    chats = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    params = []
    for i in range(len(chats)):
        if rng.random() < cfg.sampled_fraction:
            params.append(
                SamplingParams(max_tokens=cfg.max_answer_tokens, temperature=cfg.sample_temperature, seed=cfg.seed + i)
            )
        else:
            params.append(SamplingParams(max_tokens=cfg.max_answer_tokens, temperature=0.0))
    done = _generate(engine, chats, params, deadline, "answers")
    return [(s.token_ids[: s.num_prompt_tokens], s.output_ids) for s in done if s.num_output_tokens >= 8]


# ---------------------------------------------------------------------- features
@dataclass
class Dataset:
    """Sequences (prompt + answer, cut at seq_len) with the target's features and argmax."""

    tokens: np.ndarray  # [N] int32, all sequences back to back
    labels: np.ndarray  # [N] int32: the target's argmax at each position (its next token)
    features: np.ndarray  # [N, 3H] uint16 (bf16 bits), memory-mapped
    offsets: np.ndarray  # [S + 1]
    prompt_lens: np.ndarray  # [S]

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def answer_mask(self) -> np.ndarray:
        """Positions whose label predicts an answer token (p >= prompt_len - 1)."""
        mask = np.zeros(len(self.tokens), dtype=bool)
        for s in range(len(self)):
            mask[self.offsets[s] + self.prompt_lens[s] - 1 : self.offsets[s + 1]] = True
        return mask


def capture_features(
    engine: Engine, seqs: list[tuple[list[int], list[int]]], aux_layers: tuple[int, ...], work: Path, seq_len: int
) -> Dataset:
    hidden = engine.model.config.get_text_config().hidden_size
    joined = [(p + a)[:seq_len] for p, a in seqs]
    lengths = np.array([len(j) for j in joined])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total = int(offsets[-1])
    feats = np.lib.format.open_memmap(
        work / "features.npy", mode="w+", dtype=np.uint16, shape=(total, len(aux_layers) * hidden)
    )
    labels = np.zeros(total, dtype=np.int32)
    group_tokens = engine.config.max_num_batched_tokens
    started = last = time.perf_counter()
    i = 0
    while i < len(joined):
        group = [i]
        size = len(joined[i])
        while group[-1] + 1 < len(joined) and size + len(joined[group[-1] + 1]) <= group_tokens:
            group.append(group[-1] + 1)
            size += len(joined[group[-1]])
        tables = []
        try:
            items = []
            for s in group:
                table = engine.pool.new_table()
                if not engine.pool.reserve(table, len(joined[s])):
                    raise RuntimeError("the KV pool cannot hold one training sequence; lower seq_len")
                tables.append(table)
                items.append(ForwardItem(table, 0, joined[s], len(joined[s])))
            logits, aux = engine.runner.forward(items, aux_layers)
        finally:
            for t in tables:
                engine.pool.free(t)
        lo, hi = offsets[group[0]], offsets[group[-1] + 1]
        labels[lo:hi] = logits.argmax(-1).numpy()
        feats[lo:hi] = aux.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        i = group[-1] + 1
        if time.perf_counter() - last > 15:
            last = time.perf_counter()
            _progress("features", hi, total, started, "tokens")
    feats.flush()
    data = Dataset(
        np.concatenate([np.array(j, dtype=np.int32) for j in joined]),
        labels,
        feats,
        offsets,
        np.array([len(p) for p, _ in seqs]),
    )
    np.savez(work / "dataset.npz", tokens=data.tokens, labels=labels, offsets=offsets, prompt_lens=data.prompt_lens)
    return data


def load_dataset(work: Path) -> Dataset | None:
    if not (work / "dataset.npz").is_file():
        return None
    z = np.load(work / "dataset.npz")
    feats = np.load(work / "features.npy", mmap_mode="r")
    return Dataset(z["tokens"], z["labels"], feats, z["offsets"], z["prompt_lens"])


def draft_vocabulary(data: Dataset, size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent answer labels, sorted by id, and the share of answer labels
    they cover."""
    answer = data.labels[data.answer_mask()]
    counts = np.bincount(answer, minlength=vocab_size)
    keep = np.sort(np.argsort(-counts, kind="stable")[:size])
    coverage = float(counts[keep].sum() / max(counts.sum(), 1))
    return torch.from_numpy(keep.astype(np.int64)), coverage


# ---------------------------------------------------------------------- training
@dataclass
class Batch:
    aux: torch.Tensor  # [B, L, 3H] bf16
    tokens: torch.Tensor  # [B, L]
    chain: torch.Tensor  # [B, L]: the target's argmax at each position (the token it would emit next)
    labels: torch.Tensor  # [B, L + steps]: draft index of the target's argmax, -1 where not trained
    valid_until: torch.Tensor  # [B]: sequence length


def make_batch(data: Dataset, idx: list[int], t2d_index: torch.Tensor, steps: int) -> Batch:
    """labels[b, p]: the draft id the head should give at label position p (row t of step j
    reads p = t + j + 1), or -1 where p is not an answer position or its label is outside
    the draft vocabulary."""
    length = max(int(data.offsets[s + 1] - data.offsets[s]) for s in idx)
    width = data.features.shape[1]
    aux = torch.zeros((len(idx), length, width), dtype=torch.int16)
    tokens = torch.zeros((len(idx), length), dtype=torch.long)
    chain = torch.zeros((len(idx), length), dtype=torch.long)
    labels = torch.full((len(idx), length + steps + 1), -1, dtype=torch.long)
    for b, s in enumerate(idx):
        lo, hi = int(data.offsets[s]), int(data.offsets[s + 1])
        n = hi - lo
        aux[b, :n] = torch.from_numpy(np.array(data.features[lo:hi]).view(np.int16))
        tokens[b, :n] = torch.from_numpy(data.tokens[lo:hi].astype(np.int64))
        chain[b, :n] = torch.from_numpy(data.labels[lo:hi].astype(np.int64))
        lab = t2d_index[torch.from_numpy(data.labels[lo:hi].astype(np.int64))]
        start = max(int(data.prompt_lens[s]) - 1, 0)
        labels[b, start:n] = lab[start:]
    lens = torch.tensor([int(data.offsets[s + 1] - data.offsets[s]) for s in idx])
    return Batch(aux.view(torch.bfloat16), tokens, chain, labels, lens)


def step_targets(batch: Batch, j: int) -> torch.Tensor:
    """[B, L] labels of TTT step j (row t predicts label position t + j + 1)."""
    length = batch.tokens.shape[1]
    return batch.labels[:, j + 1 : j + 1 + length]


def ttt_loss(head: DraftHead, batch: Batch, steps: int, decay: float = 0.8) -> tuple[torch.Tensor, list[float]]:
    outs = head.unroll(batch.aux, batch.tokens, steps, batch.chain)
    total, accs, weight_sum = 0.0, [], 0.0
    for j, hidden in enumerate(outs):
        target = step_targets(batch, j)
        mask = target >= 0
        if not mask.any():
            accs.append(0.0)
            continue
        lg = head.logits(hidden[mask]).float()
        tg = target[mask]
        total = total + decay**j * F.cross_entropy(lg, tg)
        weight_sum += decay**j
        accs.append(float((lg.argmax(-1) == tg).float().mean()))
    return total / max(weight_sum, 1e-9), accs


@torch.no_grad()
def evaluate(
    head: DraftHead, data: Dataset, idx: list[int], t2d_index: torch.Tensor, steps: int, batch_size: int = 8
) -> dict:
    """Chain acceptance on held-out sequences: position j is accepted when the head's drafts
    1..j all equal the target's greedy tokens, over every chain that starts in an answer
    (the TTT forward with true tokens is exactly the chain given its earlier drafts were
    right, which is the only case in which position j is reached)."""
    hits = np.zeros(steps)
    chains = 0
    for k in range(0, len(idx), batch_size):
        part = idx[k : k + batch_size]
        batch = make_batch(data, part, t2d_index, steps)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = head.unroll(batch.aux, batch.tokens, steps, batch.chain)
        # Row t drafts tokens t + 2 .. t + steps + 1: chains whose first draft is an answer
        # token and whose last is still inside the sequence. A label outside the draft
        # vocabulary (-1 there) can never be drafted: it counts as a miss.
        chain = torch.zeros(batch.tokens.shape, dtype=torch.bool)
        for b, s in enumerate(part):
            chain[b, max(int(data.prompt_lens[s]) - 2, 0) : int(batch.valid_until[b]) - steps] = True
        ok = chain
        for j, hidden in enumerate(outs):
            ok = ok & (head.logits(hidden).argmax(-1) == step_targets(batch, j))
            hits[j] += float(ok.sum())
        chains += int(chain.sum())
    per_pos = (hits / max(chains, 1)).tolist()
    return {
        "acceptance_per_position": [round(a, 4) for a in per_pos],
        "mean_accepted_length": round(1.0 + sum(per_pos), 3),
        "num_chains": chains,
    }


def _lr(cfg: TrainConfig, progress: float) -> float:
    warm = 0.03
    if progress < warm:
        return cfg.lr * max(progress / warm, 0.05)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min((progress - warm) / (1 - warm), 1.0))))


def train_head(
    head: DraftHead,
    data: Dataset,
    train_idx: list[int],
    cfg: TrainConfig,
    t2d_index: torch.Tensor,
    deadline: float,
    work: Path,
) -> dict:
    ckpt_path = work / "checkpoint.pt"
    opt = torch.optim.AdamW(
        [p for p in head.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    state = {"step": 0, "token_passes": 0, "seconds": 0.0, "epoch": 0, "order": [], "pos": 0}
    if cfg.resume and ckpt_path.is_file():
        saved = torch.load(ckpt_path, weights_only=False)
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["optimizer"])
        state = saved["state"]
        logger.info("resumed at step %d (%d token-passes)", state["step"], state["token_passes"])
    rng = random.Random(cfg.seed + state["epoch"])
    lengths = data.offsets[1:] - data.offsets[:-1]
    time_budget = max(deadline - time.perf_counter(), 1.0) + state["seconds"]
    started = time.perf_counter() - state["seconds"]
    last_log = last_ckpt = time.perf_counter()
    head.train()
    while True:
        now = time.perf_counter()
        spent = now - started
        progress = spent / time_budget
        if cfg.tokens:
            progress = max(progress, state["token_passes"] / cfg.tokens)
        if progress >= 1.0 or now >= deadline:
            break
        if state["pos"] >= len(state["order"]):
            order = list(train_idx)
            rng.shuffle(order)
            # Similar lengths together: less padding.
            chunks = [
                sorted(order[i : i + cfg.batch_size * 16], key=lambda s: lengths[s])
                for i in range(0, len(order), cfg.batch_size * 16)
            ]
            batches = [c[i : i + cfg.batch_size] for c in chunks for i in range(0, len(c), cfg.batch_size)]
            rng.shuffle(batches)
            state["order"], state["pos"], state["epoch"] = batches, 0, state["epoch"] + 1
        idx = state["order"][state["pos"]]
        state["pos"] += 1
        batch = make_batch(data, idx, t2d_index, cfg.ttt_steps)
        for group in opt.param_groups:
            group["lr"] = _lr(cfg, progress)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, accs = ttt_loss(head, batch, cfg.ttt_steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        state["step"] += 1
        state["token_passes"] += int(sum(lengths[s] for s in idx))
        state["seconds"] = time.perf_counter() - started
        if time.perf_counter() - last_log > 20:
            last_log = time.perf_counter()
            rate = state["token_passes"] / state["seconds"]
            logger.info(
                "train: step %d, epoch %d, loss %.3f, step accuracy %s, %.0f token-passes/s, lr %.2e, ETA %s",
                state["step"], state["epoch"], float(loss.detach()), [round(a, 3) for a in accs], rate, _lr(cfg, progress),
                _fmt(time_budget * (1 - progress)),
            )  # fmt: skip
        if time.perf_counter() - last_ckpt > cfg.checkpoint_seconds:
            last_ckpt = time.perf_counter()
            torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "state": state}, ckpt_path)
    torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "state": state}, ckpt_path)
    head.eval()
    return state


# ---------------------------------------------------------------------- the whole run
def _build_dataset(engine: Engine, cfg: TrainConfig, work: Path, aux_layers, data_deadline: float, timed):
    """Prompts (given, or written by the target), the target's answers to them, and the
    features the head learns from, each phase timed into the run's meta."""
    t0 = time.perf_counter()
    prompts_path = work / "prompts.jsonl"
    if cfg.resume and prompts_path.is_file():
        prompts = read_prompts(str(prompts_path))
    else:
        if cfg.prompts:
            prompts = read_prompts(cfg.prompts)
        else:
            prompt_deadline = time.perf_counter() + (data_deadline - time.perf_counter()) * 0.2
            prompts = self_prompts(engine, cfg, prompt_deadline)
        prompts_path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    logger.info("prompts: %d", len(prompts))
    timed("prompts", t0)
    t0 = time.perf_counter()
    seqs = make_answers(engine, prompts, cfg, data_deadline)
    if len(seqs) < 2:
        raise RuntimeError("too few answers to train on; give the run more --minutes")
    timed("answers", t0)
    t0 = time.perf_counter()
    data = capture_features(engine, seqs, aux_layers, work, cfg.seq_len)
    timed("features", t0)
    return data


def train_draft(cfg: TrainConfig) -> dict:
    """Run every phase within cfg.minutes; write the head to cfg.out and return the report."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    meta_path = work / "meta.json"
    meta = json.loads(meta_path.read_text()) if cfg.resume and meta_path.is_file() else {"phase_seconds": {}}
    clock = _Clock(cfg.minutes, spent=sum(meta["phase_seconds"].values()))
    torch.manual_seed(cfg.seed)

    def save_meta() -> None:
        meta_path.write_text(json.dumps(meta, indent=1))

    def timed(phase: str, started: float) -> None:
        meta["phase_seconds"][phase] = meta["phase_seconds"].get(phase, 0.0) + time.perf_counter() - started
        save_meta()

    engine = Engine(
        EngineConfig(
            model=cfg.model,
            dtype=cfg.dtype,
            speculative=SpeculativeConfig(method="off"),
            max_num_seqs=128,
            max_num_batched_tokens=1024,
            kv_cache_bytes=2 * 2**30,
            **cfg.engine_overrides,
        ),
        log=False,
    )
    head_cfg = HeadConfig.for_target(engine.model.config, cfg.draft_vocab_size)
    data_deadline = time.perf_counter() + max(clock.left * cfg.data_share, 1.0)

    data = load_dataset(work) if cfg.resume else None
    if data is None:
        data = _build_dataset(engine, cfg, work, head_cfg.aux_layers, data_deadline, timed)
    num_answer = int(data.answer_mask().sum())
    logger.info("dataset: %d sequences, %d tokens, %d answer positions", len(data), len(data.tokens), num_answer)

    draft_ids, coverage = draft_vocabulary(data, head_cfg.draft_vocab_size, head_cfg.vocab_size)
    head_cfg.draft_vocab_size = len(draft_ids)
    base = engine.model.model if hasattr(engine.model, "model") else engine.model
    head = DraftHead(head_cfg, engine.model.get_input_embeddings().weight)
    head.set_vocabulary(draft_ids)
    head.init_from_target(base.norm.weight, engine.model.get_output_embeddings().weight, seed=cfg.seed)
    t2d_index = torch.full((head_cfg.vocab_size,), -1, dtype=torch.long)
    t2d_index[draft_ids] = torch.arange(len(draft_ids))

    order = list(range(len(data)))
    random.Random(cfg.seed).shuffle(order)
    n_held = max(1, int(len(order) * cfg.heldout_fraction))
    heldout, train_idx = sorted(order[:n_held]), order[n_held:]

    t0 = time.perf_counter()
    reserve = 30.0 + 0.02 * len(heldout) * cfg.seq_len / 100  # time kept for the evaluation and saving
    state = train_head(
        head, data, train_idx, cfg, t2d_index, time.perf_counter() + max(clock.left - reserve, 5.0), work
    )
    timed("training", t0)
    t0 = time.perf_counter()
    metrics = evaluate(head, data, heldout, t2d_index, cfg.eval_steps)
    timed("evaluation", t0)
    report = {
        "target": cfg.model,
        "draft_vocab_size": head_cfg.draft_vocab_size,
        "vocab_coverage": round(coverage, 4),
        "aux_layers": list(head_cfg.aux_layers),
        "sequences": len(data),
        "heldout_sequences": len(heldout),
        "dataset_tokens": len(data.tokens),
        "answer_tokens": num_answer,
        "train_steps": state["step"],
        "token_passes": state["token_passes"],
        "epochs": round(state["token_passes"] / max(len(data.tokens), 1), 2),
        "ttt_steps": cfg.ttt_steps,
        **metrics,
        "phase_seconds": {k: round(v, 1) for k, v in meta["phase_seconds"].items()},
        "total_seconds": round(sum(meta["phase_seconds"].values()), 1),
        "config": {k: v for k, v in asdict(cfg).items() if k != "engine_overrides"},
    }
    head_cfg.target = {
        "name": cfg.model,
        "report": {
            k: report[k] for k in ("acceptance_per_position", "mean_accepted_length", "vocab_coverage", "answer_tokens")
        },
    }
    save_head(head, out)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
