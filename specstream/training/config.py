"""What a draft-head training run does: TrainConfig."""

from __future__ import annotations

from dataclasses import dataclass, field

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
