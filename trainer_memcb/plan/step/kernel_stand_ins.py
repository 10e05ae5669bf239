"""The GPU kernels a fake step runs as stand-ins, each family behind one interface
(`KernelStandIn`): transformers' flash attention paths on "cuda", run by flash-attn's kernels
(`plan.step.flash_attn`, `plan.step.flash_attn3`, the hub's flash-attn 2 kernels), and the
Trainer's `use_liger_kernel`, run by liger-kernel's (`plan.step.liger_kernels`). The tracer enters
what `kernel_stand_ins` gives for the settings around the whole step; each context yields its
`KernelRuns`, whose note says what ran. A new family is a class here and an entry in
`KERNEL_STAND_INS`; the tracer does not change."""

from __future__ import annotations

from typing import Any, ContextManager, List, Optional

from torch import nn

from trainer_memcb.plan.settings import StepSettings
from trainer_memcb.plan.settings.attention import is_planned_hub_flash
from trainer_memcb.plan.step.flash_attn import DEFAULT_SM_COUNT, SM_COUNTS, flash_attention_as_cuda
from trainer_memcb.plan.step.liger_kernels import liger_kernels_as_cuda

__all__ = ["KernelStandIn", "FlashAttentionStandIn", "LigerKernelStandIn", "KERNEL_STAND_INS", "kernel_stand_ins"]


class KernelStandIn:
    """One family of GPU kernels, stood in for as they run on the settings' GPU."""

    def context(self, model: nn.Module, settings: StepSettings) -> Optional[ContextManager[Any]]:
        """The context the whole step runs in with this family's stand-ins (yielding its
        `KernelRuns`), or None where the settings do not run them."""
        raise NotImplementedError


class FlashAttentionStandIn(KernelStandIn):
    """On "cuda", transformers' `flash_attention_2`, `flash_attention_3` and the hub's flash-attn 2
    kernels run by flash-attn's kernels, with the split-KV heuristic of the GPU's SM count and,
    with `padding`, the unpadded sizes of the plan's batch."""

    def context(self, model: nn.Module, settings: StepSettings) -> Optional[ContextManager[Any]]:
        if settings.device_type != "cuda":
            return None
        name = settings.attn_implementation
        implementation = name if name == "flash_attention_3" or is_planned_hub_flash(name) else "flash_attention_2"
        return flash_attention_as_cuda(settings.compute_capability, settings.gpu, settings.padding,
                                       implementation)


class LigerKernelStandIn(KernelStandIn):
    """With `use_liger_kernel`, the Trainer's `apply_liger_kernel(model, liger_kernel_config)`."""

    def context(self, model: nn.Module, settings: StepSettings) -> Optional[ContextManager[Any]]:
        if not settings.use_liger_kernel:
            return None
        config = settings.liger_kernel_config
        if settings.preference is not None:
            # trl 1.16 DPOTrainer.__init__: `{**liger_kernel_config, "fused_linear_cross_entropy": False}`, its own
            # fused LM head in place of the fused loss; the layer kernels on the policy alone.
            config = dict(config or {}, fused_linear_cross_entropy=False)
        sm_count = SM_COUNTS.get(settings.gpu or "", DEFAULT_SM_COUNT)
        return liger_kernels_as_cuda(model, config, settings.compute_capability, sm_count)


# In the order the tracer enters them.
KERNEL_STAND_INS = (FlashAttentionStandIn(), LigerKernelStandIn())


def kernel_stand_ins(model: nn.Module, settings: StepSettings) -> List[ContextManager[Any]]:
    """The stand-ins' contexts the settings run, in `KERNEL_STAND_INS`' order."""
    contexts = (stand_in.context(model, settings) for stand_in in KERNEL_STAND_INS)
    return [context for context in contexts if context is not None]
