"""One evaluation forward run under fake tensors, counting the storages it creates.

The forward of `Trainer.prediction_step` (`model.eval()`, `torch.no_grad()`, the batch with its
labels), under `FakeTensorMode`, nothing allocated; `LiveStorages` counts the storages it creates,
the parameters, buffers and batch excluded. What the containers keep is read from its outputs
(`trainer_memcb.plan.answers.eval_memory`).

With the Trainer's mixed precision the forward runs as accelerate's `prepare_model` wraps it, for
evaluation as for training: under `torch.autocast` (the casts and their cache are the forward's
storages), its 16-bit outputs then converted to float32 (`convert_outputs_to_fp32`), which is what
the containers keep. For a CUDA run the casts follow CUDA autocast's op lists
(`trainer_memcb.plan.step.cuda_autocast`) and attention runs as a GPU runs it
(`trainer_memcb.plan.step.cuda_sdpa`), as in the step's trace; transformers' flash paths
(`flash_attention_2`, `flash_attention_3`, the hub's flash-attn 2 kernels) run the stand-ins of
flash-attn's kernels (`trainer_memcb.plan.step.flash_attn`), as in the step's trace too. Without a
gradient their autograd functions save nothing: each kernel's output and float32 logsumexp (and
flash-attn 2's `rng_state`) are made, the output kept by the layer, the rest freed when the call
returns.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from trainer_memcb.plan.device.gpus import DEFAULT_COMPUTE_CAPABILITY
from trainer_memcb.plan.model.step_inputs import step_inputs
from trainer_memcb.plan.step.cuda_autocast import autocast_as, autocast_policy_for
from trainer_memcb.plan.settings.attention import is_flash_path, is_planned_hub_flash
from trainer_memcb.plan.step.cuda_sdpa import sdpa_as_cuda
from trainer_memcb.plan.step.flash_attn import flash_attention_as_cuda
from trainer_memcb.plan.model.value_reads import passed_checks, unpadded_batch
from trainer_memcb.plan.step.live_storages import LiveStorages
from trainer_memcb.plan.model.loss_kwargs import accepts_loss_kwargs, num_items_in_batch
from trainer_memcb.plan.step.trace import fake_copy
from trainer_memcb.state.saved_tensors import storages_of

__all__ = ["EvalForward", "trace_eval_forward", "SIXTEEN_BIT_DTYPES"]


@dataclass
class EvalForward:
    """One evaluation forward, traced: its peak (the storages it created, the model and the batch
    left out), the model's bytes, the loss's, and the shapes and dtypes of the outputs the
    containers keep and of the labels."""

    peak_bytes: int
    model_bytes: int
    loss_bytes: int
    outputs: List[Tuple[Tuple[int, ...], torch.dtype]]
    labels: Optional[Tuple[Tuple[int, ...], torch.dtype]]
    # The forward's timeline (`LiveStorages.events` and `sizes`), and the bytes of each storage of
    # the model (parameters, buffers) and of the batch, for the allocator replay.
    events: Tuple[int, ...] = ()
    sizes: Dict[int, int] = field(default_factory=dict)
    model_storages: Tuple[int, ...] = ()
    batch_storages: Tuple[int, ...] = ()


# The Trainer's 16-bit precisions by name (autocast, `bf16_full_eval` and `fp16_full_eval`).
SIXTEEN_BIT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def trace_eval_forward(model: nn.Module, batch_size: int, seq_len: int, use_cache: Optional[bool] = None, *,
                       autocast: Optional[str] = None, device_type: str = "cpu",
                       compute_capability: Optional[Tuple[int, int]] = None, gpu: Optional[str] = None) -> EvalForward:
    """Run one evaluation forward of `model` (on the meta device, made fake here) as
    `Trainer.prediction_step` runs it: `model.eval()`, `torch.no_grad()`, the batch with its labels;
    under `autocast` ("bf16", "fp16" or None) as the module docstring says, on `device_type`'s
    autocast lists and attention kernels ("cpu" or "cuda"; `gpu`, a preset's name, gives the SM
    count of flash-attn 2's split-KV heuristic)."""
    from trainer_memcb.plan.step.fake_mode import fake_tensor_mode

    config = getattr(model, "config", None)
    if use_cache is not None and config is not None and hasattr(config, "use_cache"):
        config.use_cache = use_cache  # as the Trainer sets it before evaluating
    mode = fake_tensor_mode()
    fake_copy(model, mode, "cpu")
    model.eval()
    with mode:
        inputs = step_inputs(model, batch_size, seq_len)  # the batch a collator makes, as for training
        labels = inputs.labels
        kwargs: Dict[str, Any] = dict(inputs.forward)
        if labels is not None:
            if accepts_loss_kwargs(model):
                kwargs["num_items_in_batch"] = num_items_in_batch(labels)
    held = list(model.parameters()) + list(model.buffers())
    model_storages = {key: nbytes for key, nbytes, _ in storages_of(held)}
    model_bytes = sum(model_storages.values())
    batch = [value for value in list(kwargs.values()) + list(inputs.held.values()) if isinstance(value, torch.Tensor)]
    batch_storages = {key: nbytes for key, nbytes, _ in storages_of(batch) if key not in model_storages}
    exclude = {key for key, _, _ in storages_of(held + list(kwargs.values()) + list(inputs.held.values()))}
    tracker = LiveStorages(exclude=exclude, keep_timeline=True)
    if autocast == "fp16" and device_type == "cpu":
        autocast = None  # accelerate's `native_amp` is off for fp16 on the CPU: no autocast there
    cast_policy, attention, flash = _device_kernels(model, autocast, device_type, compute_capability, gpu)
    casting = (torch.autocast("cpu", dtype=SIXTEEN_BIT_DTYPES[autocast]) if autocast is not None
               else contextlib.nullcontext())
    with cast_policy, attention, unpadded_batch(), passed_checks(), flash, mode, torch.no_grad(), tracker:
        with casting:
            outputs = model(**kwargs)
        if autocast is not None:
            outputs = _outputs_in_float32(outputs)  # what accelerate's forward wrapper returns
    ignore = list(getattr(getattr(model, "config", None), "keys_to_ignore_at_inference", None) or ["cache"]) + ["loss"]
    items = outputs.items() if isinstance(outputs, dict) else enumerate(outputs[1:] if labels is not None else outputs)
    kept = [(tuple(value.shape), value.dtype) for key, value in items
            if key not in ignore and isinstance(value, torch.Tensor)]
    loss = outputs.get("loss") if isinstance(outputs, dict) else (outputs[0] if labels is not None else None)
    loss_bytes = loss.element_size() if isinstance(loss, torch.Tensor) else 0
    return EvalForward(int(tracker.peak_bytes), int(model_bytes), loss_bytes, kept,
                       (tuple(labels.shape), labels.dtype) if labels is not None else None,
                       events=tuple(tracker.events), sizes=dict(tracker.sizes),
                       model_storages=tuple(model_storages.values()), batch_storages=tuple(batch_storages.values()))


def _device_kernels(model: nn.Module, autocast: Optional[str], device_type: str,
                    compute_capability: Optional[Tuple[int, int]], gpu: Optional[str]) -> Tuple[Any, Any, Any]:
    """The contexts of `device_type`'s kernels: autocast's op lists (under `autocast`), SDPA and the
    flash path's kernels (the last entered after `unpadded_batch`, whose patched mask function of
    flash_attention_2 a hub kernel's registration copies)."""
    none = contextlib.nullcontext()
    policy = autocast_policy_for(device_type) if autocast is not None else None
    cast_policy = autocast_as(policy) if policy is not None else none
    if device_type != "cuda":
        return cast_policy, none, none
    capability = compute_capability or DEFAULT_COMPUTE_CAPABILITY
    return cast_policy, sdpa_as_cuda(capability), _flash_kernels(model, capability, gpu)


def _flash_kernels(model: nn.Module, compute_capability: Tuple[int, int], gpu: Optional[str]) -> Any:
    """For a CUDA forward on the model's flash path, flash-attn's stand-in kernels as a GPU of
    `compute_capability` runs them (the implementation the step's `_outer_contexts` takes); else
    nothing."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not is_flash_path(implementation):
        return contextlib.nullcontext()
    stand_ins = implementation if implementation == "flash_attention_3" or is_planned_hub_flash(implementation) \
        else "flash_attention_2"
    return flash_attention_as_cuda(compute_capability, gpu, 0, stand_ins)


def _outputs_in_float32(outputs: Any) -> Any:
    """accelerate's `convert_to_fp32` (utils/operations.py), which the package does not import (it
    needs accelerate only through transformers, tests/test_package.py): every fp16 and bf16 tensor
    of the outputs, nested in tuples, lists and mappings, as a float32 copy; the rest as it is."""
    if isinstance(outputs, torch.Tensor):
        return outputs.float() if outputs.dtype in (torch.float16, torch.bfloat16) else outputs
    if isinstance(outputs, dict):  # a ModelOutput too: its keys kept in place
        for key in list(outputs.keys()):
            outputs[key] = _outputs_in_float32(outputs[key])
        return outputs
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_outputs_in_float32(value) for value in outputs)
    return outputs
