"""The Trainer's loss keywords: whether a model is given `num_items_in_batch`, and the count it is
given, as `Trainer.compute_loss` passes them (the step's trace and the evaluation's forward)."""

import torch
from torch import nn

__all__ = ["accepts_loss_kwargs", "num_items_in_batch"]


def accepts_loss_kwargs(model: nn.Module) -> bool:
    """Whether the Trainer passes `num_items_in_batch` to this model: its `model_accepts_loss_kwargs`
    (transformers' trainer.py: the unwrapped model's `accepts_loss_kwargs`, else a forward that
    takes `**kwargs`)."""
    import inspect

    unwrapped = model.base_model.model if hasattr(model, "peft_config") and hasattr(model, "base_model") else model
    declared = getattr(unwrapped, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    parameters = inspect.signature(unwrapped.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)


def num_items_in_batch(labels: torch.Tensor) -> torch.Tensor:
    """The count of labelled tokens, as the Trainer passes it: transformers 5's
    `Trainer._get_num_items_in_batch` divides the int64 count by the tensor/context/sequence
    parallel sizes, a true division, so a 0-dim float32 tensor. The loss is then a sum divided by
    it, and the division saves it for backward (4 bytes); the value does not matter here."""
    return torch.tensor(float(labels.numel()))
