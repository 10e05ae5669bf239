"""The model as the Trainer runs it: the settings the Trainer applies before the first step.

Planned on a model built from a config, a step must see the model the Trainer trains, not the one
the config describes. transformers' `trainer.py` (5.x) changes four things before the first step,
and `prepare_like_trainer` applies them in the same order, in this one place:

- `Trainer.__init__`, "Finalize": `self.model.config.use_cache = self.args.use_cache` (False by
  default). With a cache, a model with a fused QKV projection (GPT-NeoX, Phi-3) concatenates it
  and SDPA saves a copy of V instead of a view of the fused output. transformers 4.x has no
  `TrainingArguments.use_cache` and its Trainer leaves the config's (True by default) as it is:
  the models then make a cache in training too, and so does the plan there.
- `Trainer.__init__` / `_inner_training_loop`: `activation_checkpointing_enable(
  activation_checkpointing_kwargs=..., every_n_layers=..., offload=...)` when
  `args.activation_checkpointing` (`gradient_checkpointing` is its alias); transformers 4.x calls
  `gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`. Without `TrainingArguments`
  the plan asks for the non-reentrant variant (`use_reentrant=False`), transformers 5's default.
- `_inner_training_loop`: `model.train()` (dropout on: dropout saves its mask for backward).
- The dtype and the attention path are the model's own (`from_pretrained(torch_dtype=...,
  attn_implementation=...)`): the caller gives them, this module sets the attention on the config.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from torch import nn

__all__ = ["prepare_like_trainer", "checkpointing_kwargs"]


def checkpointing_kwargs(args: Any = None) -> Dict[str, Any]:
    """The keyword arguments the Trainer hands `activation_checkpointing_enable`, from
    `TrainingArguments` (their `activation_checkpointing_kwargs`, else `gradient_checkpointing_kwargs`),
    or `{"use_reentrant": False}` without arguments or when they give none.

    Args:
        args: `TrainingArguments`, or None.
    """
    given = None
    if args is not None:
        given = getattr(args, "activation_checkpointing_kwargs", None) or getattr(args, "gradient_checkpointing_kwargs", None)
    kwargs = dict(given or {})
    kwargs.setdefault("use_reentrant", False)
    return kwargs


def _enable_checkpointing(model: nn.Module, kwargs: Dict[str, Any]) -> None:
    kwargs = dict(kwargs)
    every_n_layers = kwargs.pop("every_n_layers", 1)
    offload = kwargs.pop("offload", False)
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        extra = {"every_n_layers": every_n_layers, "offload": offload} if (every_n_layers != 1 or offload) else {}
        enable(activation_checkpointing_kwargs=kwargs, **extra)
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing")
    enable(gradient_checkpointing_kwargs=kwargs)


def _trainer_sets_use_cache() -> bool:
    """Whether the installed Trainer sets `config.use_cache` from its arguments (transformers 5)."""
    try:
        from transformers import TrainingArguments
    except ImportError:
        return False
    return "use_cache" in getattr(TrainingArguments, "__dataclass_fields__", {})


def prepare_like_trainer(model: nn.Module, *, args: Any = None, attn_implementation: Optional[str] = None,
                         gradient_checkpointing: bool = False) -> nn.Module:
    """Set `model` up as the Trainer does before its first step (see the module docstring), in place.

    Args:
        model: a transformers model (or a PEFT model around one), meta, fake or real.
        args: `TrainingArguments`: `use_cache` and the checkpointing keyword arguments come from
            them; None takes their defaults (`use_cache=False` on transformers 5, non-reentrant
            checkpointing).
        attn_implementation: "eager", "sdpa", ...; None keeps the config's.
        gradient_checkpointing: the Trainer's `gradient_checkpointing=True`.

    Returns:
        The same model, in training mode.
    """
    config = getattr(model, "config", None)
    if config is not None:
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        if _trainer_sets_use_cache():
            config.use_cache = bool(getattr(args, "use_cache", False)) if args is not None else False
    if gradient_checkpointing:
        _enable_checkpointing(model, checkpointing_kwargs(args))
    model.train()
    return model
