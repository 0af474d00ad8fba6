"""A model file's own quantized weights, as stored: 4-bit blocks (GGUF Q4_0/Q4_1, and Q4_K's super-blocks as
blocks of 32 with float32 scales) and 8-bit blocks (GGUF Q8_0, and Q6_K's 6-bit codes with a scale per 16),
read without dequantizing and kept in the cache in their own layout.

Int4 format. torch's int4 kernels (tinygemm: ``_weight_int4pack_mm_for_cpu`` on CPU,
``_weight_int4pack_mm`` on CUDA) compute each weight in float32 as ``(c - 8) * scale + zero`` from a code
c in 0..15 and a scale and zero per group of 32 inputs, stored in the activation dtype. A GGUF Q4_1 block
holds float16 d and m with ``w = d * c + m`` (Q4_0: ``w = d * (c - 8)``), so ``scale = d`` and
``zero = m + 8 d`` give the file's weights bit for bit whenever the scales are stored in float32 (checked
per block; tests/test_quant.py proves it on the bundled file). In bfloat16, the only dtype with a
vectorized CPU int4 kernel, scale and zero are rounded to bf16's 8-bit significand: the 4-bit codes stay
the file's, the block scales lose 3 bits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specstream.cache import cache_dir

GROUP = 32
# Bumped when the layout of the on-disk int4 cache changes.
_CACHE_FORMAT = 4


@dataclass
class Int4Weights:
    """Affine 4-bit weights, GGUF Q4_1's form: w[n, k] = scales[n, g] * codes[n, k] + mins[n, g], g = k // 32."""

    codes: torch.Tensor  # [N, K] uint8 in 0..15
    scales: torch.Tensor  # [N, K // 32] float32
    mins: torch.Tensor  # [N, K // 32] float32

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], computed as GGUF's reference dequantization does (one rounding per weight)."""
        scales = self.scales.repeat_interleave(GROUP, dim=1)
        mins = self.mins.repeat_interleave(GROUP, dim=1)
        return self.codes.float() * scales + mins

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int4Weights:
        """Round-to-nearest asymmetric quantization of a dense [N, K] weight, per group of 32 inputs."""
        n, k = weight.shape
        groups = weight.float().reshape(n, k // GROUP, GROUP)
        # float16 scale and minimum, as GGUF's Q4_1 stores them: the kernel's float32 (c - 8) * scale is then
        # exact, so the packed kernel and the dense copy serve bit-identical weights.
        low, high = groups.amin(-1).half().float(), groups.amax(-1)
        scales = ((high - low) / 15).clamp_min(torch.finfo(torch.float16).tiny).half().float()
        codes = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8)
        return cls(codes.reshape(n, k), scales, low)

    @classmethod
    def cat(cls, parts: list[Int4Weights]) -> Int4Weights:
        return cls(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "mins")))


@dataclass
class Int8Blocks:
    """Symmetric 8-bit weights, GGUF Q8_0's form: w[n, k] = scales[n, g] * codes[n, k], g = k // 32; or with a
    scale per 16 inputs, g = k // 16 (GGUF Q6_K: 6-bit codes less 32, `group` 16).

    No CPU kernel reads 8-bit codes with a scale per block of 32, but two 4-bit planes hold them exactly:
    with c = 16 hi + lo (hi = c >> 4 in -8..7, lo = c & 15 in 0..15), w = 16 d hi + d lo, and each term is
    an affine 4-bit weight (codes hi + 8, scale 16 d, minimum -128 d; codes lo, scale d, minimum 0). The
    int4 kernel runs once per plane and the two outputs add up: the same bytes per weight as the file
    (one), where a dense bf16 copy reads two."""

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K // group] float32

    @property
    def group(self) -> int:
        """Inputs per scale: 32 (Q8_0), or 16 (Q6_K)."""
        return self.codes.shape[1] // self.scales.shape[1]

    @classmethod
    def quantize(cls, weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32) -> Int8Blocks:
        """Round-to-nearest symmetric quantization of a dense [N, K] weight, per block of 32 inputs
        (codes -127..127, Q8_0's rule), the scales rounded to scale_dtype first (float16: as a GGUF
        file stores them, which a8's kernel takes)."""
        w = weight.detach().float()
        blocks = w.view(w.shape[0], -1, GROUP)
        scales = (blocks.abs().amax(-1) / 127).to(scale_dtype).float().clamp_min(torch.finfo(scale_dtype).tiny)
        codes = (blocks / scales[..., None]).round().clamp(-127, 127).to(torch.int8).view_as(w)
        return cls(codes, scales)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales.repeat_interleave(self.group, dim=1)

    def planes(self) -> list[Int4Weights] | None:
        """The two 4-bit planes (None for a scale per 16: the int4 layout's blocks are 32)."""
        if self.group != GROUP:
            return None
        hi, lo = self.codes.to(torch.int16) >> 4, self.codes.to(torch.int16) & 15
        d = self.scales
        return [
            Int4Weights((hi + 8).to(torch.uint8), 16 * d, -128 * d),
            Int4Weights(lo.to(torch.uint8), d, torch.zeros_like(d)),
        ]


# A source's own weights for one parameter, as read from its GGUF file.
SourceWeights = Int4Weights | Int8Blocks


def read_gguf_blocks(path: str | Path, names: list[str]) -> dict[str, SourceWeights]:
    """The Q4_0/Q4_1/Q4_K, Q8_0 and Q6_K tensors among `names` (GGUF tensor names), read as stored: no dequantization."""
    from gguf import GGMLQuantizationType, GGUFReader

    wanted = set(names)
    out: dict[str, SourceWeights] = {}
    for tensor in GGUFReader(path).tensors:
        if tensor.name not in wanted:
            continue
        rows = int(tensor.shape[-1])  # GGUF lists dimensions innermost first
        if tensor.tensor_type == GGMLQuantizationType.Q8_0:
            blocks = np.asarray(tensor.data).reshape(rows, -1, 34)
            d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
            out[tensor.name] = Int8Blocks(torch.from_numpy(codes), torch.from_numpy(d))
            continue
        if tensor.tensor_type == GGMLQuantizationType.Q4_K:
            out[tensor.name] = q4_k_weights(np.asarray(tensor.data).reshape(rows, -1))
            continue
        if tensor.tensor_type == GGMLQuantizationType.Q6_K:
            out[tensor.name] = q6_k_weights(np.asarray(tensor.data).reshape(rows, -1))
            continue
        if tensor.tensor_type == GGMLQuantizationType.Q4_1:
            block_bytes, has_min = 20, True
        elif tensor.tensor_type == GGMLQuantizationType.Q4_0:
            block_bytes, has_min = 18, False
        else:
            continue
        blocks = np.asarray(tensor.data).reshape(rows, -1, block_bytes)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else -8 * d
        packed = blocks[..., block_bytes - 16 :]
        # Byte j of a block holds weight j in its low nibble and weight j + 16 in its high nibble.
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
        out[tensor.name] = Int4Weights(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m))
    return out


Q4_K_BYTES = 144  # a Q4_K super-block: float16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of 4-bit codes


def q4_k_weights(raw: np.ndarray) -> Int4Weights:
    """GGUF Q4_K super-blocks ([rows, super-blocks * 144] bytes) as affine 4-bit blocks of 32: a super-block of 256
    inputs holds float16 d and dmin and, per sub-block j of 32, 6-bit sc_j and m_j, with w = (d sc_j) c - (dmin m_j)
    (ggml's dequantize_row_q4_K, float32). So scale = d sc_j and min = -dmin m_j, each exact in float32 (11 by 6
    significant bits), give the file's weights; float16 cannot hold them, so the kernels take them in float32.
    Codes: sub-block 2i in the low nibbles of bytes 32i..32i+31 of the codes, sub-block 2i+1 in the high ones."""
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    blocks = raw.reshape(-1, Q4_K_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [n, 8] each, 0..63
    scales = d * sc.astype(np.float32)
    mins = -(dmin * m.astype(np.float32))
    packed = blocks[:, 16:].reshape(-1, 4, 1, 32)
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=2)  # [n, 4 pairs, low/high, 32]
    return Int4Weights(
        torch.from_numpy(codes.reshape(rows, -1).copy()),
        torch.from_numpy(scales.reshape(rows, -1).copy()),
        torch.from_numpy(mins.reshape(rows, -1).copy()),
    )


Q6_K_BYTES = 210  # a Q6_K super-block: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales, float16 d


def q6_k_weights(raw: np.ndarray) -> Int8Blocks:
    """GGUF Q6_K super-blocks ([rows, super-blocks * 210] bytes) as 8-bit codes with a scale per 16 inputs: a
    super-block of 256 holds 6-bit codes q (0..63) and, per sub-block j of 16, an int8 scale sc_j, with one
    float16 d: w = (d sc_j) (q - 32) (ggml's dequantize_row_q6_K). d sc_j is exact in float32 (11 by 8
    significant bits) and q - 32 fits int8. Layout per half super-block of 128 inputs: input l (0..31) takes
    the low nibble of ql[l], l + 32 that of ql[l + 32], l + 64 and l + 96 their high nibbles, with bits 0-1,
    2-3, 4-5, 6-7 of qh[l] as the two high bits of each."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, Q6_K_BYTES)
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(-1, 2, 4, 32)  # [n, half, quarter (ql[l], ql[l+32], high of ql[l], of ql[l+32]), l]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    codes = (ql | ((qh & 0x03) << 4)).astype(np.int8) - np.int8(32)
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)  # [n, 16]
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)  # [n, 1]
    return Int8Blocks(
        torch.from_numpy(codes.reshape(rows, -1).copy()), torch.from_numpy((d * sc).reshape(rows, -1).copy())
    )


_LLAMA_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def unpermute_rows(weights: Int4Weights, heads: int) -> Int4Weights:
    """GGUF stores Llama's q and k projections with the rows of each head interleaved for its RoPE
    layout; transformers undoes that (its LlamaTensorProcessor). Rows move whole, blocks and all."""
    n = weights.codes.shape[0]
    order = torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
    return Int4Weights(weights.codes[order], weights.scales[order], weights.mins[order])


def source_int4_weights(gguf_path: str | Path, config) -> dict[str, SourceWeights]:
    """The 4- and 8-bit block weights of a Llama GGUF file, keyed by transformers' parameter names, in its row order.
    Cached on disk: GGUFReader parses the whole tokenizer metadata (tens of seconds on 2 busy cores)."""
    gguf_path = Path(gguf_path)
    stat = gguf_path.stat()
    cached = cache_dir() / "int4" / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{_CACHE_FORMAT}.safetensors"
    if cached.is_file():
        return _load_int4(cached)
    weights = _read_llama_int4(gguf_path, config)
    _save_int4(weights, cached)
    return weights


def _save_int4(weights: dict[str, SourceWeights], path: Path) -> None:
    from safetensors.torch import save_file

    tensors = {}
    for name, w in weights.items():
        if isinstance(w, Int8Blocks):
            tensors[f"{name}.q8codes"], tensors[f"{name}.q8scales"] = w.codes, w.scales
            continue
        tensors[f"{name}.codes"] = w.codes[:, 0::2] | w.codes[:, 1::2] << 4
        tensors[f"{name}.scales"], tensors[f"{name}.mins"] = w.scales, w.mins
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial))
    partial.replace(path)  # atomic: a concurrent reader sees the whole file or none


def _load_int4(path: Path) -> dict[str, SourceWeights]:
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    out: dict[str, SourceWeights] = {}
    for key in tensors:
        if key.endswith(".q8codes"):
            name = key[: -len(".q8codes")]
            out[name] = Int8Blocks(tensors[key], tensors[f"{name}.q8scales"])
        elif key.endswith(".codes"):
            name, pairs = key[: -len(".codes")], tensors[key]
            codes = torch.stack([pairs & 0x0F, pairs >> 4], dim=-1).reshape(pairs.shape[0], -1)
            out[name] = Int4Weights(codes, tensors[f"{name}.scales"], tensors[f"{name}.mins"])
    return out


def _read_llama_int4(gguf_path: Path, config) -> dict[str, SourceWeights]:
    names = {}
    for i in range(config.num_hidden_layers):
        for hf in _LLAMA_GGUF_NAMES:
            names[f"blk.{i}.{_LLAMA_GGUF_NAMES[hf]}.weight"] = f"model.layers.{i}.{hf}.weight"
    names["output.weight"] = "lm_head.weight"
    found = read_gguf_blocks(gguf_path, [*names, "token_embd.weight"])
    embedding = found.pop("token_embd.weight", None)
    if "output.weight" not in found and embedding is not None and getattr(config, "tie_word_embeddings", False):
        found["output.weight"] = embedding  # a tied LM head is the embedding, as stored
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    out = {}
    for gguf, weights in found.items():
        if ".attn_q." in gguf:
            weights = unpermute_rows(weights, heads)
        elif ".attn_k." in gguf:
            weights = unpermute_rows(weights, kv_heads)
        out[names[gguf]] = weights
    return out
