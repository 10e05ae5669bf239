"""`trainer-memcb estimate MODEL`: the optimizer what-if, as tables.

The figures come from `trainer_memcb.plan.optimizers.whatif.what_if`; this module only formats them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

from trainer_memcb.cli.output import TextTable, bytes_cell, count_cell

if TYPE_CHECKING:
    from trainer_memcb.plan.optimizers.whatif import WhatIf

__all__ = ["estimate_tables"]


def _per_param(num_bytes: int, params: int) -> str:
    return f"{num_bytes / params:.3f}" if params else "-"


def estimate_tables(result: WhatIf) -> List[TextTable]:
    """The model's parameters, then one row per optimizer, the smallest state first."""
    model = TextTable(f"Model {result.model} (meta device: no weights read)", ["", "value"], [
        ["parameters", count_cell(result.total_params)],
        ["trainable parameters", count_cell(result.trainable_params)],
        ["trainable tensors", count_cell(result.trainable_tensors)],
        ["trainable dtype", ", ".join(result.trainable_dtypes)],
        ["trainable weights", bytes_cell(result.trainable_bytes)],
    ])
    known = sorted((e for e in result.optimizers if e.estimate is not None), key=lambda e: e.estimate.num_bytes)
    rows = [[e.name, bytes_cell(e.estimate.num_bytes), _per_param(e.estimate.num_bytes, result.trainable_params),
             e.optimizer_class or "-"] for e in known]
    rows += [[e.name, "-", "-", e.problem or "-"] for e in result.optimizers if e.estimate is None]
    optimizers = TextTable(
        "Optimizer state once every trainable parameter has had a gradient",
        ["optimizer (Trainer optim)", "state estimate", "bytes / trainable param", "class / problem"],
        rows,
        text_columns=(0, 3),
    )
    return [model, optimizers]
