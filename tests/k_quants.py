"""GGUF K-quant blocks written from float weights, for tests: Q4_K by plain round-to-nearest (llama.cpp searches
its scales; any valid block serves a reader's test), and a copy of a GGUF file with some tensors stored as Q4_K."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[rows, k] float32 (k a multiple of 256) -> [rows, k / 256 * 144] uint8 Q4_K super-blocks: per sub-block of
    32 a scale (max - min) / 15 and a minimum (at most 0), each as a 6-bit multiple of the super-block's float16
    d and dmin; codes rounded to the nearest."""
    rows, k = w.shape
    sub = w.astype(np.float32).reshape(-1, 8, 32)  # [super-blocks, sub-block, 32]
    low = np.minimum(sub.min(-1), 0.0)
    scale = np.maximum((sub.max(-1) - low) / 15, 1e-12)
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (-low.min(-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.rint(scale / np.maximum(d32, 1e-12)[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(-low / np.maximum(dmin32, 1e-12)[:, None]), 0, 63).astype(np.uint8)
    step = (d32[:, None] * sc)[..., None]
    codes = np.clip(np.rint((sub + (dmin32[:, None] * m)[..., None]) / step), 0, 15).astype(np.uint8)
    scales = np.zeros((len(sub), 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    pairs = codes.reshape(-1, 4, 2, 32)  # chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high ones
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1)
    return blocks.reshape(rows, -1)


def write_tensor(path: Path, name: str, raw: np.ndarray, kind) -> None:
    """A GGUF file holding one tensor, its bytes as given (raw: [rows, bytes a row]) of GGML type `kind`."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def copy_with_q4_k(source: Path, target: Path, convert) -> list[str]:
    """Copy the GGUF file `source` to `target` with every tensor for which convert(name, shape) is true stored as
    Q4_K (from its dequantized values); the names converted."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    converted, tensors = [], []
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape))  # rows first
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32 and shape[-1] % 256 == 0 and convert(tensor.name, shape):
            values = dequantize(tensor.data, tensor.tensor_type).reshape(shape)
            tensors.append((tensor.name, quantize_q4_k(values), gguf.GGMLQuantizationType.Q4_K))
            converted.append(tensor.name)
        else:
            tensors.append((tensor.name, tensor.data, tensor.tensor_type))
    for name, data, kind in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()
    return converted
