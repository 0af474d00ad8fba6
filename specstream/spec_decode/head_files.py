"""Where a model's draft head is (bundled inside the package, or a directory the user names) and whether it fits
the target: read before a server starts (check_draft_head) and when a proposer loads it (load_for_target)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch

from specstream.spec_decode.draft_head import DraftHead, HeadError, check_fits, load_head, read_config

# Heads shipped inside the package, by bundled model alias.
BUNDLED_HEADS = {"smollm2-135m": "smollm2-135m"}


def bundled_head_dir(model_name: str) -> Path | None:
    name = BUNDLED_HEADS.get(model_name)
    if name is None:
        return None
    path = Path(str(resources.files("specstream") / "heads" / name))
    return path if (path / "config.json").is_file() else None


def resolve_head_dir(draft_model: str | None, model_name: str) -> Path:
    """The head directory to use: draft_model, else the head bundled for model_name."""
    if draft_model:
        return Path(draft_model).expanduser()
    path = bundled_head_dir(model_name)
    if path is None:
        raise HeadError(
            f"no draft head is bundled for '{model_name}'; train one with "
            f"`specstream train-draft --model {model_name} --out DIR` and pass draft_model=DIR "
            f"(--draft-model DIR)"
        )
    return path


def load_for_target(head_dir: Path, target, target_name: str, dtype: torch.dtype, device) -> DraftHead:
    """Load a head and check, at start-up, that it fits the target."""
    check_fits(read_config(head_dir), target.config, str(head_dir), target_name)
    return load_head(head_dir, target.get_input_embeddings().weight, dtype, device)


def check_draft_head(model: str, draft_model: str | None, method: str = "eagle") -> None:
    """Raise HeadError (a ValueError) unless the head that `method` would use fits the model:
    cheap (reads two config files), so a server can check before it starts. With "auto", a
    model with no head is fine (n-gram alone)."""
    from transformers import AutoConfig

    from specstream.model.loader import resolve_model

    if method == "auto" and not draft_model and bundled_head_dir(model) is None:
        return
    head = resolve_head_dir(draft_model, model)
    source = resolve_model(model)
    check_fits(read_config(head), AutoConfig.from_pretrained(source.path, **source.kwargs), str(head), model)
