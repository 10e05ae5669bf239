"""LoRA adapters on a meta-device model, added by PEFT itself, for a what-if of what trains.

With LoRA (and QLoRA) the optimizer holds state only for the adapters and for the modules PEFT
copies to train in full (`modules_to_save`, a classification head for instance). Which modules get
adapters, their shapes and dtypes (PEFT keeps adapters in float32 over a bfloat16 or 4-bit base)
are PEFT's decisions, so the what-if lets PEFT make them: `get_peft_model` over the meta model.
A 4-bit base changes the frozen weights only, never the trainable ones, so the adapters of a
QLoRA run are the same as over an unquantized base.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch
from torch import nn

from trainer_memcb.plan.settings.optim_options import parse_target_modules
from trainer_memcb.utils.packages import MissingPackageError

__all__ = ["add_lora_adapters"]


def add_lora_adapters(model: nn.Module, r: int,
                      target_modules: Union[None, str, Sequence[str]] = None,
                      modules_to_save: Union[None, str, Sequence[str]] = None) -> nn.Module:
    """Wrap `model` as `peft.get_peft_model(model, LoraConfig(r=r, target_modules=...,
    modules_to_save=...))` does; only the adapters and `modules_to_save` copies then train.
    As with `get_peft_model`, the adapters are injected into `model` itself.

    Args:
        model: a model, best on the meta device (`trainer_memcb.plan.optimizers.whatif.build_meta_model`); new
            adapters are made on the meta device too.
        r: the adapters' rank (`LoraConfig.r`), a positive integer.
        target_modules: as `LoraConfig.target_modules`: one regular expression matched against
            whole module names, `"all-linear"`, or a list / comma list of module-name suffixes
            (`"q_proj,v_proj"`). None takes PEFT's default for the architecture.
        modules_to_save: module names PEFT copies to train in full (`"lm_head"`, `"classifier"`).

    Raises:
        MissingPackageError: peft is not installed (the `peft` extra brings it).
        ValueError: a bad `r`, a malformed module list, or PEFT refusing the
            configuration (no module matches), with the reason.

    Examples:
        >>> import torch
        >>> from trainer_memcb.plan.model.lora import add_lora_adapters
        >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 2))
        >>> adapted = add_lora_adapters(model, 4, target_modules="0", modules_to_save="1")
        >>> sorted((name, tuple(p.shape)) for name, p in adapted.named_parameters() if p.requires_grad)[:2]
        [('base_model.model.0.lora_A.default.weight', (4, 16)), ('base_model.model.0.lora_B.default.weight', (16, 4))]
    """
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise ValueError(f"LoRA rank r={r!r}: expected a positive integer, e.g. 8")
    targets = parse_target_modules(target_modules, "LoRA target_modules")
    saved: Optional[List[str]] = None
    if modules_to_save is not None:
        saved_value = parse_target_modules(modules_to_save, "LoRA modules_to_save")
        saved = [saved_value] if isinstance(saved_value, str) else list(saved_value)
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise MissingPackageError("LoRA adapters", "peft", extra="peft") from None
    try:
        config = LoraConfig(r=r, target_modules=targets, modules_to_save=saved)
        with torch.device("meta"):
            return get_peft_model(model, config)
    except (ValueError, TypeError, KeyError) as error:  # no module matched, an architecture PEFT has no default for
        raise ValueError(f"PEFT cannot add LoRA adapters (r={r}, target_modules={targets!r}, "
                         f"modules_to_save={saved!r}): {' '.join(str(error).split())}") from None
