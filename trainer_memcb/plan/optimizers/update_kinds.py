"""How the Trainer's optimizers meet the model-states plan: which are built around the model itself,
which update inside backward, and which setups the plan covers for them.

Most of the Trainer's optimizers are plain: built over parameter groups, they step over whatever
one process hands them (whole weights, FSDP's row shards, ZeRO's flat fp32 partitions). A few are
not (transformers 5 `trainer_optimizer.py`):

- GaLore and APOLLO (`_setup_low_rank_optimizer`) pick their target `nn.Linear` weights by module
  name and project each 2-D weight whole;
- LOMO and AdaLomo (`_get_lomo_optimizer`) take the model and update each parameter inside
  backward, from a hook, freeing its gradient at once (`lomo_optim` `Lomo.fuse_update`; the
  Trainer calls `optimizer.fused_backward`);
- the layer-wise variants (`*_layerwise`) give every parameter an optimizer of its own, stepped
  from a post-accumulate-grad hook that then frees the gradient.

The last two kinds never hold the whole gradient: one gradient at a time waits for its update. The
plan counts that one, the largest parameter's, in the parameter dtype, as LOMO's own accounting
does (LOMO, Lv et al. 2023, Table 1: 0.24 GB of gradients for LLaMA-7B in fp16, the 32000 x 4096
embedding's). At the moment of an update autograd is already producing the next gradient, and
LOMO's update makes fp32 copies of a 16-bit parameter and gradient: short-lived, and not counted.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["built_around_the_model", "is_layerwise", "unplanned_reason", "updates_in_backward"]

# transformers trainer_optimizer.py `_setup_low_rank_optimizer`: galore_adamw, apollo_adamw, ...
_LOW_RANK_PREFIXES = ("galore_", "apollo_")
# transformers trainer_optimizer.py `_get_lomo_optimizer`.
_FUSED_BACKWARD = ("lomo", "adalomo")


def is_layerwise(name: str) -> bool:
    """`galore_adamw_layerwise`, `apollo_adamw_layerwise`, ...: one optimizer per parameter."""
    return name.endswith("_layerwise")


def updates_in_backward(name: str) -> bool:
    """Whether the optimizer updates each parameter inside backward, holding one gradient at a time.

    Examples:
        >>> [updates_in_backward(name) for name in ("lomo", "adalomo", "galore_adamw_layerwise", "adamw_torch")]
        [True, True, True, False]
    """
    return name in _FUSED_BACKWARD or is_layerwise(name)


def built_around_the_model(name: str) -> bool:
    """Whether the Trainer builds this optimizer from the model itself rather than from param groups."""
    return name.startswith(_LOW_RANK_PREFIXES) or name in _FUSED_BACKWARD


def unplanned_reason(name: str, *, world_size: int, sharding: str, deepspeed: bool) -> Optional[str]:
    """Why the plan gives no figure for optimizer `name` in this setup, or None when it does.

    Args:
        name: the Trainer's `optim` name.
        world_size: processes in the job.
        sharding: the plan's sharding (`none`, `ddp`, `fsdp-*`, `zero1`, ...).
        deepspeed: DeepSpeed runs the job (ZeRO, or DeepSpeed's mixed precision without it).

    Examples:
        >>> unplanned_reason("adamw_torch", world_size=8, sharding="zero3", deepspeed=True) is None
        True
        >>> unplanned_reason("galore_adamw", world_size=8, sharding="ddp", deepspeed=False) is None
        True
    """
    if is_layerwise(name) and world_size > 1:
        # trainer_optimizer.py: "Layer-wise {optimizer_name} does not support DDP at this time".
        return ("the Trainer refuses layer-wise optimizers over several processes (\"does not support DDP at "
                "this time\"): plan it with --world-size 1")
    if name in _FUSED_BACKWARD and world_size > 1:
        return ("LOMO and AdaLomo are planned in one process (--world-size 1): over several they take their "
                "own DeepSpeed ZeRO-3 path (lomo_optim fuse_update_zero3), which the plan does not model")
    if not built_around_the_model(name):
        return None
    what = "LOMO and AdaLomo update the model's own parameters" if name in _FUSED_BACKWARD else \
        "GaLore and APOLLO project whole 2-D weights"
    if deepspeed:
        return f"{what}; DeepSpeed hands the optimizer flat fp32 copies instead: plan it with --sharding none or ddp"
    if sharding.startswith("fsdp-"):
        return f"{what}; under FSDP the optimizer steps over row shards, which the plan does not model for them: " \
               "plan it with --sharding none or ddp"
    return None
