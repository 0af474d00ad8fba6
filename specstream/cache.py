"""Where specstream keeps what it builds and measures on this machine, and how it writes there.

The root is $SPECSTREAM_CACHE_DIR, else the user's cache directory. Under it: models/ (converted
model files), int4/ (a GGUF file's blocks), kernels/ (the built C++ kernels), inductor/ and
compiled/ (compiled steps), calibration/ (timings; calibration.py). Every entry is named by a key
of what it was made from, so entries of other versions or machines sit beside each other.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from pathlib import Path

import torch

CACHE_ENV = "SPECSTREAM_CACHE_DIR"

log = logging.getLogger(__name__)


def processor_name(device: torch.device | str) -> str:
    """What the device is, for keying measurements: the GPU's name, else the CPU's model name."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_dir() -> Path:
    """Root of specstream's on-disk cache: $SPECSTREAM_CACHE_DIR, else the user's cache dir."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specstream"


def point_inductor_here() -> None:
    """Put inductor's on-disk cache (its compiled kernels, the probe builds that pick the CPU's vector
    instructions) under specstream's cache, unless TORCHINDUCTOR_CACHE_DIR says otherwise. Called before
    anything asks inductor for its cache: its first answer (default: a directory in the system temp dir) sticks."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


def load_json(path: Path | None):
    """A kept file's content, or None when it is missing or does not parse."""
    if path is None:
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def save_json(path: Path, data) -> None:
    """Write atomically (a concurrent start reads the old file or the new one); a cache that cannot be
    written only costs a measurement at the next start."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps(data))
        partial.replace(path)
    except OSError as exc:
        log.warning("could not keep %s: %s", path, exc)
