"""A model's tensor-parallel plan, as transformers names it, in torch's parallel styles.

transformers gives each model class a plan: the config's `base_model_tp_plan` (Llama's:
`layers.*.self_attn.q_proj` "colwise", ... `layers.*.mlp.down_proj` "rowwise") under the base
model's prefix, beside the class's own `_tp_plan` for the head (`lm_head`: "colwise_gather_output")
and, in transformers 5, the embedding ("embedding_rowwise"); the model's `tp_plan` holds them merged
(transformers 4.57's has the base model's entries twice, with and without its prefix, and no
head's: the entries that name no module of the model are left out).
`from_pretrained(tp_plan="auto")` applies that plan with transformers' own styles
(`transformers.distributed.tensor_parallel.ALL_PARALLEL_STYLES`); the same layouts in torch's
`torch.distributed.tensor.parallel` styles, which `parallelize_module` applies, are:

| transformers | torch |
|---|---|
| colwise | `ColwiseParallel()`: weight and bias `Shard(0)`, input replicated, output `Shard(-1)` |
| rowwise | `RowwiseParallel()`: weight `Shard(1)`, bias replicated, input `Shard(-1)`, output all-reduced; its input given the layer's width as transformers gives it (`trainer_memcb.plan.model.tp_styles`) |
| colwise_rep, colwise_gather_output | `ColwiseParallel(output_layouts=Replicate())`: the output all-gathered |
| rowwise_rep, rowwise_split_input | `RowwiseParallel(input_layouts=Replicate())` |
| embedding_rowwise | `RowwiseParallel(input_layouts=Replicate())` on an `nn.Embedding`: rows `Shard(0)`, output all-reduced |
| embedding_colwise | `ColwiseParallel(output_layouts=Replicate())` on an `nn.Embedding`: columns `Shard(1)` |
| replicate | left whole on every rank |

Any other style (packed, unit, MoE, MLA) is refused by name: its layout has no torch style here;
"sequence_parallel" too (`trainer_memcb.plan.settings.step_settings.check_tp_plan`: transformers' own
style fails in a real run of Llama's norms).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from torch import nn

from trainer_memcb.plan.model.module_names import matches_module
from trainer_memcb.plan.model.supplied_tp_plans import supplied_tp_plan
from trainer_memcb.plan.settings.parallelism import TP_STYLES

__all__ = ["model_tp_plan", "plan_is_supplied", "torch_tp_plan", "matches_module", "TP_STYLES"]



def model_tp_plan(model: nn.Module, override: Optional[Dict[str, str]] = None, supplied: bool = True) -> Dict[str, str]:
    """The model's tensor-parallel plan, module name (with `*` for a layer number) -> style name:
    its `tp_plan` as transformers resolves it, else its config's `base_model_tp_plan` under the
    base model's prefix, else (with `supplied`) the plan supplied for its kind where transformers
    gives none (`trainer_memcb.plan.model.supplied_tp_plans`: BERT's family, DistilBERT); with the
    user's `override`, its rules in place of the model's for the same modules and the others kept,
    as transformers 5's `DistributedConfig(tp_plan=dict)` merges them (`distributed/mixin.py`:
    `plan | override`).

    Raises:
        ValueError: the model has no plan (transformers' `tp_plan="auto"` refuses it too), or an
            override's module names no module of the model (transformers refuses it too).
    """
    if override:
        names = [name for name, _ in model.named_modules()]
        unknown = sorted(name for name in override if not any(matches_module(name, module) for module in names))
        if unknown:
            raise ValueError(f"tensor-parallel plan: {', '.join(map(repr, unknown))} names no module of "
                             f"{type(model).__name__} (module names as named_modules() gives them, * for a layer number)")
        return {**_transformers_plan(model), **override}
    plan = _transformers_plan(model) or (supplied_tp_plan(model) if supplied else None)
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan (its config's base_model_tp_plan is "
                         "empty): tensor parallelism needs one")
    return plan


def plan_is_supplied(model: nn.Module, override: Optional[Dict[str, str]] = None) -> bool:
    """Whether `model_tp_plan(model, override)` is the plan supplied here: transformers gives the
    model none and the user's rules do not stand in for it."""
    return not override and not _transformers_plan(model) and supplied_tp_plan(model) is not None


def _transformers_plan(model: nn.Module) -> Dict[str, str]:
    """The plan transformers gives the model (empty where it gives none), only its entries that
    name modules of the model: transformers 4.57 keeps the base model's entries twice, with and
    without its prefix, and `parallelize_module` applies those that name a module."""
    plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    if not plan:
        config = getattr(model, "config", None)
        base = dict(getattr(config, "base_model_tp_plan", None) or {})
        prefix = getattr(model, "base_model_prefix", "")
        owner = getattr(model, prefix, None) if prefix else None
        plan = {(f"{prefix}.{name}" if owner is not None else name): style for name, style in base.items()}
    names = [name for name, _ in model.named_modules()]
    return {name: style for name, style in plan.items() if any(matches_module(name, module) for module in names)}


def torch_tp_plan(plan: Dict[str, str]) -> Dict[str, Any]:
    """`plan` in torch's parallel styles, for `parallelize_module(model, mesh, plan)`; the replicated
    entries left out.

    Raises:
        ValueError: a style with no torch equivalent here, named.

    Examples:
        >>> from trainer_memcb.plan.model.tp_plan import torch_tp_plan
        >>> styles = torch_tp_plan({"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"})
        >>> {name: type(style).__name__ for name, style in styles.items()}
        {'layers.*.mlp.up_proj': 'ColwiseParallel', 'layers.*.mlp.down_proj': 'RowwiseParallelGivenWidth'}
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from trainer_memcb.plan.model.tp_styles import RowwiseParallelGivenWidth

    made = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallelGivenWidth,
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    }
    styles: Dict[str, Any] = {}
    for name, style in plan.items():
        if style == "replicate":
            continue
        if style not in made:
            raise ValueError(f"tensor-parallel plan {name!r}: style {style!r} is not planned (planned: "
                             f"{', '.join(TP_STYLES)})")
        styles[name] = made[style]()
    return styles
