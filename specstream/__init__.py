"""specstream: speculative decoding engine. The public API lives here; submodules are the engine's rooms."""

from specstream.config import EngineConfig, SpeculativeConfig
from specstream.engine import Engine
from specstream.models import DEFAULT_MODEL, ModelError, load_model, load_tokenizer, resolve_model
from specstream.async_engine import AsyncEngine
from specstream.draft_head import HeadError
from specstream.eagle import check_draft_head
from specstream.train_draft import TrainConfig, train_draft
from specstream.errors import EngineDeadError, InvalidRequestError, QueueFull, RequestFailed, SpecstreamError
from specstream.outputs import RequestOutput, StreamChunk, Usage
from specstream.processor import ChatPrompt, template_calls_tools
from specstream.sampling import SamplingParams
from specstream.sequence import SpecStats
from specstream.structured import JSON_OPTIONS, StructuredOutput

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL",
    "ChatPrompt",
    "Engine",
    "EngineConfig",
    "ModelError",
    "RequestOutput",
    "SamplingParams",
    "SpecStats",
    "SpeculativeConfig",
    "StreamChunk",
    "StructuredOutput",
    "JSON_OPTIONS",
    "Usage",
    "AsyncEngine",
    "HeadError",
    "TrainConfig",
    "check_draft_head",
    "train_draft",
    "EngineDeadError",
    "InvalidRequestError",
    "QueueFull",
    "RequestFailed",
    "SpecstreamError",
    "load_model",
    "load_tokenizer",
    "resolve_model",
    "template_calls_tools",
    "__version__",
]
