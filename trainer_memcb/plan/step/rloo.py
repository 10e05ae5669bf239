"""TRL's RLOO step, as `RLOOTrainer` (TRL 1.16) runs it, for the step tracer: its settings and its
training phase.

`RLOOTrainer` is built as `GRPOTrainer` is (trl/trainer/rloo_trainer.py): the same generation of
`num_generations` completions for each prompt by transformers' `generate`, buffered for
`steps_per_generation` micro-batches, the same fused LM heads. What differs, and what this module and
`trainer_memcb.plan.step.rloo_generation` mirror:

- after generation the old policy's per-token log-probs are always computed, and summed per
  sequence (`old_logps`, (B,)); the reference's (beta above 0) enter the rewards as a sequence-level
  KL penalty, not the loss: the training phase runs no reference and holds no per-token reference
  log-probs;
- the advantage is the leave-one-out baseline's (each completion's reward less the mean of its
  group's others), optionally normalized;
- the loss is per sequence: the sequence's log-prob ratio to the old policy, clipped, times the
  advantage, averaged over the micro-batch.

`RlooStep` is a `GrpoStep` (the generation machinery reads the same fields) with RLOO's own
options; `rloo_step_from_config` makes one after the checks `RLOOConfig.__post_init__` and
`RLOOTrainer.__init__` make of the fields that change memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, List, Optional

import torch

from trainer_memcb.plan.step.grpo import (GrpoBatch, GrpoStep, _generation_kwargs, _whole, checked_generations, nan_extreme,
                                          per_token_logps)

__all__ = ["RlooStep", "rloo_step_from_config", "rloo_loss"]


@dataclasses.dataclass(frozen=True)
class RlooStep(GrpoStep):
    """The RLOO settings that change the step's memory: `GrpoStep`'s (its `loss_type` "rloo", its
    `old_log_probs` always true), and

    Attributes:
        normalize_advantages: the advantages normalized over the generation batch.
        reward_clip_range: the rewards clamped to it (a temporary of the generation batch's rows).
        mask_truncated_completions: the completion mask zeroed for completions that reached the
            length without an EOS (a product with the mask).
    """

    loss_type: str = "rloo"
    old_log_probs: bool = True
    normalize_advantages: bool = False
    reward_clip_range: Any = None
    mask_truncated_completions: bool = False

    trainer = "rloo"
    loss_types = ("rloo",)

    def loss(self, model: torch.nn.Module, inputs: Any, ref_model: Optional[torch.nn.Module], kwargs: Dict[str, Any],
             accumulation: int, autocast: Any) -> torch.Tensor:
        # RLOOTrainer.compute_loss over the buffered micro-batch.
        with autocast if autocast is not None else contextlib.nullcontext():
            return rloo_loss(model, inputs, self)


def rloo_step_from_config(config: Any, *, peft: bool, world_size: int = 1) -> RlooStep:
    """The `RlooStep` of a `trl.RLOOConfig` (or a namespace of its fields), after TRL's checks of
    the fields that change memory, for a model trained with PEFT adapters or not.

    Raises:
        ValueError: naming the field, its value and what TRL allows (or what is planned).
    """
    _, steps, generations = checked_generations(config, world_size, "RLOO")
    if config.sync_ref_model and peft:
        raise ValueError("sync_ref_model with PEFT (--lora-r): TRL refuses it (no reference model to synchronize)")
    unplanned = {"use_transformers_continuous_batching": bool(config.use_transformers_continuous_batching),
                 "use_transformers_paged": bool(config.use_transformers_paged),
                 "router_aux_loss_coef": bool(config.router_aux_loss_coef),
                 "pad_to_multiple_of": config.pad_to_multiple_of not in (None, "auto")}
    for name, asked in unplanned.items():
        if asked:
            raise ValueError(f"{name} {getattr(config, name)!r}: the RLOO step is planned with its default so far")
    _whole("num_iterations", config.num_iterations, 1)
    reference = "none" if config.beta == 0.0 else ("adapters-disabled" if peft else "model")
    return RlooStep(beta=float(config.beta), num_generations=generations, steps_per_generation=steps,
                    max_completion_length=_whole("max_completion_length", config.max_completion_length, 1),
                    reference=reference, generation_kwargs=tuple(sorted(_generation_kwargs(config).items())),
                    temperature=float(config.temperature), use_vllm=bool(config.use_vllm), vllm_mode=config.vllm_mode,
                    vllm_gpu_memory_utilization=float(config.vllm_gpu_memory_utilization),
                    normalize_advantages=bool(config.normalize_advantages),
                    reward_clip_range=tuple(config.reward_clip_range) if config.reward_clip_range else None,
                    mask_truncated_completions=bool(config.mask_truncated_completions))


def rloo_loss(model: torch.nn.Module, inputs: GrpoBatch, step: RlooStep) -> torch.Tensor:
    """`RLOOTrainer._compute_loss(model, inputs)` for a text model without an auxiliary loss, its
    value reads (the metrics' `.item()`) left out; the metrics' tensors are made as it makes them
    (`accelerator.reduce` clones its input on one process; `gather` returns it). Its clipping
    bounds (`epsilon`, `epsilon_high`) change no storage: the defaults are used."""
    batch = inputs.batch
    completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
    input_ids = torch.cat([batch["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], completion_mask], dim=1)
    logits_to_keep = completion_ids.size(1)
    logps_per_token, entropies = per_token_logps(model, input_ids, attention_mask, logits_to_keep, input_ids.size(0),
                                                 entropy=True)
    logps = (logps_per_token * completion_mask).sum(1)
    log_ratio = logps - batch["old_logps"]
    advantages = batch["advantages"]
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.2)
    per_sequence_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    loss = per_sequence_loss.mean()
    kept = _metrics(entropies, completion_mask, coef_1, advantages)
    del kept
    return loss


def _metrics(entropies: torch.Tensor, mask: torch.Tensor, coef_1: torch.Tensor, advantages: torch.Tensor) -> List[Any]:
    """The metrics' tensors of `_compute_loss` ("# Entropy" to its return), each freed after its `.item()`."""
    entropy_stats = torch.stack([(entropies * mask).sum(), mask.sum().float()]).clone()
    entropy_stats[0] / entropy_stats[1].clamp(min=1.0)
    is_low_clipped = (coef_1 < 1 - 0.2) & (advantages < 0)
    is_high_clipped = (coef_1 > 1 + 0.2) & (advantages > 0)
    is_region_clipped = is_low_clipped | is_high_clipped
    gathered_low_clip = is_low_clipped.float()
    gathered_low_clip.nanmean(), nan_extreme(gathered_low_clip, torch.min)
    gathered_high_clip = is_high_clipped.float()
    gathered_high_clip.nanmean(), nan_extreme(gathered_high_clip, torch.max)
    is_region_clipped.float().nanmean()
    return [entropy_stats, is_low_clipped, is_high_clipped, is_region_clipped]


