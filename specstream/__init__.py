"""specstream: speculative decoding engine. The public API lives here; the subpackages are the engine's
rooms (docs/ARCHITECTURE.md has the map).

Names are imported on first use (PEP 562), so `import specstream` costs nothing until one is used, and
`import specstream.config` reads the configuration without loading torch or the trainer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "EngineConfig": "specstream.config",
    "SpeculativeConfig": "specstream.config",
    "Engine": "specstream.engine.engine",
    "AsyncEngine": "specstream.engine.async_engine",
    "DEFAULT_MODEL": "specstream.model.loader",
    "ModelError": "specstream.model.loader",
    "load_model": "specstream.model.loader",
    "load_tokenizer": "specstream.model.loader",
    "resolve_model": "specstream.model.loader",
    "HeadError": "specstream.spec_decode.draft_head",
    "check_draft_head": "specstream.spec_decode.head_files",
    "TrainConfig": "specstream.training.config",
    "train_draft": "specstream.training.train_draft",
    "EngineDeadError": "specstream.errors",
    "InvalidRequestError": "specstream.errors",
    "QueueFull": "specstream.errors",
    "RequestFailed": "specstream.errors",
    "SpecstreamError": "specstream.errors",
    "RequestOutput": "specstream.engine.outputs",
    "StreamChunk": "specstream.engine.outputs",
    "Usage": "specstream.engine.outputs",
    "ChatPrompt": "specstream.engine.processor",
    "template_calls_tools": "specstream.engine.processor",
    "SamplingParams": "specstream.sampling",
    "SpecStats": "specstream.sequence",
    "JSON_OPTIONS": "specstream.structured.grammar",
    "StructuredOutput": "specstream.sampling",
}

__all__ = [
    "AsyncEngine",
    "ChatPrompt",
    "DEFAULT_MODEL",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "HeadError",
    "InvalidRequestError",
    "JSON_OPTIONS",
    "ModelError",
    "QueueFull",
    "RequestFailed",
    "RequestOutput",
    "SamplingParams",
    "SpecStats",
    "SpecstreamError",
    "SpeculativeConfig",
    "StreamChunk",
    "StructuredOutput",
    "TrainConfig",
    "Usage",
    "check_draft_head",
    "load_model",
    "load_tokenizer",
    "resolve_model",
    "template_calls_tools",
    "train_draft",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specstream' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except AttributeError as exc:  # raised while importing: not "no such name", which it would read as
        raise ImportError(f"importing {module} failed: {exc}") from exc
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what type checkers and IDEs see; never run
    from specstream.config import EngineConfig, SpeculativeConfig
    from specstream.engine.async_engine import AsyncEngine
    from specstream.engine.engine import Engine
    from specstream.engine.outputs import RequestOutput, StreamChunk, Usage
    from specstream.engine.processor import ChatPrompt, template_calls_tools
    from specstream.sequence import SpecStats
    from specstream.errors import EngineDeadError, InvalidRequestError, QueueFull, RequestFailed, SpecstreamError
    from specstream.model.loader import DEFAULT_MODEL, ModelError, load_model, load_tokenizer, resolve_model
    from specstream.sampling import SamplingParams
    from specstream.spec_decode.draft_head import HeadError
    from specstream.spec_decode.head_files import check_draft_head
    from specstream.sampling import StructuredOutput
    from specstream.structured.grammar import JSON_OPTIONS
    from specstream.training.config import TrainConfig
    from specstream.training.train_draft import train_draft
