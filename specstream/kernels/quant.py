"""Quantized projections for the lean forward: each held in up to two forms, and the kernel for a call's
row count.

A projection (y = x @ W^T) is held as packed low-bit weights, read by a weight-only kernel, and/or a dense
copy in the activation dtype. Few rows per call (decoding, a short verification) are bound by reading the
weights, so the packed kernel wins; many rows (prefill, big batches) are bound by arithmetic, where the
dense GEMM wins. Which kernel serves how many rows is measured at start-up for each weight shape
(routes.py), and the dense copy is kept only where it pays and fits in memory.

Modes: "none" serves the dense weights as loaded; "int4" holds every projection as groupwise 4-bit
weights (group 32); "int8" as per-output-channel 8-bit weights; "a8" holds a GGUF file's 4- and 8-bit
blocks as they are and multiplies them by x rounded to 8-bit blocks, in integers (PackedA8,
csrc/a8_linear.cpp; other sources' weights are rounded to 8-bit blocks first; asked for, not the default:
see the README); "auto" holds as int4 exactly the projections whose source is already 4-bit (a GGUF
file's Q4_0/Q4_1 blocks, weights.py) and the rest dense, so the weights served are the source's own.

On CPU, where specstream's own kernels build (cpu.py), they serve the blocks instead, with the file's
weights exactly: 4-bit blocks by q4_linear (PackedQ4), 8-bit blocks (GGUF Q8_0: int8 codes, a scale per
32) by q8_linear, one read of the file's bytes. Elsewhere (CUDA, no compiler) torch's int4 kernel serves
both, 8-bit blocks as two 4-bit planes (Int8Blocks.planes).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import torch.nn.functional as F

from specstream.config import QUANTIZATION_MODES
from specstream.kernels import kept_weights as kept_weights_module
from specstream.kernels import weights as weights_module
from specstream.kernels.kept_weights import KeptWeights
from specstream.kernels.weights import GROUP, Int4Weights, Int8Blocks, SourceWeights, source_int4_weights


# A projection's kernel as plain data, (kind, *tensors): what project() runs, and what a compiled forward
# takes as an argument (model/fast_llama.py), so one traced graph serves every layer.
Kernel = tuple

# The block kernels' path that computes each row alone (q4_linear, q8_linear: one path and one summation order at
# every row count), appended to a "q4" or "q8" kernel by Linear.rows_alone.
ROWS_ALONE = -2


def project(kernel: Kernel, x: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T with W held as kernel says: "dense" (weight), "int4" (torch's packed int4 layout and
    the scale/zero pairs), "int4x2" (two such planes, summed: 8-bit blocks), "q4" (4-bit blocks in
    PackedQ4's layout) and "q8" (8-bit blocks: codes and a float32 scale per 32), specstream's kernels,
    "int8" (codes and per-channel scales)."""
    kind, a, b, *planes = kernel
    if kind == "dense":
        return F.linear(x.to(a.dtype), a)  # (a residual stream wider than the weights: FastLlama's stream_dtype)
    if kind == "q8":
        return torch.ops.specstream.q8_linear(x, a, b, *planes)  # (planes: [] or [ROWS_ALONE])
    if kind == "q4":
        return torch.ops.specstream.q4_linear(x, a, b, *planes)  # (mins, and ROWS_ALONE where asked)
    if kind == "a8":
        return torch.ops.specstream.a8_linear(x, a, b, planes[0])
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


def block_scale_dtype(*parts: torch.Tensor) -> torch.dtype:
    """The dtype a packed layout keeps block scales and minimums in: float16 where it holds them exactly (a GGUF
    file's Q4_0/Q4_1/Q8_0 d and m are float16), else float32 (Q4_K's d and m: a super-block's float16 d times a
    6-bit sub-block scale, up to 17 significant bits). Either way the weights multiplied are the file's."""
    exact = all(torch.equal(t.float().half().float(), t.float()) for t in parts)
    return torch.float16 if exact else torch.float32


class PackedQ4:
    """4-bit block weights (Int4Weights) for specstream's CPU kernel (cpu_kernels.q4_linear), in its layout:
    tiles of 16 outputs, two inputs' codes per byte, d and m in float16 (float32 where float16 cannot hold them:
    block_scale_dtype). The weights it multiplies are d * c + m in float32, the file's exactly (torch's int4
    kernel rounds d and m to bf16 in a bf16 model). `fits` says whether a weight can take it: 16 | N, 32 | K."""

    bits = 4

    def __init__(self, weights: Int4Weights, device: torch.device) -> None:
        n, k = weights.codes.shape
        c = weights.codes.view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
        self.codes = (c[..., 0] | c[..., 1] << 4).contiguous().to(device)
        dtype = block_scale_dtype(weights.scales, weights.mins)
        self.scales, self.mins = (
            t.view(n // 16, 16, k // GROUP).permute(0, 2, 1).to(dtype).contiguous().to(device) for t in (weights.scales, weights.mins)
        )
        self.shape = (n, k)
        self.kernel: Kernel = ("q4", self.codes, self.scales, self.mins)
        self.nbytes = self.codes.nbytes + self.scales.nbytes + self.mins.nbytes

    @staticmethod
    def fits(weights: Int4Weights) -> bool:
        n, k = weights.codes.shape
        return n % 16 == 0 and k % GROUP == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.kernel, x)


class PackedInt8Blocks:
    """8-bit block weights (Int8Blocks), the file's codes and scales (a scale per 32 inputs, Q8_0, or per 16, Q6_K),
    in the layout of specstream's CPU kernel (csrc/q8_linear.cpp): tiles of 16 outputs, each output's inputs 2j and
    2j + 1 side by side."""

    bits = 8

    def __init__(self, weights: Int8Blocks, device: torch.device) -> None:
        n, k = weights.codes.shape
        codes = weights.codes.to(torch.int8).view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
        self.codes = codes.reshape(n // 16, k // 2, 32).contiguous().to(device)
        blocks = k // weights.group  # a scale per 32 inputs (Q8_0) or per 16 (Q6_K)
        self.scales = weights.scales.float().view(n // 16, 16, blocks).transpose(1, 2).contiguous().to(device)
        self.shape = (n, k)
        self.kernel: Kernel = ("q8", self.codes, self.scales)
        self.nbytes = self.codes.nbytes + self.scales.nbytes

    @staticmethod
    def fits(weights: Int8Blocks) -> bool:
        """Whether the kernel's layout holds these weights: whole tiles of 16 outputs, whole blocks of 32."""
        n, k = weights.codes.shape
        return n % 16 == 0 and k % GROUP == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.kernel, x)


class PackedA8:
    """GGUF block weights (4-bit Int4Weights, or 8-bit Int8Blocks) for specstream's a8_linear kernel, which
    quantizes x to 8-bit blocks and sums the products as integers (csrc/a8_linear.cpp gives the layout and the
    numerics): tiles of 16 outputs, blocks of 32 inputs in VNNI order, d (and m for 4 bits) in float16, or float32
    where float16 cannot hold them (block_scale_dtype: Q4_K). Its outputs differ slightly from the dense weights'
    (x is rounded to 8 bits) but do not depend on the other rows of a call. `fits`: 16 | N, 32 | K."""

    def __init__(self, weights: Int4Weights | Int8Blocks, device: torch.device) -> None:
        n, k = weights.codes.shape
        tiles, blocks = n // 16, k // GROUP
        if isinstance(weights, Int4Weights):
            self.bits = 4
            # [tile, i, block, j] -> per block: vector v holds inputs 4v..4v+3 (low nibble) and 16+4v.. (high)
            c = weights.codes.view(tiles, 16, blocks, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # [t, g, v, i, b, half]
            codes = c[..., 0] | c[..., 1] << 4
            dtype = block_scale_dtype(weights.scales, weights.mins)
            self.mins = weights.mins.view(tiles, 16, blocks).permute(0, 2, 1).to(dtype).contiguous().to(device)
        else:
            self.bits = 8
            c = (weights.codes.to(torch.int16) + 128).to(torch.uint8).view(tiles, 16, blocks, 8, 4)
            codes = c.permute(0, 2, 3, 1, 4)  # [t, g, u, i, b]
            dtype = block_scale_dtype(weights.scales)
            self.mins = torch.empty(0, dtype=dtype, device=device)
        self.codes = codes.reshape(tiles, blocks, -1).contiguous().to(device)
        scale_blocks = weights.scales.shape[1]  # K / 32, or K / 16 for 8-bit codes with a scale per 16 (Q6_K)
        self.scales = weights.scales.float().view(tiles, 16, scale_blocks).permute(0, 2, 1).to(dtype).contiguous().to(device)
        self.shape = (n, k)
        self.kernel: Kernel = ("a8", self.codes, self.scales, self.mins)
        self.nbytes = self.codes.nbytes + self.scales.nbytes + self.mins.nbytes

    @staticmethod
    def fits(weights: Int4Weights | Int8Blocks) -> bool:
        n, k = weights.codes.shape
        return n % 16 == 0 and k % GROUP == 0

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


class KeptPacked:
    """A projection's packed weights as an earlier start built them, loaded from its kept file (kept_weights.py)."""

    def __init__(self, kernel: Kernel, shape: tuple[int, int], bits: int) -> None:
        self.kernel = kernel
        self.shape = shape
        self.bits = bits
        self.nbytes = sum(t.nbytes for t in kernel[1:] if isinstance(t, torch.Tensor))

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

    def rows_alone(self) -> bool:
        """Have every call compute each row as the row alone would be computed: the same bits at any row count,
        so a token's output does not depend on what else its step held. True where the packed kernel serves
        every call and can: a8's (integer sums: always), or q4/q8 asked for ROWS_ALONE. False where a dense
        GEMM or torch's int4 kernel serves some call: their rounding follows the row count."""
        if self.packed is None or self.max_packed_rows < 1 << 30:
            return False
        kind = self.packed.kernel[0]
        if kind in ("q4", "q8") and not isinstance(self.packed.kernel[-1], int):
            self.packed.kernel = (*self.packed.kernel, ROWS_ALONE)
        return kind in ("q4", "q8", "a8")

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape if self.packed is not None else tuple(self.dense.shape)

    def nbytes(self) -> int:
        return (0 if self.dense is None else self.dense.nbytes) + (0 if self.packed is None else self.packed.nbytes)


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
        kept: KeptWeights | None = None,
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
        self.kept = kept  # projections an earlier start built (kept_weights.py); None: not kept

    def __call__(self, names: list[str], weight: torch.Tensor) -> Linear:
        """A projection for `weight` (dense, [N, K]; several parameters fused along N, named in order).
        The dense tensor is overwritten with what the packed kernel computes, so both kernels (and the
        model's own modules, which share it) serve one weight."""
        linear = self._build(names, weight)
        self.built.append(linear)
        return linear

    def _build(self, names: list[str], weight: torch.Tensor) -> Linear:
        if self.kept is not None and self.kept.found and (hit := self.kept.lookup(names)) is not None:
            kernel, shape, bits, effective = hit
            if kernel is None:
                return Linear(names, weight)
            return self._holding(names, weight, KeptPacked(kernel, shape, bits), effective)
        source = [self.source_int4.get(n) for n in names]
        if self.mode == "a8":
            return self._build_a8(names, weight, source)
        q8 = self.mode in ("auto", "int4") and len(source) == 1 and isinstance(source[0], Int8Blocks)
        q8 = q8 and PackedInt8Blocks.fits(source[0]) and self._cpu_kernels()
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
        return self._holding(names, weight, packed, effective)

    def _build_a8(self, names: list[str], weight: torch.Tensor, source: list[SourceWeights | None]) -> Linear:
        """a8: the source's blocks (4-bit, or one 8-bit tensor) as they are; without a GGUF source, the dense
        weight rounded to 8-bit blocks (Q8_0's rule); dense where neither fits (mixed 4- and 8-bit parts)."""
        if not self._cpu_kernels():
            return Linear(names, weight)
        blocks: Int4Weights | Int8Blocks | None = None
        if source and all(isinstance(s, Int4Weights) for s in source):
            blocks = Int4Weights.cat(source)
        elif len(source) == 1 and isinstance(source[0], Int8Blocks):
            blocks = source[0]
        elif not self.source_int4 and weight.shape[1] % GROUP == 0 and weight.shape[0] % 16 == 0:
            blocks = Int8Blocks.quantize(weight, torch.float16)
        if blocks is None or not PackedA8.fits(blocks):
            return Linear(names, weight)
        return self._holding(names, weight, PackedA8(blocks, self.device), blocks.dequantize())

    def _holding(self, names: list[str], weight: torch.Tensor, packed, effective: torch.Tensor) -> Linear:
        if weight.untyped_storage().data_ptr() in self._shared:
            if torch.equal(weight, effective.to(weight.dtype)):
                return Linear(names, weight, packed)  # it holds the packed weights' values already: no copy
            weight = torch.empty_like(weight)
        weight.copy_(effective)
        return Linear(names, weight, packed)

    def keep(self) -> None:
        """Keep what was built for the next start, unless it was loaded from there (call before routes
        release dense copies)."""
        if self.kept is not None and not self.kept.found:
            self.kept.save(self.built)
        if self.kept is not None:
            self.kept.close()

    def _cpu_kernels(self) -> bool:
        """Whether specstream's block kernels serve here (CPU, and they built)."""
        from specstream.kernels import cpu as cpu_kernels

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


def a8_serves(device: torch.device) -> bool:
    """Whether a8 (8-bit activation blocks, integer dot products) has a fast path here: on CPU, with
    specstream's kernels built, where the CPU has an integer dot-product instruction (AVX512-VNNI, AMX-INT8
    or AVX-VNNI). With AVX2 alone a8 still runs, by VPMADDUBSW, but was never measured against q4_linear."""
    from specstream.kernels import cpu as cpu_kernels

    if torch.device(device).type != "cpu" or not cpu_kernels.load():
        return False
    paths = list(torch.ops.specstream.a8_paths())
    return any(p in paths[: paths.index(-1)] for p in (2, 3)) or paths[-1] == 1


def _source_planes(source: list[SourceWeights | None]) -> Int4Weights | list[Int4Weights] | None:
    """The int4 form of the source weights of one projection (several parameters fused along N): one
    plane for 4-bit blocks, two for one 8-bit tensor; None where a part has no source blocks, or mixes
    4- and 8-bit ones, or for 8-bit codes with a scale per 16 (Q6_K: the int4 layout's blocks are 32)."""
    if not source or any(s is None for s in source):
        return None
    if all(isinstance(s, Int4Weights) for s in source):
        return Int4Weights.cat(source)
    if len(source) == 1:
        return source[0].planes()
    return None


def make_factory(
    mode: str, model, gguf_path: str | Path | None, dtype: torch.dtype, device: torch.device, kept_path: Path | None = None
) -> LinearFactory | None:
    """The projections' factory for a model loaded from a GGUF file at gguf_path (or None), or None
    when every projection stays dense as loaded ("none", or "auto" with no 4-bit weights in the source).
    kept_path: where the projections built for exactly this model and configuration are kept between
    starts (kept_weights.py; the caller keys it); found there, the source's blocks are not read at all."""
    if mode == "none":
        return None
    if mode == "auto" and device.type != "cpu":
        return None  # the CUDA int4 kernel path is untested here: auto stays dense on GPUs
    kept = KeptWeights(kept_path, torch.device(device)) if kept_path is not None else None
    shared = (model.get_input_embeddings().weight,)
    if kept is not None and kept.found:
        return LinearFactory(mode, dtype, device, shared=shared, kept=kept)
    text = model.config.get_text_config()
    source = source_int4_weights(gguf_path, text) if gguf_path and mode in ("auto", "int4", "a8") else {}
    if mode == "auto" and not source:
        return None
    return LinearFactory(mode, dtype, device, source, shared=shared, kept=kept)


def kept_key(device: torch.device) -> list:
    """What kept projections depend on besides the model, dtype and device (the caller's key): whether
    specstream's kernels serve, and the code that builds and reads them."""
    from specstream.kernels import cpu as cpu_kernels

    h = hashlib.sha256()
    for module in (__file__, weights_module.__file__, kept_weights_module.__file__):
        h.update(Path(module).read_bytes())
    return [torch.device(device).type == "cpu" and cpu_kernels.load(), h.hexdigest()[:16]]
