"""The logged figures: key names, and the dict built from a measurement and an estimate.

Shared by the Trainer callback and the custom-loop API so that both log the same keys.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from trainer_memcb.state.estimate import StateEstimate
from trainer_memcb.state.measure import StateMeasurement
from trainer_memcb.utils.name_lists import name_list

__all__ = [
    "MEASURED_BYTES",
    "ESTIMATE_BYTES",
    "MEASURED_ELEMENTS",
    "TRAINABLE_PARAMS",
    "MEASURED_TOTAL_BYTES",
    "ESTIMATE_TOTAL_BYTES",
    "MASTER_WEIGHTS_BYTES",
    "UNEXPECTED_BYTES",
    "MODEL_PARAMS_BYTES",
    "MODEL_GRADS_BYTES",
    "MODEL_STATES_BYTES",
    "MODEL_STATES_ESTIMATE_BYTES",
    "MODEL_STATES_TOTAL_BYTES",
    "MODEL_STATES_ESTIMATE_TOTAL_BYTES",
    "REFERENCE_MODEL_PARAMS_BYTES",
    "ACTIVATIONS_BYTES",
    "ACTIVATIONS_PEAK_BYTES",
    "DEVICE_PEAK_ALLOCATED_BYTES",
    "DEVICE_PEAK_RESERVED_BYTES",
    "ACTIVATION_KEYS",
    "STEP_PLAN_PEAK_BYTES",
    "STEP_PLAN_RESERVED_BYTES",
    "STEP_PLAN_KEYS",
    "GENERATION_PHASE_PEAK_BYTES",
    "TRAINING_PHASE_PEAK_BYTES",
    "PHASE_KEYS",
    "CONTAINERS_DEVICE_BYTES",
    "CONTAINERS_HOST_BYTES",
    "CONCAT_PEAK_BYTES",
    "HOST_CONCAT_PEAK_BYTES",
    "FORWARD_PEAK_BYTES",
    "EVALUATION_KEYS",
    "STEP_MEMORY_PARTS",
    "KEY_DESCRIPTIONS",
    "KEY_PRESETS",
    "SHORT_KEYS",
    "keep_keys",
    "key_names",
    "select_keys",
    "claims_measurement",
    "step_memory_rows",
    "BREAKDOWN_KEY_PREFIXES",
    "BREAKDOWN_KEY_DESCRIPTIONS",
    "breakdown_key",
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
# Measured minus estimate (signed), once every trainable parameter has state (trainer_memcb.state.judge).
UNEXPECTED_BYTES = "optimizer_state_unexpected_bytes"

# The four model states (trainer_memcb.training.model_states_probe): parameters, gradients, and with the optimizer
# state and master weights their sum, beside the plan's figure for the same setup.
MODEL_PARAMS_BYTES = "model_params_bytes"
MODEL_GRADS_BYTES = "model_grads_bytes"
MODEL_STATES_BYTES = "model_states_bytes"
MODEL_STATES_ESTIMATE_BYTES = "model_states_estimate_bytes"
MODEL_STATES_TOTAL_BYTES = "model_states_total_bytes"
MODEL_STATES_ESTIMATE_TOTAL_BYTES = "model_states_estimate_total_bytes"
# The frozen reference model a preference or RL trainer holds beside the policy (TRL's DPO, KTO,
# RLOO, GRPO with beta > 0: `trainer.ref_model`). Part of the model states: `model_states_bytes`
# counts it, and `model_states_estimate_bytes` plans it as a frozen copy (no gradients, no optimizer
# state). Storages it shares with the policy are the policy's, counted once, in `model_params_bytes`.
REFERENCE_MODEL_PARAMS_BYTES = "reference_model_params_bytes"

# What a logged step's forward saves for backward, and the device's peak
# (trainer_memcb.training.activations_probe): training entries only.
ACTIVATIONS_BYTES = "activations_bytes"
ACTIVATIONS_PEAK_BYTES = "activations_peak_bytes"
DEVICE_PEAK_ALLOCATED_BYTES = "device_peak_allocated_bytes"
DEVICE_PEAK_RESERVED_BYTES = "device_peak_reserved_bytes"
ACTIVATION_KEYS = (ACTIVATIONS_BYTES, ACTIVATIONS_PEAK_BYTES, DEVICE_PEAK_ALLOCATED_BYTES, DEVICE_PEAK_RESERVED_BYTES)

# The step plan of the run's own settings (trainer_memcb.training.run_plan), planned once per run
# and carried by the training entries from the first logged step on, beside the device's peaks.
STEP_PLAN_PEAK_BYTES = "step_plan_peak_bytes"
STEP_PLAN_RESERVED_BYTES = "step_plan_reserved_bytes"
STEP_PLAN_KEYS = (STEP_PLAN_PEAK_BYTES, STEP_PLAN_RESERVED_BYTES)

# The two phases of a generating trainer's logged step (TRL's GRPO and RLOO:
# trainer_memcb.training.generation_phases): training entries only, beside TRL's reward and kl.
GENERATION_PHASE_PEAK_BYTES = "generation_phase_peak_bytes"
TRAINING_PHASE_PEAK_BYTES = "training_phase_peak_bytes"
PHASE_KEYS = (GENERATION_PHASE_PEAK_BYTES, TRAINING_PHASE_PEAK_BYTES)

# What an evaluation loop held (trainer_memcb.training.evaluation_probe): evaluation entries only,
# with the evaluation's prefix (`eval_containers_device_bytes`).
CONTAINERS_DEVICE_BYTES = "containers_device_bytes"
CONTAINERS_HOST_BYTES = "containers_host_bytes"
CONCAT_PEAK_BYTES = "concat_peak_bytes"
HOST_CONCAT_PEAK_BYTES = "host_concat_peak_bytes"
FORWARD_PEAK_BYTES = "forward_peak_bytes"
EVALUATION_KEYS = (CONTAINERS_DEVICE_BYTES, CONTAINERS_HOST_BYTES, CONCAT_PEAK_BYTES, HOST_CONCAT_PEAK_BYTES,
                   FORWARD_PEAK_BYTES)

# The step's memory by part, as the end-of-run summary, the TensorBoard view and `trainer-memcb
# report` show it: (what, the measured key, the planned key where the plan has one).
STEP_MEMORY_PARTS: Tuple[Tuple[str, str, Optional[str]], ...] = (
    ("parameters", MODEL_PARAMS_BYTES, None),
    ("gradients", MODEL_GRADS_BYTES, None),
    ("optimizer state", MEASURED_BYTES, ESTIMATE_BYTES),
    ("master weights", MASTER_WEIGHTS_BYTES, None),
    ("model states", MODEL_STATES_BYTES, MODEL_STATES_ESTIMATE_BYTES),
    ("activations", ACTIVATIONS_BYTES, None),
    ("activations, peak", ACTIVATIONS_PEAK_BYTES, None),
    ("device peak allocated", DEVICE_PEAK_ALLOCATED_BYTES, STEP_PLAN_PEAK_BYTES),
    ("device peak reserved", DEVICE_PEAK_RESERVED_BYTES, STEP_PLAN_RESERVED_BYTES),
)

# Every key, its unit and meaning: the guide's table (docs/trainer-callback.md) and the callback's docstring say the same.
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
    UNEXPECTED_BYTES: "bytes: optimizer_state_bytes minus optimizer_state_estimate_bytes (signed), once every "
    "trainable parameter has state; 0 when they agree (with several processes, the main process's own)",
    MODEL_PARAMS_BYTES: "bytes: storage of the model's parameters on this process, each storage once (tied weights "
    "once, a DTensor by its shard, ZeRO-3 by its partitions)",
    MODEL_GRADS_BYTES: "bytes: storage of the gradients on this process, taken before the optimizer step",
    MODEL_STATES_BYTES: "bytes: parameters + gradients + optimizer state + master weights (+ the reference model's "
    "parameters, when the trainer holds one) on this process",
    MODEL_STATES_ESTIMATE_BYTES: "bytes: the model-states plan's figure for the setup detected in the run (the "
    "reference model planned as a frozen copy of its parameters)",
    MODEL_STATES_TOTAL_BYTES: "bytes: model_states_bytes summed over all processes of the job",
    MODEL_STATES_ESTIMATE_TOTAL_BYTES: "bytes: model_states_estimate_bytes summed over all processes",
    REFERENCE_MODEL_PARAMS_BYTES: "bytes: storage of the frozen reference model's parameters (trainer.ref_model) on "
    "this process, each storage once, storages shared with the policy left out",
    ACTIVATIONS_BYTES: "bytes: storages autograd saved for backward in the logged step's last micro-batch forward "
    "(its forwards together, when several run before its backward), still saved at its end, each storage once, "
    "parameters excluded (with gradient checkpointing, what is saved "
    "outside the checkpointed blocks and each block's saved inputs; with several processes, the largest over them)",
    ACTIVATIONS_PEAK_BYTES: "bytes: the most of those saved bytes alive at any moment of that micro-batch's "
    "forwards and backward",
    DEVICE_PEAK_ALLOCATED_BYTES: "bytes: on CUDA only, torch.cuda.max_memory_allocated of the model's device when "
    "the step is logged (since the process started, or since the start of the step with reset_device_peak=True)",
    DEVICE_PEAK_RESERVED_BYTES: "bytes: on CUDA only, torch.cuda.max_memory_reserved of the model's device when "
    "the step is logged: the caching allocator's segments, what an out-of-memory error is about (since the process "
    "started, or since the start of the step with reset_device_peak=True)",
    STEP_PLAN_PEAK_BYTES: "bytes: training entries, from the first logged step on: the step plan's peak for the run's "
    "own settings (the model as loaded, its TrainingArguments, engine and batch), planned once per run; on CUDA, or "
    "anywhere with plan_step=True",
    STEP_PLAN_RESERVED_BYTES: "bytes: the same plan's bytes reserved by the caching allocator, once the plan replays "
    "its allocations; left out until then",
    GENERATION_PHASE_PEAK_BYTES: "bytes: training entries of a generating trainer (TRL's GRPO, RLOO): the most "
    "bytes alive at once of the storages the logged step's generation allocated (completions, KV cache, log-probs, "
    "the buffered micro-batches), above what was alive when it began; left out when the step generated nothing",
    TRAINING_PHASE_PEAK_BYTES: "bytes: training entries of a generating trainer: the most bytes alive at once of "
    "the storages the logged step's training allocated (each micro-batch's forward and backward, the optimizer "
    "step), above what was alive when it began",
    CONTAINERS_DEVICE_BYTES: "bytes: evaluation entries only: the most the evaluation loop's containers held at once "
    "as torch tensors on the model's device (losses, logits or what preprocess_logits_for_metrics returns, labels, "
    "inputs with include_for_metrics), each storage once",
    CONTAINERS_HOST_BYTES: "bytes: evaluation entries only: the most the containers held at once as numpy arrays on "
    "the host (after eval_accumulation_steps batches, and at the loop's end), each array's memory once",
    CONCAT_PEAK_BYTES: "bytes: evaluation entries only: the most the containers held during one batch's add: every "
    "container's tensors, the batch being added and the concatenation's result (old, new and result together)",
    HOST_CONCAT_PEAK_BYTES: "bytes: evaluation entries only: the same on the host while tensors become arrays: the "
    "arrays held, the new arrays and their concatenation",
    FORWARD_PEAK_BYTES: "bytes: evaluation entries only: the most bytes alive at once of the storages the "
    "evaluation's first forward creates (parameters, buffers and inputs excluded)",
}

# With `breakdown=`: bytes per state key, dtype or device, under keys of their own. No key may be a
# path prefix of another under `/` or `.`: W&B, DVCLive and MLflow's file store turn `/` into
# nesting or folders, and cannot store a figure at `a` beside one at `a/b`. So each breakdown gets
# its own first part (`optimizer_state_bytes_by_key`, not `optimizer_state_bytes/by_key`), and the
# part names are made safe (`_safe_part`).
BREAKDOWN_KEY_PREFIXES: Dict[str, str] = {
    "key": f"{MEASURED_BYTES}_by_key/",
    "dtype": f"{MEASURED_BYTES}_by_dtype/",
    "device": f"{MEASURED_BYTES}_by_device/",
}
BREAKDOWN_KEY_DESCRIPTIONS: Dict[str, str] = {
    f"{MEASURED_BYTES}_by_key/<key>": "bytes: with breakdown=('key',), per state key (exp_avg, state1, ...)",
    f"{MEASURED_BYTES}_by_dtype/<dtype>": "bytes: with breakdown=('dtype',), per storage dtype (float32, ...)",
    f"{MEASURED_BYTES}_by_device/<device>": "bytes: with breakdown=('device',), per device (cpu, cuda_0, ...)",
}

# Letters, digits, `_` and `-` are stored as they are by every reporter and are safe in a file name
# on any system; anything else (`/`, `.`, `:`, spaces) becomes `_`.
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def _safe_part(part: str) -> str:
    return _UNSAFE.sub("_", part) or "_"


def breakdown_key(breakdown: str, part: str) -> str:
    """The logged key of one part of a breakdown.

    Args:
        breakdown: `"key"`, `"dtype"` or `"device"`.
        part: the state key, dtype or device name, as measured.

    Examples:
        >>> from trainer_memcb.training.figures import breakdown_key
        >>> breakdown_key("key", "exp_avg"), breakdown_key("device", "cuda:0")
        ('optimizer_state_bytes_by_key/exp_avg', 'optimizer_state_bytes_by_device/cuda_0')
    """
    return BREAKDOWN_KEY_PREFIXES[breakdown] + _safe_part(str(part))


# Which keys a log entry carries (the callback's `eval_keys=` and `train_keys=`): "all", every key
# the run has (whatever this table holds, and the breakdowns asked for), or "short", the pair a
# user came for (with, in evaluation entries, what the evaluation's containers held on the device
# and on the host: the figures that run out of memory after hours of training). A list names keys of `KEY_DESCRIPTIONS`, or a breakdown by its first part
# (`optimizer_state_bytes_by_key` keeps every `optimizer_state_bytes_by_key/<key>`).
SHORT_KEYS = (MEASURED_BYTES, ESTIMATE_BYTES, CONTAINERS_DEVICE_BYTES, CONTAINERS_HOST_BYTES)
KEY_PRESETS = ("all", "short")


def key_names() -> Tuple[str, ...]:
    """Every key name `select_keys` takes in a list: the key table's, then the breakdowns' first parts."""
    return tuple(KEY_DESCRIPTIONS) + tuple(prefix.rstrip("/") for prefix in BREAKDOWN_KEY_PREFIXES.values())


def select_keys(value: Any, argument: str) -> Optional[Tuple[str, ...]]:
    """The keys an entry is to carry: None for every key (`"all"`), else the names chosen.

    `value` is `"all"`, `"short"`, or names (`trainer_memcb.utils.name_lists`: a list, a comma
    string, None or `()` for none).

    Raises:
        ValueError: naming an unknown key and the allowed ones.

    Examples:
        >>> from trainer_memcb.training.figures import select_keys
        >>> select_keys("short", "eval_keys")
        ('optimizer_state_bytes', 'optimizer_state_estimate_bytes', 'containers_device_bytes', 'containers_host_bytes')
        >>> select_keys("all", "train_keys") is None
        True
    """
    if isinstance(value, str) and value.strip() in KEY_PRESETS:
        return None if value.strip() == "all" else SHORT_KEYS
    try:
        return name_list(value, argument, key_names())
    except ValueError as error:
        raise ValueError(f"{error}, or one of {list(KEY_PRESETS)}") from None


def keep_keys(figures: Dict[str, int], chosen: Optional[Tuple[str, ...]]) -> Dict[str, int]:
    """`figures` (unprefixed) cut to the `chosen` keys (`select_keys`); None keeps them all."""
    if chosen is None:
        return figures
    return {key: value for key, value in figures.items() if key in chosen or key.split("/", 1)[0] in chosen}


def claims_measurement(measurement: Optional[StateMeasurement], stepped: Optional[bool]) -> bool:
    """Whether `measurement` may be reported: once the optimizer has stepped, whatever the state
    holds (a stateless optimizer's empty state is a measurement of 0), and never before. A caller
    that does not count steps passes `stepped=None`: then an empty state claims nothing."""
    if measurement is None:
        return False
    return (not measurement.is_empty) if stepped is None else stepped


def optimizer_figures(
    measurement: Optional[StateMeasurement], estimate: Optional[StateEstimate], stepped: Optional[bool] = None
) -> Dict[str, int]:
    """The exact integers to log. A figure that is not known is left out, never faked.

    The measured figures only once the optimizer has stepped (`claims_measurement`).
    """
    figures: Dict[str, int] = {}
    if measurement is not None and claims_measurement(measurement, stepped):
        figures[MEASURED_BYTES] = measurement.num_bytes
        figures[MEASURED_ELEMENTS] = measurement.num_elements
    if estimate is not None:
        figures[ESTIMATE_BYTES] = estimate.num_bytes
        figures[TRAINABLE_PARAMS] = estimate.num_params
    return figures


def _count(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def step_memory_rows(figures: Mapping[str, Any]) -> List[Tuple[str, Optional[int], Optional[int]]]:
    """(part, measured bytes, planned bytes) for each part of the step's memory that `figures`
    (unprefixed keys) knows; anything but a whole number is not known.

    Examples:
        >>> step_memory_rows({"model_params_bytes": 40, "activations_bytes": 64, "optimizer_state_bytes": 88,
        ...                   "optimizer_state_estimate_bytes": 88})
        [('parameters', 40, None), ('optimizer state', 88, 88), ('activations', 64, None)]
    """
    rows = []
    for part, measured_key, planned_key in STEP_MEMORY_PARTS:
        measured = _count(figures.get(measured_key))
        planned = _count(figures.get(planned_key)) if planned_key is not None else None
        if measured is not None or planned is not None:
            rows.append((part, measured, planned))
    return rows


def with_prefix(figures: Dict[str, int], prefix: str) -> Dict[str, int]:
    """`optimizer_state_bytes` -> `eval_optimizer_state_bytes` for prefix `"eval"`."""
    if not prefix:
        return dict(figures)
    return {f"{prefix}_{key}": value for key, value in figures.items()}
