"""Find the optimizers that really hold state behind the wrappers training libraries add."""

from __future__ import annotations

from typing import Any, List

__all__ = ["inner_optimizers"]

# How deep a chain of `.optimizer` wrappers may go before we stop following it. Real chains are
# short (Trainer: AcceleratedOptimizer -> torch optimizer; DeepSpeed: wrapper -> ZeRO -> torch).
_MAX_WRAPPER_DEPTH = 8


def _innermost(optimizer: Any) -> Any:
    """Follow `.optimizer` links: accelerate's `AcceleratedOptimizer`, accelerate's
    `DeepSpeedOptimizerWrapper` and DeepSpeed's ZeRO optimizers all keep the real optimizer there."""
    for _ in range(_MAX_WRAPPER_DEPTH):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer or not hasattr(inner, "param_groups"):
            return optimizer
        optimizer = inner
    return optimizer


def inner_optimizers(optimizer: Any) -> List[Any]:
    """The optimizers whose `.state` holds the real tensors, each once.

    transformers' `LayerWiseDummyOptimizer` (layer-wise GaLore) is a dummy whose real optimizers,
    one per parameter, live in `.optimizer_dict`.
    """
    outer = _innermost(optimizer)
    per_param = getattr(outer, "optimizer_dict", None)
    if not isinstance(per_param, dict):
        return [outer]
    found: List[Any] = []
    seen = set()
    for inner in per_param.values():
        inner = _innermost(inner)
        if id(inner) not in seen:
            seen.add(id(inner))
            found.append(inner)
    return found
