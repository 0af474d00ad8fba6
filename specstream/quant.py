"""Quantized projections for the lean forward, and the kernel for each step's row count.

A projection (y = x @ W^T) is held in up to two forms: packed low-bit weights, read by torch's weight-only
kernels, and a dense copy in the activation dtype. Few rows per call (decoding, a short verification) are
bound by reading the weights, so the packed kernel wins; many rows (prefill, big batches) are bound by
arithmetic, where the dense GEMM wins. Which kernel serves how many rows is measured at start-up for each
weight shape, and the dense copy is kept only where it pays and fits in memory.

Modes: "none" serves the dense weights as loaded; "int4" holds every projection as groupwise 4-bit
weights (group 32); "int8" as per-output-channel 8-bit weights; "auto" holds as int4 exactly the
projections whose source is already 4-bit (a GGUF file's Q4_0/Q4_1 blocks) and the rest dense, so the
weights served are the source's own.

Int4 format. torch's int4 kernels (tinygemm: ``_weight_int4pack_mm_for_cpu`` on CPU,
``_weight_int4pack_mm`` on CUDA) compute each weight in float32 as ``(c - 8) * scale + zero`` from a code
c in 0..15 and a scale and zero per group of 32 inputs, stored in the activation dtype. A GGUF Q4_1 block
holds float16 d and m with ``w = d * c + m`` (Q4_0: ``w = d * (c - 8)``), so ``scale = d`` and
``zero = m + 8 d`` give the file's weights bit for bit whenever the scales are stored in float32 (checked
per block; tests/test_quant.py proves it on the bundled file). In bfloat16, the only dtype with a
vectorized CPU int4 kernel, scale and zero are rounded to bf16's 8-bit significand: the 4-bit codes stay
the file's, the block scales lose 3 bits.

On CPU, where specstream's own kernels build (cpu_kernels.py), they serve the blocks instead, with the
file's weights exactly: 4-bit blocks by q4_linear (PackedQ4; faster than torch's at one row, 1.5x at
nine), 8-bit blocks (GGUF Q8_0: int8 codes, a scale per 32) by q8_linear, one read of the file's bytes.
Elsewhere (CUDA, no compiler) torch's int4 kernel serves both, 8-bit blocks as two 4-bit planes
(Int8Blocks.planes).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specstream.config import QUANTIZATION_MODES

GROUP = 32
# Rows per call at which the kernels are compared; the step sizes of decoding, verification and prefill.
_PROBE_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)
# A dense copy is kept only while all copies together take at most this share of the free memory.
_DENSE_MEMORY_SHARE = 0.25
# Bumped when the layout of the on-disk int4 cache changes.
_CACHE_FORMAT = 2

log = logging.getLogger("specstream.quant")


# --------------------------------------------------------------------------- int4 weights
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
    """Symmetric 8-bit weights, GGUF Q8_0's form: w[n, k] = scales[n, g] * codes[n, k], g = k // 32.

    No CPU kernel reads 8-bit codes with a scale per block of 32, but two 4-bit planes hold them exactly:
    with c = 16 hi + lo (hi = c >> 4 in -8..7, lo = c & 15 in 0..15), w = 16 d hi + d lo, and each term is
    an affine 4-bit weight (codes hi + 8, scale 16 d, minimum -128 d; codes lo, scale d, minimum 0). The
    int4 kernel runs once per plane and the two outputs add up: the same bytes per weight as the file
    (one), where a dense bf16 copy reads two."""

    codes: torch.Tensor  # [N, K] int8
    scales: torch.Tensor  # [N, K // 32] float32

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Blocks:
        """Round-to-nearest symmetric quantization of a dense [N, K] weight, per block of 32 inputs
        (codes -127..127, Q8_0's rule)."""
        w = weight.detach().float()
        blocks = w.view(w.shape[0], -1, GROUP)
        scales = (blocks.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        codes = (blocks / scales[..., None]).round().clamp(-127, 127).to(torch.int8).view_as(w)
        return cls(codes, scales)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales.repeat_interleave(GROUP, dim=1)

    def planes(self) -> list[Int4Weights]:
        hi, lo = self.codes.to(torch.int16) >> 4, self.codes.to(torch.int16) & 15
        d = self.scales
        return [
            Int4Weights((hi + 8).to(torch.uint8), 16 * d, -128 * d),
            Int4Weights(lo.to(torch.uint8), d, torch.zeros_like(d)),
        ]


# A source's own weights for one parameter, as read from its GGUF file.
SourceWeights = Int4Weights | Int8Blocks


def read_gguf_blocks(path: str | Path, names: list[str]) -> dict[str, SourceWeights]:
    """The Q4_0/Q4_1 and Q8_0 tensors among `names` (GGUF tensor names), read as stored: no dequantization."""
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


_LLAMA_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str | None:
    """The GGUF tensor name of a Llama parameter (model.layers.3.mlp.up_proj.weight -> blk.3.ffn_up.weight)."""
    if hf_name == "lm_head.weight":
        return "output.weight"
    match = re.fullmatch(r"model\.layers\.(\d+)\.(\w+\.\w+)\.weight", hf_name)
    if match and match.group(2) in _LLAMA_GGUF_NAMES:
        return f"blk.{match.group(1)}.{_LLAMA_GGUF_NAMES[match.group(2)]}.weight"
    return None


def unpermute_rows(weights: Int4Weights, heads: int) -> Int4Weights:
    """GGUF stores Llama's q and k projections with the rows of each head interleaved for its RoPE
    layout; transformers undoes that (its LlamaTensorProcessor). Rows move whole, blocks and all."""
    n = weights.codes.shape[0]
    order = torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
    return Int4Weights(weights.codes[order], weights.scales[order], weights.mins[order])


# ----------------------------------------------------------------------------- kernels
# A projection's kernel as plain data, (kind, *tensors): what project() runs, and what a compiled forward
# takes as an argument (fast_llama.py), so one traced graph serves every layer.
Kernel = tuple


def project(kernel: Kernel, x: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T with W held as kernel says: "dense" (weight), "int4" (torch's packed int4 layout and
    the scale/zero pairs), "int4x2" (two such planes, summed: 8-bit blocks), "q4" (4-bit blocks in
    PackedQ4's layout) and "q8" (8-bit blocks: codes and a float32 scale per 32), specstream's kernels,
    "int8" (codes and per-channel scales)."""
    kind, a, b, *planes = kernel
    if kind == "dense":
        return F.linear(x, a)
    if kind == "q8":
        return torch.ops.specstream.q8_linear(x, a, b)
    if kind == "q4":
        return torch.ops.specstream.q4_linear(x, a, b, planes[0])
    if kind == "int8":
        return torch.ops.aten._weight_int8pack_mm(x, a, b)
    y = _int4_mm(x, a, b)
    if kind == "int4x2":
        y = y + _int4_mm(x, *planes)
    return y


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, scale_zeros)


class PackedInt4:
    """Int4 weights in the layout of torch's int4 weight-only kernel for their device: one plane, or the
    two planes of 8-bit blocks (Int8Blocks), whose products add up."""

    bits = 4

    def __init__(self, weights: Int4Weights | list[Int4Weights], dtype: torch.dtype, device: torch.device) -> None:
        planes = weights if isinstance(weights, list) else [weights]
        packed = [self._pack(p, dtype, device) for p in planes]
        self.kernel: Kernel = ("int4" if len(packed) == 1 else "int4x2", *(t for plane in packed for t in plane))
        self.nbytes = sum(t.nbytes for plane in packed for t in plane)
        self.shape = tuple(planes[0].codes.shape)

    @staticmethod
    def _pack(weights: Int4Weights, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        codes = weights.codes.to(device)
        zeros = weights.mins + 8 * weights.scales
        # [K // 32, N, 2]: scale and zero of each group and output, in the activation dtype.
        scale_zeros = torch.stack([weights.scales.t(), zeros.t()], dim=-1).to(dtype).contiguous().to(device)
        if device.type == "cpu":
            return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1), scale_zeros
        # CUDA tinygemm (untested here: no GPU on the development machine)
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).contiguous()
        inner_k_tiles = next(t for t in (8, 4, 2) if codes.shape[1] % (t * 16) == 0)
        return torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles), scale_zeros

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.kernel, x)


def _effective_int4(weights: Int4Weights | list[Int4Weights], dtype: torch.dtype) -> torch.Tensor:
    """float32 [N, K]: the weights the int4 kernel multiplies by, (c - 8) * scale + zero, with scale and
    zero as stored in `dtype` (summed over the planes of 8-bit blocks)."""
    if isinstance(weights, list):
        return sum(_effective_int4(p, dtype) for p in weights)
    scales = weights.scales.to(dtype).float()
    zeros = (weights.mins + 8 * weights.scales).to(dtype).float()
    codes = weights.codes.float() - 8
    # Scales come from float16 (GGUF's, or Int4Weights.quantize's), so (c - 8) * scale is exact in float32
    # and this rounds once, as the kernel's fused multiply-add does.
    return codes * scales.repeat_interleave(GROUP, 1) + zeros.repeat_interleave(GROUP, 1)


class PackedQ4:
    """4-bit block weights (Int4Weights) for specstream's CPU kernel (cpu_kernels.q4_linear), in its layout:
    tiles of 16 outputs, two inputs' codes per byte, float16 d and m. The weights it multiplies are
    d * c + m in float32, the file's exactly (torch's int4 kernel rounds d and m to bf16 in a bf16 model).
    `fits` says whether a weight can take it: 16 | N, and d and m exact in float16 (a GGUF file's are)."""

    bits = 4

    def __init__(self, weights: Int4Weights, device: torch.device) -> None:
        n, k = weights.codes.shape
        c = weights.codes.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
        self.codes = (c[..., 0] | c[..., 1] << 4).contiguous().to(device)
        self.scales, self.mins = (
            t.view(n // 16, 16, k // GROUP).permute(0, 2, 1).half().contiguous().to(device) for t in (weights.scales, weights.mins)
        )
        self.shape = (n, k)
        self.kernel: Kernel = ("q4", self.codes, self.scales, self.mins)
        self.nbytes = self.codes.nbytes + self.scales.nbytes + self.mins.nbytes

    @staticmethod
    def fits(weights: Int4Weights) -> bool:
        n, k = weights.codes.shape
        exact = all(torch.equal(t.half().float(), t) for t in (weights.scales, weights.mins))
        return n % 16 == 0 and k % GROUP == 0 and exact

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.kernel, x)


class PackedInt8Blocks:
    """8-bit block weights (Int8Blocks) as stored, for specstream's CPU kernel (cpu_kernels.q8_linear)."""

    bits = 8

    def __init__(self, weights: Int8Blocks, device: torch.device) -> None:
        self.codes = weights.codes.to(torch.int8).contiguous().to(device)
        self.scales = weights.scales.float().contiguous().to(device)
        self.shape = tuple(self.codes.shape)
        self.kernel: Kernel = ("q8", self.codes, self.scales)
        self.nbytes = self.codes.nbytes + self.scales.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.kernel, x)


class PackedInt8:
    """Per-output-channel symmetric int8 weights for torch's int8 weight-only kernel."""

    bits = 8

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
        w = weight.float()
        scales = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        self.codes = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8).to(device)
        self.scales = scales.to(dtype).to(device)
        self.shape = tuple(weight.shape)
        self.kernel: Kernel = ("int8", self.codes, self.scales)
        self.nbytes = self.codes.nbytes + self.scales.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.kernel, x)


class Linear:
    """One projection: the packed kernel for calls of at most max_packed_rows rows, the dense copy above."""

    def __init__(
        self,
        names: list[str],
        dense: torch.Tensor | None,
        packed: PackedInt4 | PackedQ4 | PackedInt8 | PackedInt8Blocks | None = None,
    ) -> None:
        self.names = names  # the model parameters this projection serves, fused along N in this order
        self.dense = dense
        self.packed = packed
        self.max_packed_rows = 0 if packed is None else 1 << 30

    def kernel_for(self, rows: int) -> Kernel:
        """The kernel serving a call of this many rows."""
        if self.packed is not None and rows <= self.max_packed_rows:
            return self.packed.kernel
        return ("dense", self.dense, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.kernel_for(x.shape[0]), x)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape if self.packed is not None else tuple(self.dense.shape)

    def nbytes(self) -> int:
        return (0 if self.dense is None else self.dense.nbytes) + (0 if self.packed is None else self.packed.nbytes)


# ------------------------------------------------------------------------------ building
class LinearFactory:
    """Builds the lean forward's projections for one quantization mode (FastLlama's `linear` argument).

    `source_int4` maps parameter names to the source's own low-bit weights (from its GGUF file: 4-bit
    blocks, and 8-bit blocks served as two 4-bit planes)."""

    def __init__(
        self,
        mode: str,
        dtype: torch.dtype,
        device: torch.device,
        source_int4: dict[str, SourceWeights] | None = None,
        shared: tuple[torch.Tensor, ...] = (),
    ) -> None:
        if mode not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {mode!r}")
        self.mode = mode
        self.dtype = dtype
        self.device = torch.device(device)
        self.source_int4 = source_int4 or {}
        # Tensors that must keep their values (a tied input embedding): a projection sharing their storage
        # gets its own dense copy before quantization rewrites it.
        self._shared = {t.untyped_storage().data_ptr() for t in shared}
        self.built: list[Linear] = []

    def __call__(self, names: list[str], weight: torch.Tensor) -> Linear:
        """A projection for `weight` (dense, [N, K]; several parameters fused along N, named in order).
        The dense tensor is overwritten with what the packed kernel computes, so both kernels (and the
        model's own modules, which share it) serve one weight."""
        linear = self._build(names, weight)
        self.built.append(linear)
        return linear

    def _build(self, names: list[str], weight: torch.Tensor) -> Linear:
        source = [self.source_int4.get(n) for n in names]
        q8 = self.mode in ("auto", "int4") and len(source) == 1 and isinstance(source[0], Int8Blocks) and self._cpu_kernels()
        int4 = None if q8 else _source_planes(source)  # (8-bit blocks as planes: only where q8_linear does not serve)
        groupable = weight.shape[1] % GROUP == 0 and weight.shape[0] % 16 == 0
        if q8:
            packed = PackedInt8Blocks(source[0], self.device)
            effective = source[0].dequantize()
        elif self.mode == "int4" and groupable or self.mode == "auto" and int4 is not None:
            int4 = int4 or Int4Weights.quantize(weight)
            if isinstance(int4, Int4Weights) and PackedQ4.fits(int4) and self._cpu_kernels():
                packed, effective = PackedQ4(int4, self.device), int4.dequantize()
            else:
                packed, effective = PackedInt4(int4, self.dtype, self.device), _effective_int4(int4, self.dtype)
        elif self.mode == "int8":
            packed = PackedInt8(weight, self.dtype, self.device)
            effective = packed.codes.float() * packed.scales.float()[:, None]
        else:
            return Linear(names, weight)
        if weight.untyped_storage().data_ptr() in self._shared:
            weight = torch.empty_like(weight)
        weight.copy_(effective)
        return Linear(names, weight, packed)

    def _cpu_kernels(self) -> bool:
        """Whether specstream's block kernels serve here (CPU, and they built)."""
        from specstream import cpu_kernels

        return self.device.type == "cpu" and cpu_kernels.load()

    def release_unused(self, model: torch.nn.Module) -> None:
        """Free the model's dense parameters behind projections that no longer keep a dense copy."""
        for lin in self.built:
            if lin.dense is not None:
                continue
            for name in lin.names:
                param = model.get_parameter(name)
                if param.untyped_storage().data_ptr() not in self._shared:
                    param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    @property
    def quantized(self) -> list[Linear]:
        return [lin for lin in self.built if lin.packed is not None]

    @property
    def kernel_kinds(self) -> list[str]:
        """The packed kernels serving (quant.project's kinds): start-up timings depend on them."""
        return sorted({lin.packed.kernel[0] for lin in self.quantized})


def _source_planes(source: list[SourceWeights | None]) -> Int4Weights | list[Int4Weights] | None:
    """The int4 form of the source weights of one projection (several parameters fused along N): one
    plane for 4-bit blocks, two for one 8-bit tensor; None where a part has no source blocks, or mixes
    4- and 8-bit ones."""
    if not source or any(s is None for s in source):
        return None
    if all(isinstance(s, Int4Weights) for s in source):
        return Int4Weights.cat(source)
    if len(source) == 1:
        return source[0].planes()
    return None


def source_int4_weights(gguf_path: str | Path, config) -> dict[str, SourceWeights]:
    """The 4- and 8-bit block weights of a Llama GGUF file, keyed by transformers' parameter names, in its row order.
    Cached on disk: GGUFReader parses the whole tokenizer metadata (tens of seconds on 2 busy cores)."""
    from specstream.models import cache_dir

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


# ------------------------------------------------------------------------ kernel choice
@dataclass
class KernelChoice:
    shape: tuple[int, int]
    max_packed_rows: int
    keeps_dense: bool


def _faster_packed(group: list[Linear], x: torch.Tensor, repeats: int = 3) -> bool:
    """Whether the packed kernel beats the dense GEMM on x, for a group of projections of one shape.

    Each timing runs x through every projection of the group in turn, as a forward does: a weight is read
    from memory, not from the cache a repeated call on one weight would find it in (a 3072x576 bf16 copy
    fills a core's L2, and timed hot it looks up to 2.5x faster than it serves in a forward). The fastest
    of interleaved runs counts, since noise from other processes only ever adds time, and interleaving
    spreads it over both alike."""

    def packed() -> None:
        for lin in group:
            lin.packed(x)

    def dense() -> None:
        for lin in group:
            F.linear(x, lin.dense)

    group[0].packed(x), F.linear(x, group[0].dense)
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, fn in enumerate((packed, dense)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0] <= best[1]


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def choose_kernels(
    linears: list[Linear],
    max_rows: int,
    dtype: torch.dtype,
    device: torch.device,
    timed: bool = True,
    routes: dict[str, int] | None = None,
) -> list[KernelChoice]:
    """For each weight shape, time the packed kernel against the dense GEMM at growing row counts (the
    fastest of a few runs, interleaved) and route to the packed kernel up to the last count where it wins.
    A dense copy is dropped where it never wins or does not fit in memory. timed=False routes every call
    to the packed kernel without timing anything, so the route, and the rounding, is the same on every
    start (invariant mode: timings differ between starts, and so would the kernels chosen). routes maps
    "NxK" to a limit timed by an earlier start (load_routes): those shapes are not timed again."""
    by_shape: dict[tuple[int, int], list[Linear]] = {}
    for lin in linears:
        if lin.packed is not None:
            by_shape.setdefault(lin.shape, []).append(lin)
    probes = [r for r in _PROBE_ROWS if r <= max_rows] or [1]
    budget = _free_memory(device) * _DENSE_MEMORY_SHARE
    choices = []
    for shape, group in sorted(by_shape.items(), key=lambda item: -len(item[1]) * item[0][0] * item[0][1]):
        saved = (routes or {}).get(_shape_key(shape))
        limit = 0 if timed else probes[-1]
        for rows in probes if timed and saved is None else []:
            if not _faster_packed(group, torch.randn(rows, shape[1], dtype=dtype, device=device)):
                break
            limit = rows
        if timed and saved is not None:
            limit = min(saved, probes[-1])
        dense_bytes = sum(lin.dense.nbytes for lin in group)
        keep = limit < probes[-1] and (limit == 0 or dense_bytes <= budget)
        if keep:
            budget -= dense_bytes
        else:
            limit = 1 << 30
        for lin in group:
            lin.max_packed_rows = limit
            if limit == 0:
                lin.packed = None  # the packed kernel never wins here (e.g. torch's scalar float32 int4 path)
            if not keep:
                lin.dense = None
        choices.append(KernelChoice(shape, limit, keep))
    return choices


# ------------------------------------------------------------------------------- engine
def make_factory(
    mode: str, model, gguf_path: str | Path | None, dtype: torch.dtype, device: torch.device
) -> LinearFactory | None:
    """The projections' factory for a model loaded from a GGUF file at gguf_path (or None), or None
    when every projection stays dense as loaded ("none", or "auto" with no 4-bit weights in the source)."""
    if mode == "none":
        return None
    if mode == "auto" and device.type != "cpu":
        return None  # the CUDA int4 kernel path is untested here: auto stays dense on GPUs
    text = model.config.get_text_config()
    source = source_int4_weights(gguf_path, text) if gguf_path and mode in ("auto", "int4") else {}
    if mode == "auto" and not source:
        return None
    return LinearFactory(mode, dtype, device, source, shared=(model.get_input_embeddings().weight,))


def settle(
    factory: LinearFactory, model, max_rows: int, timed: bool = True, routes_file: Path | None = None
) -> list[KernelChoice]:
    """Measure the kernels for each shape (see choose_kernels for timed), then free the dense weights no
    projection reads any more. With routes_file, the routes an earlier start timed are read from it (and
    the ones timed now written to it): a restart skips the timing and serves the same kernels, so the
    same bf16 rounding, as the start before it."""
    routes = load_routes(routes_file) if timed and routes_file else None
    choices = choose_kernels(factory.quantized, max_rows, factory.dtype, factory.device, timed, routes)
    factory.release_unused(model)
    if timed and routes_file and routes is None:
        save_routes(routes_file, {_shape_key(c.shape): c.max_packed_rows for c in choices})
    return choices


def _shape_key(shape: tuple[int, int]) -> str:
    """A weight shape as the routes file names it: "NxK"."""
    return f"{shape[0]}x{shape[1]}"


def load_routes(path: Path) -> dict[str, int] | None:
    try:
        routes = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(routes, dict) and all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in routes.items())
    return routes if ok else None


def save_routes(path: Path, routes: dict[str, int]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(routes))
        partial.replace(path)
    except OSError as exc:
        log.warning("could not keep the kernel routes in %s: %s", path, exc)


def describe(factory: LinearFactory, choices: list[KernelChoice]) -> str:
    bits = {lin.packed.bits for lin in factory.built if lin.packed is not None}
    packed = sum(1 for lin in factory.built if lin.packed is not None)
    routes = ", ".join(
        f"{n}x{k}: " + ("dense only" if c.max_packed_rows == 0 else "packed only" if not c.keeps_dense
                         else f"packed <= {c.max_packed_rows} rows")
        for (n, k), c in ((c.shape, c) for c in choices)
    )
    size = sum(lin.nbytes() for lin in factory.built) / 2**20
    return (
        f"{factory.mode}: {packed} of {len(factory.built)} projections int{'/'.join(map(str, sorted(bits)))} "
        f"(kernels {', '.join(factory.kernel_kinds)}; {routes}); projections hold {size:.0f} MiB"
    )


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
