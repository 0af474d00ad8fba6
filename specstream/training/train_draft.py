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
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specstream.config import EngineConfig, SpeculativeConfig
from specstream.spec_decode.draft_head import DraftHead, HeadConfig, save_head
from specstream.engine.engine import Engine
from specstream.training.config import TrainConfig
from specstream.training.data import Dataset, capture_features, draft_vocabulary, load_dataset, make_answers, read_prompts, self_prompts
from specstream.training.progress import Clock, fmt_duration

logger = logging.getLogger("specstream.training.train_draft")

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
                fmt_duration(time_budget * (1 - progress)),
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
    clock = Clock(cfg.minutes, spent=sum(meta["phase_seconds"].values()))
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

    head, t2d_index, coverage = _new_head(engine, head_cfg, data, cfg.seed)

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
    report = _report(cfg, head_cfg, data, heldout, state, metrics, coverage, meta["phase_seconds"])
    head_cfg.target = {
        "name": cfg.model,
        "report": {
            k: report[k] for k in ("acceptance_per_position", "mean_accepted_length", "vocab_coverage", "answer_tokens")
        },
    }
    save_head(head, out)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _new_head(engine: Engine, head_cfg: HeadConfig, data: Dataset, seed: int) -> tuple[DraftHead, torch.Tensor, float]:
    """A head over the data's most frequent answer tokens, started from the target's own final norm and
    LM head; with the map from target ids to draft ids (-1 outside) and the vocabulary's coverage."""
    draft_ids, coverage = draft_vocabulary(data, head_cfg.draft_vocab_size, head_cfg.vocab_size)
    head_cfg.draft_vocab_size = len(draft_ids)
    base = engine.model.model if hasattr(engine.model, "model") else engine.model
    head = DraftHead(head_cfg, engine.model.get_input_embeddings().weight)
    head.set_vocabulary(draft_ids)
    head.init_from_target(base.norm.weight, engine.model.get_output_embeddings().weight, seed=seed)
    t2d_index = torch.full((head_cfg.vocab_size,), -1, dtype=torch.long)
    t2d_index[draft_ids] = torch.arange(len(draft_ids))
    return head, t2d_index, coverage


def _report(cfg: TrainConfig, head_cfg: HeadConfig, data: Dataset, heldout: list[int], state: dict, metrics: dict,
            coverage: float, phase_seconds: dict) -> dict:
    num_answer = int(data.answer_mask().sum())
    return {
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
        "phase_seconds": {k: round(v, 1) for k, v in phase_seconds.items()},
        "total_seconds": round(sum(phase_seconds.values()), 1),
        "config": {k: v for k, v in asdict(cfg).items() if k != "engine_overrides"},
    }
