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
  `gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)`. `use_reentrant` is made
  explicit as the installed release resolves it (`checkpointing_kwargs`): with no keyword for torch,
  transformers 5 asks for the non-reentrant variant, 4.x for the reentrant one; with some but not
  `use_reentrant`, torch's `checkpoint` takes the reentrant one (and warns).
- `_inner_training_loop`: `model.train()` (dropout on: dropout saves its mask for backward).
- The dtype and the attention path are the model's own (`from_pretrained(torch_dtype=...,
  attn_implementation=...)`): the caller gives them, this module sets the attention on the config.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from torch import nn

__all__ = ["prepare_like_trainer", "checkpointing_kwargs", "reentrant_by_default"]


# The keys of the checkpointing keywords that transformers 5 takes for itself (which layers, and
# where their saved tensors live); the others go to `torch.utils.checkpoint.checkpoint`.
LAYER_KEYS = ("every_n_layers", "offload")


def reentrant_by_default() -> bool:
    """Whether the installed transformers checkpoints reentrantly when the Trainer's arguments give
    no keyword for torch: 4.x's `gradient_checkpointing_enable` fills `{"use_reentrant": True}`,
    5's `activation_checkpointing_enable` `{"use_reentrant": False}`."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return not hasattr(PreTrainedModel, "activation_checkpointing_enable")


def _given_checkpointing_kwargs(args: Any) -> Optional[Dict[str, Any]]:
    """The checkpointing keywords `TrainingArguments` (or a dict of them) hold: their
    `activation_checkpointing_kwargs`, else `gradient_checkpointing_kwargs`; None without any."""
    if args is None:
        return None
    read = args.get if isinstance(args, dict) else (lambda name: getattr(args, name, None))
    return read("activation_checkpointing_kwargs") or read("gradient_checkpointing_kwargs")


def checkpointing_kwargs(args: Any = None, given: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The keyword arguments the Trainer hands `activation_checkpointing_enable`, with `use_reentrant`
    made explicit as the installed release resolves it (see the module docstring).

    Args:
        args: `TrainingArguments` (or a dict of their values), or None.
        given: the keywords themselves, which take the place of `args`' when not None.
    """
    kwargs = dict((given if given is not None else _given_checkpointing_kwargs(args)) or {})
    if "use_reentrant" not in kwargs:
        for_torch = [key for key in kwargs if key not in LAYER_KEYS]
        # No keyword for torch: the Trainer passes None and the model's method fills its default.
        # Some: `checkpoint(use_reentrant=None)` warns and runs reentrantly (torch 2.6 to 2.13).
        kwargs["use_reentrant"] = reentrant_by_default() if not for_torch else True
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
                         gradient_checkpointing: bool = False,
                         checkpointing: Optional[Dict[str, Any]] = None) -> nn.Module:
    """Set `model` up as the Trainer does before its first step (see the module docstring), in place.

    Args:
        model: a transformers model (or a PEFT model around one), meta, fake or real.
        args: `TrainingArguments`: `use_cache` and the checkpointing keyword arguments come from
            them; None takes their defaults (`use_cache=False` on transformers 5, checkpointing as
            the installed release checkpoints without keywords).
        attn_implementation: "eager", "sdpa", ...; None keeps the config's.
        gradient_checkpointing: the Trainer's `gradient_checkpointing=True`.
        checkpointing: the checkpointing keywords (`activation_checkpointing_kwargs`), in place
            of `args`' when not None.

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
        _enable_checkpointing(model, checkpointing_kwargs(args, checkpointing))
    model.train()
    return model
