"""Which decoder architectures specstream serves exactly, and the load-time refusal of the rest.

An architecture is listed here only when tests/test_conformance.py shows that a tiny random
model of it, run through the packed runner (speculation on and off, alone and batched,
chunked prefill, preemption), produces the tokens transformers' own ``generate`` produces.
Anything else is refused when it is loaded, with a message naming what is missing: serving
wrong tokens quietly is worse than not serving.
"""

from __future__ import annotations

from specstream.model.loader import ModelError

# model_type -> the name users know it by.
VERIFIED_ARCHITECTURES: dict[str, str] = {
    "llama": "Llama (and SmolLM2)",
    "mistral": "Mistral",
    "ministral": "Ministral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 (text)",
    "phi3": "Phi-3",
    "olmo2": "OLMo 2",
    "olmo3": "OLMo 3",
    "smollm3": "SmolLM3",
    "gpt_oss": "gpt-oss",
    "cohere2": "Command R7B (Cohere2)",
}
# Layer kinds the packed attention implements (see attention.py).
_LAYER_TYPES = ("full_attention", "sliding_attention")
# RoPE variants whose frequencies depend on the longest position in the forward pass: in a
# packed batch that is another sequence's length, so a sequence's output would depend on
# its batch.
_BATCH_DEPENDENT_ROPE = ("dynamic", "longrope")


def check_architecture(model) -> None:
    """Raise ModelError naming the first feature of model that specstream does not implement."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in VERIFIED_ARCHITECTURES:
        supported = ", ".join(sorted(VERIFIED_ARCHITECTURES))
        raise ModelError(
            f"architecture '{model_type}' ({type(model).__name__}) is not one specstream has verified against "
            f"transformers; refusing to load it rather than risk wrong output. Verified: {supported}"
        )
    text = config.get_text_config()
    for layer_type in dict.fromkeys(getattr(text, "layer_types", None) or ()):
        if layer_type not in _LAYER_TYPES:
            raise ModelError(f"'{model_type}' has '{layer_type}' layers, which specstream does not implement")
    for rope_type in _rope_types(text):
        if rope_type in _BATCH_DEPENDENT_ROPE:
            raise ModelError(
                f"'{model_type}' uses '{rope_type}' RoPE scaling, whose frequencies depend on the longest sequence "
                "in a batch; specstream does not implement it"
            )


def _rope_types(config) -> list[str]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    # One dict, or one per layer type (Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}).
    nested = [p for p in params.values() if isinstance(p, dict)]
    return [p.get("rope_type", p.get("type", "default")) for p in (nested or [params])]
