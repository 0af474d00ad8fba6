"""The trainer's data: prompts (the target's own, or a file), the target's answers, and the features
captured from one packed forward per group of sequences (a memory-mapped dataset)."""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specstream.engine.engine import Engine
from specstream.sequence import Sequence
from specstream.model.runner import ForwardItem
from specstream.sampling import SamplingParams
from specstream.training.config import TrainConfig
from specstream.training.progress import progress

logger = logging.getLogger("specstream.training")

_MARK = "\x00QUESTION\x00"



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
            progress(label, sum(s.num_output_tokens for s in seqs), total, started, "tokens")
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
            progress("features", hi, total, started, "tokens")
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
