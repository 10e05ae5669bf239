"""The logged figures: key names, and the dict built from a measurement and an estimate.

Shared by the Trainer callback and the custom-loop API so that both log the same keys.
"""

from __future__ import annotations

from typing import Dict, Optional

from trainer_memcb.estimate import StateEstimate
from trainer_memcb.measure import StateMeasurement

__all__ = [
    "MEASURED_BYTES",
    "ESTIMATE_BYTES",
    "MEASURED_ELEMENTS",
    "TRAINABLE_PARAMS",
    "MEASURED_TOTAL_BYTES",
    "ESTIMATE_TOTAL_BYTES",
    "MASTER_WEIGHTS_BYTES",
    "MODEL_PARAMS_BYTES",
    "MODEL_GRADS_BYTES",
    "MODEL_STATES_BYTES",
    "MODEL_STATES_ESTIMATE_BYTES",
    "MODEL_STATES_TOTAL_BYTES",
    "MODEL_STATES_ESTIMATE_TOTAL_BYTES",
    "KEY_DESCRIPTIONS",
    "optimizer_figures",
    "with_prefix",
]

MEASURED_BYTES = "optimizer_state_bytes"
ESTIMATE_BYTES = "optimizer_state_estimate_bytes"
MEASURED_ELEMENTS = "optimizer_state_elements"
TRAINABLE_PARAMS = "optimizer_trainable_params"
# Sums over all processes of a distributed job (with one process, equal to the figures above).
MEASURED_TOTAL_BYTES = "optimizer_state_total_bytes"
ESTIMATE_TOTAL_BYTES = "optimizer_state_estimate_total_bytes"
# DeepSpeed ZeRO's fp32 copies of the parameters, which its inner optimizer updates.
MASTER_WEIGHTS_BYTES = "optimizer_master_weights_bytes"

# The four model states (trainer_memcb.model_states): parameters, gradients, and with the optimizer
# state and master weights their sum, beside the plan's figure for the same setup.
MODEL_PARAMS_BYTES = "model_params_bytes"
MODEL_GRADS_BYTES = "model_grads_bytes"
MODEL_STATES_BYTES = "model_states_bytes"
MODEL_STATES_ESTIMATE_BYTES = "model_states_estimate_bytes"
MODEL_STATES_TOTAL_BYTES = "model_states_total_bytes"
MODEL_STATES_ESTIMATE_TOTAL_BYTES = "model_states_estimate_total_bytes"

# Every key, its unit and meaning: the README's table and the callback's docstring say the same.
KEY_DESCRIPTIONS: Dict[str, str] = {
    MEASURED_BYTES: "bytes: storage the optimizer state really holds on this process, each storage once "
    "(with several processes, the largest over them)",
    ESTIMATE_BYTES: "bytes: what the state should hold for this optimizer family and these parameters "
    "(with several processes, the largest over them)",
    MEASURED_ELEMENTS: "values: stored values in that state (a quantized state counts its codes and scales)",
    TRAINABLE_PARAMS: "parameters: trainable parameter values the estimate covers (tied weights once)",
    MEASURED_TOTAL_BYTES: "bytes: optimizer_state_bytes summed over all processes of the job",
    ESTIMATE_TOTAL_BYTES: "bytes: optimizer_state_estimate_bytes summed over all processes of the job",
    MASTER_WEIGHTS_BYTES: "bytes: DeepSpeed ZeRO's fp32 master weights kept beside the model's own, on this process",
    MODEL_PARAMS_BYTES: "bytes: storage of the model's parameters on this process, each storage once (tied weights "
    "once, a DTensor by its shard, ZeRO-3 by its partitions)",
    MODEL_GRADS_BYTES: "bytes: storage of the gradients on this process, taken before the optimizer step",
    MODEL_STATES_BYTES: "bytes: parameters + gradients + optimizer state + master weights on this process",
    MODEL_STATES_ESTIMATE_BYTES: "bytes: the model-states plan's figure for the setup detected in the run",
    MODEL_STATES_TOTAL_BYTES: "bytes: model_states_bytes summed over all processes of the job",
    MODEL_STATES_ESTIMATE_TOTAL_BYTES: "bytes: model_states_estimate_bytes summed over all processes",
}


def optimizer_figures(
    measurement: Optional[StateMeasurement], estimate: Optional[StateEstimate]
) -> Dict[str, int]:
    """The exact integers to log. A figure that is not known is left out, never faked.

    An empty state (before the first step of most optimizers) claims no measurement.
    """
    figures: Dict[str, int] = {}
    if measurement is not None and not measurement.is_empty:
        figures[MEASURED_BYTES] = measurement.num_bytes
        figures[MEASURED_ELEMENTS] = measurement.num_elements
    if estimate is not None:
        figures[ESTIMATE_BYTES] = estimate.num_bytes
        figures[TRAINABLE_PARAMS] = estimate.num_params
    return figures


def with_prefix(figures: Dict[str, int], prefix: str) -> Dict[str, int]:
    """`optimizer_state_bytes` -> `eval_optimizer_state_bytes` for prefix `"eval"`."""
    if not prefix:
        return dict(figures)
    return {f"{prefix}_{key}": value for key, value in figures.items()}
