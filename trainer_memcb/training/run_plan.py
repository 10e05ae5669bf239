"""The step plan of a run's own settings: the model as loaded, its `TrainingArguments`, its engine
and its batch.

`plan_for_trainer` is the building block of the callback's planned figures
(`step_plan_peak_bytes`, `step_plan_reserved_bytes`) and of the out-of-memory report: it plans one
training step (`trainer_memcb.plan.answers.step_memory.plan_step_memory`, a step run under fake tensors)
for exactly what the run trains:

- the model as loaded, through a meta-device stand-in of the live model
  (`trainer_memcb.plan.model.stand_ins.meta_stand_in`: the same module classes, shapes, dtypes and
  `requires_grad`, adapters included), so that nothing of the live model is touched or allocated;
  the stand-in gets its own copy of the model's config, since preparing it as the Trainer does
  sets `use_cache` and the attention path on the config;
- each parameter in the dtype the run holds it in (`keep_dtypes`: PEFT's fp32 adapters over a
  16-bit base stay so);
- the settings resolved once from the `TrainingArguments`
  (`trainer_memcb.plan.settings.resolve_settings`, as `trainer-memcb estimate --training-args`
  resolves them: batch, precision, optimizer, checkpointing, gradient accumulation, the DeepSpeed or
  FSDP config), with the world size and this process's rank from the process group when one is
  initialised (else the arguments' `world_size`);
- the batch's sizes read from the shapes of one real batch (`batch_dims`: metadata only), or a
  sequence length given (`max_length`, when known).

`plan_reserved_bytes` is where the caching allocator's replay of the plan gives the reserved
bytes of a plan for CUDA; for a plan on the CPU it answers None, and the callback leaves the key out.

All of the plan is imported inside the functions: importing this module costs nothing, and the
plan's modules are named in one place (`_plan`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import nn

from trainer_memcb.utils.compiled import uncompiled

if TYPE_CHECKING:
    from trainer_memcb.plan.answers.step_plan import StepMemoryPlan

__all__ = ["batch_dims", "plan_for_trainer", "plan_reserved_bytes", "run_world_size", "stand_in_builder",
           "trained_module"]

# The batch's token inputs (their first two sizes: rows, length), in the order looked for.
_TOKEN_INPUTS = ("input_ids", "inputs_embeds")
# A sequence-to-sequence batch's decoder side (DataCollatorForSeq2Seq: decoder inputs, labels).
_TARGET_INPUTS = ("decoder_input_ids", "labels")


def _plan() -> Tuple[Any, Any, Any]:
    """The plan's three entry points: `resolve_settings`, `meta_stand_in`, `plan_step_memory`."""
    from trainer_memcb.plan.settings import resolve_settings
    from trainer_memcb.plan.model.stand_ins import meta_stand_in
    from trainer_memcb.plan.answers.step_memory import plan_step_memory

    return resolve_settings, meta_stand_in, plan_step_memory


def trained_module(model: Any) -> nn.Module:
    """The module a run trains, out of its wrappers: a `torch.compile` wrapper (`_orig_mod`), DDP
    or DeepSpeed's engine (`module`). A PEFT model stays whole: its adapters are part of the step."""
    for _ in range(8):
        model = uncompiled(model)
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner
    return model


def _shape(value: Any) -> Optional[Tuple[int, ...]]:
    shape = getattr(value, "shape", value)
    if isinstance(shape, (tuple, list, torch.Size)) and all(isinstance(size, int) for size in shape):
        return tuple(int(size) for size in shape)
    return None


def batch_dims(batch: Mapping[str, Any]) -> Dict[str, int]:
    """The sizes the step plan takes, from a batch's tensors (or their shapes): metadata only.

    `batch_size` and `seq_len` from the token inputs (`input_ids`, else `inputs_embeds`);
    `target_len` from a sequence-to-sequence batch's `decoder_input_ids` (else its 2-D `labels`,
    when it has `input_features`, an audio model's); `image_size` from square `pixel_values`
    (rows, channels, height, width), whose rows are the batch size when no tokens are given.

    Examples:
        >>> import torch
        >>> batch_dims({"input_ids": torch.zeros(4, 8, dtype=torch.long), "labels": torch.zeros(4, 8)})
        {'batch_size': 4, 'seq_len': 8}
        >>> batch_dims({"pixel_values": (2, 3, 224, 224), "labels": (2,)})
        {'batch_size': 2, 'image_size': 224}
    """
    shapes = {name: _shape(value) for name, value in batch.items()}
    dims: Dict[str, int] = {}
    tokens = next((shapes[name] for name in _TOKEN_INPUTS if shapes.get(name) and len(shapes[name]) >= 2), None)
    if tokens is not None:
        dims["batch_size"], dims["seq_len"] = tokens[0], tokens[1]
    audio = shapes.get("input_features")
    if "decoder_input_ids" in shapes or audio is not None:
        target = next((shapes[name] for name in _TARGET_INPUTS if shapes.get(name) and len(shapes[name]) == 2), None)
        if target is not None:
            dims.setdefault("batch_size", target[0])
            dims["target_len"] = target[1]
    pixels = shapes.get("pixel_values")
    if pixels is not None and len(pixels) == 4 and pixels[-1] == pixels[-2]:
        dims.setdefault("batch_size", pixels[0])
        dims["image_size"] = pixels[-1]
    return dims


def _own_config(stand_in: nn.Module) -> nn.Module:
    """Give the stand-in copies of the configs it shares with the live model (a config and the
    sub-configs its modules hold), so that preparing it for the trace changes nothing of the run."""
    from transformers import PretrainedConfig

    config = getattr(stand_in, "config", None)
    if not isinstance(config, PretrainedConfig):
        return stand_in
    copies: Dict[int, Any] = {}
    copy.deepcopy(config, copies)
    for module in stand_in.modules():
        for name, value in list(module.__dict__.items()):
            if isinstance(value, PretrainedConfig) and id(value) in copies:
                module.__dict__[name] = copies[id(value)]
    return stand_in


def _process_group() -> Tuple[Optional[int], int]:
    """(world size, this process's rank) from an initialised process group, else (None, 0)."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_world_size(), distributed.get_rank()
    return None, 0


def stand_in_builder(model: Any) -> Callable[[], nn.Module]:
    """What builds the run's model for the trace: a meta-device stand-in of the trained module
    (`trained_module`) with its own copy of the config, a new one each call."""
    _, meta_stand_in, _ = _plan()
    module = trained_module(model)
    return lambda: _own_config(meta_stand_in(module))


def run_world_size(args: Any) -> int:
    """Processes in the job: the process group's when one is initialised, else `args.world_size`."""
    group_size, _ = _process_group()
    return group_size or int(getattr(args, "world_size", 1) or 1)


def _device_type(module: nn.Module) -> str:
    """Where the run trains: "cuda" for a model on a CUDA device, otherwise "cpu" (the plan's two)."""
    for param in module.parameters():
        return "cuda" if param.device.type == "cuda" else "cpu"
    return "cpu"


def plan_for_trainer(model: Any, args: Any, batch: Optional[Mapping[str, Any]] = None, *,
                     seq_len: Optional[int] = None, device_type: Optional[str] = None,
                     world_size: Optional[int] = None) -> Any:
    """The step plan (`StepMemoryPlan`) for a run's own settings: see the module docstring.

    Args:
        model: the model the Trainer trains (`trainer.model`, or a wrapper of it: compiled, DDP,
            DeepSpeed's engine), as loaded; it is only read.
        args: the run's `TrainingArguments`.
        batch: one real batch (its tensors or their shapes): its sizes (`batch_dims`) override the
            arguments' `per_device_train_batch_size`.
        seq_len: the sequence length, when no batch says it (a known `max_length`).
        device_type: "cuda" or "cpu"; None: the device the model's parameters are on.
        world_size: processes in the job; None: the process group's, else `args.world_size`.

    Raises:
        ValueError: a batch whose sizes the model has no use for, or settings the plan refuses.

    Examples:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...                                      num_attention_heads=4, vocab_size=256))
        >>> args = TrainingArguments("out", per_device_train_batch_size=2, optim="adamw_torch", use_cpu=True,
        ...                          report_to=[])
        >>> plan = plan_for_trainer(model, args, {"input_ids": torch.zeros(2, 16, dtype=torch.long)})
        >>> plan.settings.batch_size, plan.settings.seq_len, plan.settings.engine, plan.step.peak_phase
        (2, 16, 'none', 'optimizer step')
        >>> plan.step.peak_parts["parameters"] == 4 * sum(param.numel() for param in model.parameters())  # fp32, as loaded
        True
    """
    resolve_settings, _, plan_step_memory = _plan()
    module = trained_module(model)
    dims = batch_dims(batch) if batch is not None else {}
    if seq_len is not None and "seq_len" not in dims:
        dims["seq_len"] = seq_len
    _, rank = _process_group()
    if world_size is None:
        world_size = run_world_size(args)
    config = getattr(module, "config", None)
    text_config = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    flags: Dict[str, Any] = {"world_size": world_size, "rank": rank if rank < world_size else 0}
    if "batch_size" in dims:
        flags["batch_size"] = dims["batch_size"]
    settings = resolve_settings(args, hidden_size=getattr(text_config, "hidden_size", None), **flags)
    plan, _ = plan_step_memory(stand_in_builder(module), settings=settings, args=args,
                               seq_len=dims.get("seq_len"), target_len=dims.get("target_len"),
                               image_size=dims.get("image_size"), device_type=device_type or _device_type(module),
                               model_name=type(module).__name__, keep_dtypes=True)
    return plan


def plan_reserved_bytes(plan: "StepMemoryPlan") -> Optional[int]:
    """The bytes the caching allocator reserves for `plan`'s step: the replay of its allocations
    over two steps (`DeviceFigures.reserved_peak_bytes`, a plan for a CUDA device); None for a
    plan on the CPU, which has no caching allocator, and then `step_plan_reserved_bytes` is left out.
    """
    return plan.device.reserved_peak_bytes
