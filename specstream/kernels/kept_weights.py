"""Projections as quant.LinearFactory built them, kept on disk so that a restart loads them instead of
building them again.

Building the bundled model's projections reads the GGUF file's blocks (from the int4 cache), repacks them
into the kernels' layouts and dequantizes each weight to overwrite the dense copy with what the packed
kernel computes: seconds of start-up, every start. The result is a function of the weights, the mode,
the dtype, the device, whether specstream's kernels serve, and this package's code; the builder keys a
file by all of them (calibration.cache_file's scheme), so a file found is the result exactly.

One safetensors file per key: each projection's packed kernel tensors and its dense copy, with a JSON
index (kind, shape, bits, tensor names) in the file's metadata. A file that cannot be read whole (a
half-written one: writes go to a temporary name, renamed when complete; a truncated one; an older
layout) is ignored, logged, and written again by this start.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger("specstream.kernels.kept_weights")

# Bumped when what a file holds changes meaning.
FORMAT = 1


class KeptWeights:
    """The projections kept at `path` (none where it holds no readable file), looked up by parameter names."""

    def __init__(self, path: Path, device: torch.device) -> None:
        self.path = path
        self.device = device
        self.index: dict[str, dict] = {}
        self._file = None
        self.found = False  # the file was read: lookup() answers from it (until close())
        if path.is_file():
            try:
                from safetensors import safe_open

                handle = safe_open(str(path), framework="pt", device="cpu")
                meta = handle.metadata() or {}
                if int(meta.get("format", -1)) != FORMAT:
                    raise ValueError(f"format {meta.get('format')}, not {FORMAT}")
                index = json.loads(meta["projections"])
                missing = {t for entry in index.values() for t in entry["tensors"]} - set(handle.keys())
                if missing:
                    raise ValueError(f"{len(missing)} tensors missing")
                self.index, self._file, self.found = index, handle, True
            except Exception as exc:  # noqa: BLE001 - a damaged file is built again
                log.warning("the kept projections %s cannot be read (%s: %s); building them again", path, type(exc).__name__, exc)


    def lookup(self, names: list[str]) -> tuple[tuple | None, tuple[int, int], int, torch.Tensor | None] | None:
        """For the projection fusing `names`: its packed kernel ((kind, *tensors), as quant.project takes it;
        None: held dense), shape, bits, and dense copy (or None). None where it is not kept."""
        entry = self.index.get("|".join(names)) if self._file is not None else None
        if entry is None:
            return None
        dense = self._tensor(entry["dense"]) if entry["dense"] else None
        kernel = None if entry["kind"] == "dense" else (entry["kind"], *(self._tensor(n) for n in entry["tensors"]))
        return kernel, tuple(entry["shape"]), entry["bits"], dense

    def _tensor(self, name: str) -> torch.Tensor:
        # A copy of its own: a tensor read from the file may share the file's mapping, which stays resident
        # while anything references it (close() then frees it).
        t = self._file.get_tensor(name)
        return t.to(self.device) if self.device.type != "cpu" else t.clone()

    def close(self) -> None:
        """Let go of the file (its mapping counts in the process's resident memory while open)."""
        self._file = None

    def save(self, built: list) -> None:
        """Keep the factory's projections (quant.Linear, dense copies still whole: before routes release any)."""
        from safetensors.torch import save_file

        index, tensors = {}, {}
        for i, lin in enumerate(built):
            entry = {"kind": "dense", "tensors": [], "dense": None, "shape": list(lin.shape), "bits": 16}
            if lin.packed is not None:
                kind, *parts = lin.packed.kernel
                names = [f"{i}.{j}" for j, t in enumerate(parts) if isinstance(t, torch.Tensor)]
                tensors.update({n: t for n, t in zip(names, parts)})
                entry.update(kind=kind, tensors=names, bits=lin.packed.bits)
                if lin.dense is not None:
                    entry["dense"] = f"{i}.dense"
                    tensors[entry["dense"]] = lin.dense
            index["|".join(lin.names)] = entry
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(f"{self.path.name}.{os.getpid()}.partial")
            save_file(
                {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                str(partial),
                metadata={"format": str(FORMAT), "projections": json.dumps(index)},
            )
            partial.replace(self.path)  # a concurrent reader sees the whole file or none
        except OSError as exc:
            log.warning("could not keep the projections in %s: %s", self.path, exc)
