"""specstream: speculative decoding engine. The public API lives here; submodules are the engine's rooms."""

from specstream.models import DEFAULT_MODEL, ModelError, load_model, load_tokenizer, resolve_model

__version__ = "0.1.0"

__all__ = ["DEFAULT_MODEL", "ModelError", "load_model", "load_tokenizer", "resolve_model", "__version__"]
