"""The four model states measured during training, and the plan's figure for the same setup.

`ModelStatesProbe` measures the parameters and the gradients of a model from tensor metadata,
where the gradients exist: right before the optimizer step (the Trainer's
`on_pre_optimizer_step`, or a step pre-hook on the optimizer in a custom loop), since the step is
followed by `zero_grad`. With the optimizer state and master weights that the monitor measures
already, it makes:

| key | unit | meaning |
|---|---|---|
| `model_params_bytes` | bytes | storage of the model's parameters on this process, each storage once |
| `model_grads_bytes` | bytes | storage of their gradients, taken before the optimizer step |
| `model_states_bytes` | bytes | parameters + gradients + optimizer state + master weights (+ the reference model) |
| `model_states_estimate_bytes` | bytes | the plan's figure (`trainer_memcb.plan.answers.model_states`) for the setup detected |
| `reference_model_params_bytes` | bytes | the frozen reference model's parameters, when the trainer holds one |

A reference model (`trainer.ref_model` of TRL's DPO, KTO, RLOO, and GRPO with `beta > 0`) is part of
the model states: its parameters' storages, each once and without those it shares with the policy
(counted already), are added to `model_states_bytes`; the plan adds a frozen copy of its parameters
(`trainer_memcb.plan.answers.model_states.reference_model_bytes`: no gradients, no optimizer state) to
`model_states_estimate_bytes`. Measured once per reference model: it is frozen.

Each storage counts once: tied weights once, a DTensor (FSDP2) by its local shard's storage (which
FSDP2 pads to `ceil(rows / W)` rows on every rank), a ZeRO-3 partitioned parameter by its partition
(`ds_tensor`), ZeRO-1/2's flattened parameters by their flat buffer. The setup is detected from the
live run: the world size from `torch.distributed`, FSDP2 from DTensor parameters, ZeRO from the
optimizer, DDP from a world larger than one otherwise; each parameter's bytes per value from its
dtype. The optimizer part of the estimate is the optimizer's own estimate (the same rules).

Gradients under ZeRO live in DeepSpeed's own buffers, not in `param.grad`. ZeRO-1/2's
`DeepSpeedZeroOptimizer` frees them during its own step, before any hook outside it runs, so they
are measured when that step begins (`trainer_memcb.training.zero_gradients`, installed with
`tap_zero_gradients` by the callback and the loop logger); ZeRO-3's `grad_partitions_flat_buffer`
is read when present; otherwise the gradient figure (and the sum) is left out rather than guessed.
The plan's figure for ZeRO follows the run's param groups and this process's rank.
"""

from __future__ import annotations

import weakref

from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch

from trainer_memcb.training import zero_gradients
from trainer_memcb.training.distributed import world_size
from trainer_memcb.training.figures import (
    ESTIMATE_BYTES,
    MASTER_WEIGHTS_BYTES,
    MEASURED_BYTES,
    MODEL_GRADS_BYTES,
    MODEL_PARAMS_BYTES,
    MODEL_STATES_BYTES,
    MODEL_STATES_ESTIMATE_BYTES,
    REFERENCE_MODEL_PARAMS_BYTES,
)
from trainer_memcb.state.measure import _plain_tensors
from trainer_memcb.plan.answers.model_states import layout_model_states, param_specs, reference_model_bytes
from trainer_memcb.plan.settings.setup import Setup
from trainer_memcb.state.rules.deepspeed_zero import find_zero_optimizer

__all__ = ["ModelStatesProbe", "detect_setup", "measure_grads_bytes", "measure_params_bytes",
           "measure_reference_model_bytes", "tap_zero_gradients"]

# DeepSpeed's gradient buffers, by ZeRO stage (stage3.py). ZeRO-1/2's DeepSpeedZeroOptimizer frees
# its gradients inside its step: they are measured when it begins (zero_gradients.py).
_ZERO_GRAD_BUFFERS = {3: "grad_partitions_flat_buffer"}

_CPU = torch.device("cpu")


def _count_bytes(tensors: Iterable[Optional[torch.Tensor]],
                 seen: Optional[Set[Tuple[torch.device, int]]] = None) -> int:
    """Bytes of the storages behind `tensors`, each storage once (metadata only). A tensor subclass
    (a DTensor) counts by the plain tensors inside it; a meta tensor holds nothing. Called at
    every logged step over every parameter and gradient, so it does only that.

    `seen`: storages counted elsewhere, left out here; the ones counted are added to it."""
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        # A parameter or a gradient is almost always a plain tensor: no generator for it, and its
        # device read once (each read makes a new `torch.device`).
        kind = type(tensor)
        for plain in (tensor,) if kind is torch.nn.Parameter or kind is torch.Tensor else _plain_tensors(tensor):
            if plain.is_cpu:
                device = _CPU  # no new `torch.device` made for the common case
            elif plain.is_meta:
                continue
            else:
                device = plain.device
            storage = plain.untyped_storage()
            identity = (device, storage.data_ptr())
            if identity[1] and identity in seen:
                continue
            seen.add(identity)
            total += storage.nbytes()
    return total


def _param_tensor(param: torch.Tensor) -> torch.Tensor:
    """What holds the parameter's values on this process: ZeRO-3's partition, else the parameter
    (a DTensor is counted by its local shard's storage when measured)."""
    partition = getattr(param, "ds_tensor", None)
    return partition if isinstance(partition, torch.Tensor) else param


def measure_params_bytes(model: torch.nn.Module) -> int:
    """Bytes of storage behind the model's parameters on this process, each storage once.

    Examples:
        >>> import torch
        >>> measure_params_bytes(torch.nn.Linear(4, 2))  # (8 + 2) fp32 values
        40
    """
    return _count_bytes(_param_tensor(param) for param in model.parameters())


def measure_reference_model_bytes(reference: torch.nn.Module, policy: Optional[torch.nn.Module] = None) -> int:
    """Bytes of storage behind a reference model's parameters on this process, each storage once,
    without the storages the `policy`'s parameters hold (those are the policy's).

    Examples:
        >>> import torch
        >>> policy = torch.nn.Linear(4, 2)
        >>> reference = torch.nn.Linear(4, 2)
        >>> reference.weight = policy.weight  # shared: the policy's
        >>> measure_reference_model_bytes(reference, policy)  # the bias: 2 fp32 values
        8
    """
    policy_storages: Set[Tuple[torch.device, int]] = set()
    if policy is not None:
        _count_bytes((_param_tensor(param) for param in policy.parameters()), policy_storages)
    return _count_bytes((_param_tensor(param) for param in reference.parameters()), policy_storages)


def measure_grads_bytes(model: torch.nn.Module, optimizer: Any = None) -> int:
    """Bytes of storage behind the gradients on this process, each storage once: `param.grad`,
    or DeepSpeed ZeRO-2/3's gradient buffer when the optimizer is a ZeRO one that has it."""
    found = find_zero_optimizer(optimizer) if optimizer is not None else None
    return _grads_bytes(list(model.parameters()), None if found is None else (found[0], found[3]))


def _grads_bytes(params: List[torch.Tensor], zero: Optional[Tuple[Any, int]]) -> int:
    """`zero`: the ZeRO optimizer and its stage, or None."""
    if zero is not None and zero_gradients.is_zero12_optimizer(zero[0]):
        tap = zero_gradients.find_tap(zero[0])
        if tap is None or tap.grads_bytes is None:
            why = f" ({tap.error!r})" if tap is not None and tap.error is not None else ""
            raise LookupError(f"ZeRO-{zero[1]} ({type(zero[0]).__name__}) frees its gradients inside its step, "
                              f"and none were measured when its step began{why}")
        return tap.grads_bytes
    if zero is not None and zero[1] in _ZERO_GRAD_BUFFERS:
        buffer = getattr(zero[0], _ZERO_GRAD_BUFFERS[zero[1]], None)
        if isinstance(buffer, torch.Tensor):
            return _count_bytes([buffer])
        if isinstance(buffer, (list, tuple)):
            return _count_bytes([tensor for tensor in buffer if isinstance(tensor, torch.Tensor)])
        raise LookupError(f"ZeRO-{zero[1]} keeps its gradients in {_ZERO_GRAD_BUFFERS[zero[1]]}, not found here")
    return _count_bytes(param.grad for param in params)


def tap_zero_gradients(optimizer: Any, wanted: Callable[[], bool]) -> Optional[Callable[[], None]]:
    """Measure the gradients of the `DeepSpeedZeroOptimizer` behind `optimizer` when its step begins,
    at the steps for which `wanted()` is true. Returns the function that stops it, or None when
    `optimizer` is no ZeRO-1/2 one (nothing to do)."""
    found = find_zero_optimizer(optimizer) if optimizer is not None else None
    if found is None or not zero_gradients.is_zero12_optimizer(found[0]):
        return None
    return zero_gradients.ZeroGradientsTap.install(found[0], wanted, _count_bytes)


def _zero_param_groups(zero: Any) -> Optional[Dict[int, int]]:
    """`id(param)` -> param group, from a ZeRO-1/2 optimizer's own 16-bit groups."""
    for name in ("bit16_groups", "bf16_groups"):  # DeepSpeedZeroOptimizer, BF16_Optimizer
        groups = getattr(zero, name, None)
        if isinstance(groups, list):
            return {id(param): index for index, group in enumerate(groups) for param in group}
    return None


def detect_setup(model: torch.nn.Module, optimizer: Any = None) -> Setup:
    """The plan's setup for a live run: world size, and DDP, FSDP2 (DTensor parameters) or ZeRO."""
    processes = world_size()
    found = find_zero_optimizer(optimizer) if optimizer is not None else None
    if found is not None:
        sharding = f"zero{found[3]}"
    elif any(type(param).__name__ == "DTensor" or hasattr(param, "_local_tensor") for param in model.parameters()):
        sharding = "fsdp-full-shard"
    else:
        sharding = "ddp" if processes > 1 else "none"
    return Setup(world_size=processes, sharding=sharding)


def _nothing() -> None:
    return None


def _weakly(target: Any) -> Callable[[], Any]:
    """A weak reference to `target`, or a strong one for a class that takes none."""
    if target is None:
        return _nothing
    try:
        return weakref.ref(target)
    except TypeError:
        return lambda: target


class ModelStatesProbe:
    """Measures parameters and gradients before the optimizer step, and adds the model-states
    figures to the optimizer's.

    Examples:
        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> probe = ModelStatesProbe()
        >>> model(torch.ones(1, 4)).sum().backward()
        >>> probe.before_step(model)
        >>> probe.figures({"optimizer_state_bytes": 88, "optimizer_state_estimate_bytes": 88})
        {'model_params_bytes': 40, 'model_grads_bytes': 40, 'model_states_bytes': 168, 'model_states_estimate_bytes': 168}
    """

    def __init__(self) -> None:
        # The model and optimizer are held weakly: the probe lives in a record kept for as long as
        # the optimizer lives, and must not be what keeps it (and its state) alive.
        self._model: Callable[[], Any] = _nothing
        self._optimizer: Callable[[], Any] = _nothing
        self._params_bytes: Optional[int] = None
        self._grads_bytes: Optional[int] = None
        self._layout_bytes: Optional[int] = None
        # The ZeRO optimizer behind the optimizer (weakly) and its stage, or None: found once per
        # optimizer (it walks the wrappers and tries a few attributes), not at every logged step.
        self._zero: Optional[Tuple[Callable[[], Any], int]] = None
        # The reference model (weakly), its measured bytes, and its planned bytes (once).
        self._reference: Callable[[], Any] = _nothing
        self._reference_bytes: Optional[int] = None
        self._reference_planned: Optional[int] = None

    @property
    def measured(self) -> bool:
        """Whether parameters and gradients have been measured at least once."""
        return self._params_bytes is not None

    def before_step(self, model: Optional[torch.nn.Module], optimizer: Any = None) -> None:
        """Measure now, where the gradients exist. Raises what measuring raises (the caller warns)."""
        if model is None:
            return
        if model is not self._model() or optimizer is not self._optimizer():
            self._model, self._optimizer, self._layout_bytes = _weakly(model), _weakly(optimizer), None
            found = find_zero_optimizer(optimizer) if optimizer is not None else None
            self._zero = None if found is None else (_weakly(found[0]), found[3])
        params = list(model.parameters())
        self._params_bytes = _count_bytes(_param_tensor(param) for param in params)
        self._grads_bytes = _grads_bytes(params, None if self._zero is None else (self._zero[0](), self._zero[1]))

    def reference_model(self, reference: Optional[torch.nn.Module], policy: Optional[torch.nn.Module] = None) -> None:
        """The trainer's frozen reference model (None: it has none), measured once per model:
        its parameters do not change. Raises what measuring raises (the caller warns)."""
        if reference is None or not isinstance(reference, torch.nn.Module):
            self._reference, self._reference_bytes, self._reference_planned = _nothing, None, None
            return
        if reference is self._reference() and self._reference_bytes is not None:
            return
        self._reference, self._reference_bytes, self._reference_planned = _nothing, None, None
        self._reference_bytes = measure_reference_model_bytes(reference, policy)
        self._reference = _weakly(reference)

    def _planned_reference(self) -> int:
        """The plan's frozen copy of the reference model's parameters, for the detected setup."""
        if self._reference_planned is None:
            reference = self._reference()
            if reference is None:
                return 0
            setup = detect_setup(self._model() or reference, self._optimizer())
            self._reference_planned = reference_model_bytes(param_specs(reference, keep_dtypes=True), setup)
        return self._reference_planned

    def _planned_without_optimizer(self) -> int:
        """The plan's parameters + gradients + master weights for the detected setup, once per model:
        under ZeRO, in the run's own param groups, for this process's rank."""
        if self._layout_bytes is None:
            model = self._model()
            setup = detect_setup(model, self._optimizer())
            zero = None if self._zero is None else self._zero[0]()
            groups = _zero_param_groups(zero) if zero is not None else None
            rank = torch.distributed.get_rank() if setup.is_zero and setup.world_size > 1 else None
            whole = zero is not None and not zero_gradients.is_zero12_optimizer(zero) and setup.sharding == "zero1"
            layout = layout_model_states(param_specs(model, keep_dtypes=True, groups=groups), setup,
                                         rank=rank, whole_zero_grads=whole)
            self._layout_bytes = layout.params_bytes + layout.grads_bytes + layout.master_weights_bytes
        return self._layout_bytes

    def figures(self, optimizer_figures: Dict[str, int]) -> Dict[str, int]:
        """The model-states keys, from the last `before_step` and this process's optimizer figures."""
        figures: Dict[str, int] = {}
        reference = self._reference_bytes if self._reference() is not None else None
        if self._params_bytes is None:
            if reference is not None:
                figures[REFERENCE_MODEL_PARAMS_BYTES] = reference
            return figures
        figures[MODEL_PARAMS_BYTES] = self._params_bytes
        figures[MODEL_GRADS_BYTES] = self._grads_bytes
        if MEASURED_BYTES in optimizer_figures:
            figures[MODEL_STATES_BYTES] = (self._params_bytes + self._grads_bytes + optimizer_figures[MEASURED_BYTES]
                                           + optimizer_figures.get(MASTER_WEIGHTS_BYTES, 0) + (reference or 0))
        if ESTIMATE_BYTES in optimizer_figures:
            figures[MODEL_STATES_ESTIMATE_BYTES] = (self._planned_without_optimizer() + optimizer_figures[ESTIMATE_BYTES]
                                                    + (self._planned_reference() if reference is not None else 0))
        if reference is not None:
            figures[REFERENCE_MODEL_PARAMS_BYTES] = reference
        return figures
