"""Engine configuration: one dataclass for the engine, one for speculation, validated on creation."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

SPECULATIVE_METHODS = ("auto", "suffix", "ngram", "eagle", "draft", "off")
QUANTIZATION_MODES = ("none", "auto", "int8", "int4", "a8")
DTYPES = ("auto", "bfloat16", "float16", "float32")


@dataclass
class SpeculativeConfig:
    """How drafts are proposed.

    method: "auto" (the default: per sequence and round, the draft head, a suffix-tree draft, an
    n-gram match or none, whichever is expected to yield more tokens per unit of cost; without a
    head for the target, the others), "suffix" (suffix decoding: how text ending like this went
    on before, in this request and in earlier requests' outputs), "ngram" (prompt lookup over
    prompt + output), "eagle" (a trained
    EAGLE-3-style draft head: the directory draft_model, or with None the head bundled for
    the model), "draft" (a small model sharing the target's vocabulary, named by
    draft_model), or "off" (plain decoding). The README's "Trained draft heads" section has what
    each method measured.
    num_speculative_tokens: the most drafts per sequence per round (k_max).
    adaptive: choose each sequence's k per round from its acceptance history and the
    measured cost of verification; False drafts k_max whenever a proposal exists.
    forced_drafts: draft the tokens a request's grammar forces (structured outputs), on
    top of k and whatever the method ("off" included).
    tree_drafts: where a proposer has several continuations (suffix decoding; n-gram lookup's several
    occurrences of the matched suffix under method "ngram"), verify them as one tree of
    drafts in one forward, accepting the longest path the target agrees with (models whose attention is
    all full-context; elsewhere, and for requests under a grammar, the likeliest path as a chain).
    suffix_*: suffix decoding's (method "suffix", and auto's) tree depth (the longest match plus draft),
    longest draft per token of match, least estimated chance of a draft token, and the earlier requests
    whose outputs the global cache keeps (oldest dropped first; 0 keeps none).
    """

    method: str = "auto"
    num_speculative_tokens: int = 16
    draft_model: str | None = None
    draft_dtype: str | None = None
    ngram_min: int = 1
    ngram_max: int = 4
    adaptive: bool = True
    forced_drafts: bool = True  # [structured]
    tree_drafts: bool = True
    suffix_max_depth: int = 24
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    suffix_max_cached_requests: int = 256

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        if not 0 <= self.num_speculative_tokens <= 64:
            raise ValueError("num_speculative_tokens must be between 0 and 64")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if not 2 <= self.suffix_max_depth <= 128:
            raise ValueError("suffix_max_depth must be between 2 and 128")
        if not 0.0 < self.suffix_max_spec_factor <= 64.0:
            raise ValueError("suffix_max_spec_factor must be in (0, 64]")
        if not 0.0 <= self.suffix_min_token_prob <= 1.0:
            raise ValueError("suffix_min_token_prob must be between 0 and 1")
        if not 0 <= self.suffix_max_cached_requests <= 100_000:
            raise ValueError("suffix_max_cached_requests must be between 0 and 100000")

    @property
    def enabled(self) -> bool:
        return self.method != "off" and self.num_speculative_tokens > 0


@dataclass
class EngineConfig:
    """Everything the engine needs to start.

    dtype/device: "auto" picks bf16 where the hardware runs it natively (else fp32) and cuda
    when present. KV space is kv_cache_tokens slots per model; when None it is derived from
    kv_cache_bytes. max_model_len bounds prompt + output of one sequence (default: the
    model's own limit, capped by the pool). enable_prefix_caching keeps the KV of committed
    full blocks for reuse by later requests with the same token prefix (memory/prefix_cache.py).
    max_prompt_chars bounds a prompt's characters before it is tokenized (default:
    max_model_len * 32). allow_special_tokens_in_content lets text in chat message content that
    spells a special token (say "<|im_start|>") become that token, as plain templating does; by
    default it stays text, so no message can forge another turn. seed seeds the engine's draws
    of seeds for requests that bring none.
    chat_template: a Jinja file path or inline template that replaces the model's own (needed
    for chat with a model that has none).
    quantization: how the projections' weights are held (kernels/quant.py): "auto" (the default) serves
    the blocks a GGUF file stores as they are, by weight-only kernels, on CPU (dense on other devices and
    for other sources); "a8" multiplies the file's 4- and 8-bit blocks by the activations rounded to
    8-bit blocks, as integers (llama.cpp's approach: a verification's rows cost about 1.6 decode rows, not
    4-5; a token's logits do not depend on its step, so speculation stays lossless; less accurate in bf16
    than the weight-only kernels and llama.cpp: see the README), and
    rounds other sources' weights to 8-bit blocks; "none" keeps every weight dense as loaded; "int4" /
    "int8" quantize every projection (lossy where the source is not 4-bit).
    deterministic: batch- and speculation-invariant numerics (model/runner.py): a token's logits are
    bit-identical whatever else its step computed, so greedy output, and seeded sampling, give
    the same tokens with or without drafts and alone or in any batch, in bf16 too. Where a kernel's
    rounding follows the step's shape (dense weights, torch's attention) it costs the padding of every
    step to fixed tiles; over specstream's block kernels (a GGUF file's weights on CPU) little or
    none. A tree row's keys sit at other places in its step than the same path's as a chain (siblings
    masked between them), and attention sums keys grouped by place: drafts are verified as trees only
    where attention drops its tiles (its kernel then lays such a row's keys side by side, as a chain
    has them), else as chains. Needs the lean Llama forward.
    compile: torch.compile the lean forward's decode and verification steps (model/fast_llama.py), traced at
    start-up and cached on disk by inductor. On by default; the environment variable
    SPECSTREAM_COMPILE=0 turns the default off (the test suite does, to start engines fast). Ignored
    in invariant mode and for models that run through transformers' modules.
    compile_in_background: with compile, build the engine with the eager forward and compile in a thread of
    its own while it serves; the compiled steps are installed between two steps once ready (the server's
    default: a first start serves within seconds of loading instead of after the compile).
    """

    model: str = "smollm2-135m"
    dtype: str = "auto"
    device: str = "auto"
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    kv_cache_bytes: int = 512 * 2**20
    kv_block_size: int = 16
    enable_prefix_caching: bool = True
    seed: int = 0
    max_prompt_chars: int | None = None
    allow_special_tokens_in_content: bool = False
    chat_template: str | None = None
    quantization: str = "auto"
    deterministic: bool = False
    compile: bool = field(default_factory=lambda: os.environ.get("SPECSTREAM_COMPILE", "1").lower() not in ("0", "false", "no"))
    compile_in_background: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.speculative, dict):
            self.speculative = SpeculativeConfig(**self.speculative)
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {self.quantization!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_block_size", "kv_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.max_prompt_chars is not None and self.max_prompt_chars < 1:
            raise ValueError("max_prompt_chars must be positive")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.kv_block_size:
            raise ValueError("kv_cache_tokens must hold at least one block")
        if self.max_num_batched_tokens < self.speculative.num_speculative_tokens + 1:
            raise ValueError("max_num_batched_tokens must fit one sequence's verification step")
