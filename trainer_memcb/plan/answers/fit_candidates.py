"""Make it fit, the candidates: one setting planned (`FitCandidate`), the search's answer
(`FitSearch`), fits? as the step plan gives it (`step_verdict`), and the settings a proposal
writes: its `TrainingArguments` dict and DeepSpeed config.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from trainer_memcb.plan.answers.step_memory import StepMemoryPlan, plan_step_memory
from trainer_memcb.plan.settings.micro_batch import per_device_batch
from trainer_memcb.plan.settings.step_settings import StepSettings

__all__ = ["FitCandidate", "FitSearch", "step_verdict", "describe_changes", "expandable_segments_option",
           "training_args_of", "deepspeed_config_of", "flash_attention_proposable", "liger_kernel_proposable",
           "needs_package", "same_state", "ALLOWED_CHANGES", "LEANER_OPTIMIZERS", "FLASH_ATTENTION", "LIGER_KERNEL",
           "NEEDS_PACKAGE"]

# Changes that alter what is learned, opened by `allow` (the command's --allow).
ALLOWED_CHANGES = ("lora", "qlora", "seq-len")
# The Trainer's optimizers that hold less than AdamW (transformers' OptimizerNames): bitsandbytes'
# 8-bit AdamW (2 bytes of state per value), its paged variant (the same bytes, pages moved to the
# host under pressure), transformers' Adafactor (factored second moment, no first moment).
LEANER_OPTIMIZERS = ("adamw_bnb_8bit", "paged_adamw_8bit", "adafactor")
# The names of bitsandbytes' 8-bit AdamW (`adamw_8bit` is transformers' alias of `adamw_bnb_8bit`):
# one state on the device, planned alike, so none is proposed in place of another.
BNB_8BIT_ADAMW = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit")
# The attention proposed in place of eager attention: transformers' flash_attention_2, which holds
# no [B, H, L, L] probabilities (`trainer_memcb.plan.step.flash_attn`). A `from_pretrained`
# argument, not a TrainingArguments one.
FLASH_ATTENTION = {"attn_implementation": "flash_attention_2"}
# Liger's kernels, as the Trainer applies them (`TrainingArguments(use_liger_kernel=True)`): the
# fused linear cross-entropy never holds the whole logits (`trainer_memcb.plan.step.liger_kernels`).
LIGER_KERNEL = {"use_liger_kernel": True}
# What a proposal needs installed beside transformers: flash_attention_2 calls flash-attn's kernels
# (`pip install flash-attn`), use_liger_kernel liger-kernel's (`pip install liger-kernel`).
NEEDS_PACKAGE = {"flash_attention_2": "flash-attn", "use_liger_kernel": "liger-kernel"}
# The precisions whose attention inputs are 16-bit, the only ones flash-attn's kernels take: a
# model loaded in 16 bits, autocast (transformers casts fp32 inputs to autocast's dtype), DeepSpeed's.
_HALF_PRECISIONS = ("bf16", "fp16", "autocast-bf16", "autocast-fp16", "deepspeed-bf16", "deepspeed-fp16")


@dataclass(frozen=True)
class FitCandidate:
    """One setting planned: the user's own, or a proposal.

    Attributes:
        changes: what differs from the user's own setting (TrainingArguments names, `deepspeed`,
            `PYTORCH_CUDA_ALLOC_CONF`, `seq_len`, `lora_r`) -> the new value; {} for the own.
        training_args: a `TrainingArguments` dict that reproduces it (with `deepspeed` as a dict
            where it uses ZeRO).
        deepspeed: its DeepSpeed config, or None.
        peak_bytes, fits, margin_bytes: the planned step's peak per process; fits? and the margin
            as the step plan answers them (`step_verdict`): on CUDA from the allocator replay, whose
            reserved peak is `reserved_peak_bytes`, else from the peak against the usable bytes.
        relative_step_time: its estimated step time over the user's own (1.0 for the own).
        effective_batch: per-device batch x accumulation x processes.
        micro_batches: the accumulation steps; step_flops: one micro-batch's FLOPs (traced).
        host_transfer_bytes: bytes moved between host and device per step (offload).
        needs_package: the package the proposal needs installed (`NEEDS_PACKAGE`), or None.
        changes_optimizer, alters_training: a different optimizer; a change that alters what is
            learned (`allow`).
        problem: why it could not be planned, or None.
    """

    changes: Dict[str, Any]
    training_args: Dict[str, Any]
    deepspeed: Optional[Dict[str, Any]]
    peak_bytes: Optional[int]
    fits: Optional[bool]
    margin_bytes: Optional[int]
    relative_step_time: Optional[float]
    effective_batch: int
    micro_batches: int
    step_flops: Optional[int]
    host_transfer_bytes: int = 0
    reserved_peak_bytes: Optional[int] = None
    changes_optimizer: bool = False
    alters_training: bool = False
    problem: Optional[str] = None
    needs_package: Optional[str] = None
    plan: Optional[StepMemoryPlan] = field(default=None, repr=False, compare=False)
    seconds: Optional[float] = field(default=None, repr=False, compare=False)

    @property
    def label(self) -> str:
        """The changes in a few words."""
        return describe_changes(self.changes)

    def to_dict(self) -> Dict[str, Any]:
        return {"changes": dict(self.changes), "training_args": dict(self.training_args),
                "deepspeed": self.deepspeed, "peak_bytes": self.peak_bytes, "fits": self.fits,
                "margin_bytes": self.margin_bytes, "relative_step_time": self.relative_step_time,
                "effective_batch": self.effective_batch, "micro_batches": self.micro_batches,
                "step_flops": self.step_flops, "host_transfer_bytes": self.host_transfer_bytes,
                "reserved_peak_bytes": self.reserved_peak_bytes,
                "changes_optimizer": self.changes_optimizer, "alters_training": self.alters_training,
                "problem": self.problem, "needs_package": self.needs_package}


@dataclass(frozen=True)
class FitSearch:
    """The search's answer.

    Attributes:
        fits_as_is: the user's own step fits.
        own: the user's own setting, planned.
        candidates: the proposals, those that fit first, fastest first, then the others, nearest
            miss first.
        usable_bytes: what fits? is answered against (the device's memory less the reserve).
    """

    fits_as_is: bool
    own: FitCandidate
    candidates: List[FitCandidate]
    usable_bytes: int

    @property
    def best(self) -> Optional[FitCandidate]:
        """The first proposal that fits, or None."""
        return next((c for c in self.candidates if c.fits), None)

    @property
    def found(self) -> bool:
        return self.fits_as_is or self.best is not None

    def nearest_miss(self) -> Optional[FitCandidate]:
        """Of the settings planned (the own among them), the one whose peak exceeds the least."""
        missed = [c for c in [self.own] + self.candidates if c.fits is False and c.margin_bytes is not None]
        return max(missed, key=lambda c: c.margin_bytes) if missed else None

    def to_dict(self) -> Dict[str, Any]:
        return {"fits_as_is": self.fits_as_is, "usable_bytes": self.usable_bytes, "own": self.own.to_dict(),
                "candidates": [c.to_dict() for c in self.candidates]}


def same_state(own: Optional[str], other: str) -> bool:
    """Whether optimizer `other` holds what `own` holds on the device (the same name, or two names
    of bitsandbytes' 8-bit AdamW): proposing it changes nothing planned."""
    return other == own or (other in BNB_8BIT_ADAMW and own in BNB_8BIT_ADAMW)


def step_verdict(plan: StepMemoryPlan, usable_bytes: int) -> Tuple[Optional[bool], Optional[int]]:
    """fits? and the margin of a step plan, as the step plan itself answers them: its own where it
    has one (on CUDA, the allocator replay on the device's memory less the CUDA context and the
    reserve, which is `usable_bytes`), else its peak against `usable_bytes`; (None, None) for a
    step that could not be planned."""
    if plan.verdict.fits is not None:
        return plan.verdict.fits, plan.verdict.margin_bytes
    if plan.step.peak_bytes is None:
        return None, None
    margin = usable_bytes - plan.step.peak_bytes
    return margin >= 0, margin


def describe_changes(changes: Dict[str, Any]) -> str:
    """`changes` in a few words, e.g. "batch 2 x accumulation 8, gradient checkpointing"."""
    if not changes:
        return "your own setting"
    words = []
    if "per_device_train_batch_size" in changes or "gradient_accumulation_steps" in changes:
        words.append(f"batch {changes.get('per_device_train_batch_size', '?')} x accumulation "
                     f"{changes.get('gradient_accumulation_steps', '?')}")
    if changes.get("gradient_checkpointing"):
        words.append("gradient checkpointing")
    if "optim" in changes:
        words.append(f"optim {changes['optim']}")
    if "deepspeed" in changes:
        words.append(changes["deepspeed"])
    if "fsdp" in changes:
        words.append("FSDP2 full shard")
    if "parallelism" in changes:
        kind = "context" if changes["parallelism"].startswith("cp=") else "tensor"
        words.append(f"{kind} parallelism {changes['parallelism']}")
    if "PYTORCH_CUDA_ALLOC_CONF" in changes:
        words.append(f"PYTORCH_CUDA_ALLOC_CONF={changes['PYTORCH_CUDA_ALLOC_CONF']}")
    if changes.get("precompute_ref_log_probs"):
        words.append("the reference's log-probs precomputed (TRL's precompute_ref_log_probs)")
    if "generation_batch_size" in changes:
        words.append(f"generation batch {changes['generation_batch_size']} (TRL's generation_batch_size)")
    if "vllm_gpu_memory_utilization" in changes:
        words.append(f"vLLM's share {changes['vllm_gpu_memory_utilization']:g} (TRL's vllm_gpu_memory_utilization)")
    if "attn_implementation" in changes:
        words.append(f"{changes['attn_implementation']} attention")
    if changes.get("use_liger_kernel"):
        words.append("Liger's kernels (use_liger_kernel)")
    if "seq_len" in changes:
        words.append(f"sequence length {changes['seq_len']}")
    if "lora_r" in changes:
        words.append(f"LoRA r={changes['lora_r']}")
    if "per_device_eval_batch_size" in changes:
        words.append(f"eval batch {changes['per_device_eval_batch_size']}")
    if "eval_accumulation_steps" in changes:
        words.append(f"eval_accumulation_steps {changes['eval_accumulation_steps']}")
    return ", ".join(words)


def expandable_segments_option(planner: Callable[..., Any] = plan_step_memory) -> Optional[Dict[str, str]]:
    """The keyword that plans a step with expandable segments, where the plan models the caching
    allocator: `{"alloc_conf": "expandable_segments:True"}` when `planner` takes an `alloc_conf`
    argument (`plan_step_memory` takes it among its settings' flags), else None (the proposal is left
    out: without the allocator modelled, the plan's peak does not depend on it)."""
    try:
        parameters = inspect.signature(planner).parameters
    except (TypeError, ValueError):
        return None
    takes = "alloc_conf" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return {"alloc_conf": "expandable_segments:True"} if takes else None


def flash_attention_proposable(model: Any, precision: str, device_type: str) -> bool:
    """Whether `FLASH_ATTENTION` may be proposed for `model`: on CUDA (flash-attn's kernels run there
    alone), at a 16-bit precision (they take fp16 and bf16 inputs only), for a class transformers
    lets use it (`_supports_flash_attn`, `_supports_flash_attn_2` before transformers 4.54). The
    search proposes it only where the user's own step traced eager attention: where SDPA runs, a GPU
    takes its flash backend where it can, which saves what flash-attn saves."""
    inner = model.base_model.model if hasattr(model, "peft_config") and hasattr(model, "base_model") else model
    supports = getattr(inner, "_supports_flash_attn", None)
    if supports is None:
        supports = getattr(inner, "_supports_flash_attn_2", False)
    return device_type == "cuda" and precision in _HALF_PRECISIONS and bool(supports)


def liger_kernel_proposable(model: Any, device_type: str, own_uses_it: Optional[bool]) -> bool:
    """Whether `LIGER_KERNEL` may be proposed for `model`: on CUDA (liger-kernel's Triton kernels
    run there), for a causal LM of a model type whose patching is planned (`LIGER_MODEL_TYPES`),
    where the user's own step does not use them already."""
    from trainer_memcb.plan.settings.step_settings import LIGER_MODEL_TYPES

    inner = model.get_base_model() if hasattr(model, "peft_config") and hasattr(model, "get_base_model") else model
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    return (device_type == "cuda" and not own_uses_it and model_type in LIGER_MODEL_TYPES
            and hasattr(inner, "lm_head"))


def needs_package(changes: Dict[str, Any]) -> Optional[str]:
    """The package a proposal's `changes` need installed (`NEEDS_PACKAGE`), or None."""
    if changes.get("use_liger_kernel"):
        return NEEDS_PACKAGE["use_liger_kernel"]
    return NEEDS_PACKAGE.get(changes.get("attn_implementation", ""))


# The precision of a setting -> the TrainingArguments flags that give it (a model loaded in 16 bits,
# "bf16"/"fp16", is the model's dtype, not an argument: the flags are then left out).
_PRECISION_FLAGS = {"fp32": {"bf16": False, "fp16": False}, "autocast-bf16": {"bf16": True, "fp16": False},
                    "autocast-fp16": {"bf16": False, "fp16": True}, "deepspeed-bf16": {"bf16": True, "fp16": False},
                    "deepspeed-fp16": {"bf16": False, "fp16": True}}


def training_args_of(settings: StepSettings, base: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A `TrainingArguments` dict of the settings the step plan reads: `base` (the user's own
    arguments, when given) with the batch, accumulation, optimizer, checkpointing, clipping and
    precision of `settings` over it (the per-device batch: a padding-free SFT step's rows, not its one row)."""
    args = dict(base or {})
    args.update(per_device_train_batch_size=per_device_batch(settings),
                gradient_accumulation_steps=settings.gradient_accumulation_steps, optim=settings.optimizer,
                gradient_checkpointing=settings.gradient_checkpointing,
                max_grad_norm=settings.max_grad_norm if settings.max_grad_norm is not None else 0.0)
    args.update(_PRECISION_FLAGS.get(settings.precision, {}))
    return args


def deepspeed_config_of(stage: int, offload_optimizer: bool = False, precision: str = "fp32") -> Dict[str, Any]:
    """A DeepSpeed config for the Trainer: ZeRO `stage`, the optimizer offloaded to the CPU when
    asked, and the sizes the Trainer fills from its own arguments left "auto"
    (transformers' integrations/deepspeed.py, `trainer_config_process`)."""
    # "auto": the Trainer fills the bucket sizes from the model's hidden size.
    zero: Dict[str, Any] = {"stage": stage, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size="auto", stage3_param_persistence_threshold="auto")
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config: Dict[str, Any] = {"zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
                              "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
                              "gradient_clipping": "auto"}
    if precision.endswith("bf16"):
        config["bf16"] = {"enabled": "auto"}
    elif precision.endswith("fp16"):
        config["fp16"] = {"enabled": "auto"}
    return config
