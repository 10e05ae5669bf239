"""Whether a model argument names a folder that is not there, read from the path alone (no torch):
the `estimate` command answers it before it imports torch and transformers, and the model's
builder (`trainer_memcb.plan.optimizers.whatif.build_meta_model`) by the same rule."""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["looks_like_path", "no_such_folder", "missing_folder"]


def looks_like_path(model: str) -> bool:
    """Whether `model` reads as a path, not a hub name: absolute, starting with `.` or `~`, or with
    more than one `/` (a hub name has one: `meta-llama/Llama-2-7b-hf`)."""
    return os.path.isabs(model) or model.startswith((".", "~")) or model.count("/") > 1


def no_such_folder(model: str) -> str:
    return f"{model}: no such folder (give a folder holding config.json, or a hub name)"


def missing_folder(model: str) -> Optional[str]:
    """The one-line answer where `model` reads as a path and nothing is there; None otherwise."""
    if looks_like_path(model) and not os.path.lexists(model):
        return no_such_folder(model)
    return None
