"""TRL's DPO step, as `DPOTrainer` (TRL 1.16) runs it, for the step tracer.

`DPOTrainer._compute_loss` (trl/trainer/dpo_trainer.py) is what the Trainer's `compute_loss`
runs for each micro-batch; this module runs the same tensor operations under fake tensors:

- the batch `DataCollatorForPreference.torch_call` makes (`preference_batch`): `input_ids`,
  `attention_mask` and `completion_mask`, each (2 x B, max_length) int64, the chosen rows then the
  rejected ones; with `precompute_ref_log_probs`, `ref_chosen_logps` and `ref_rejected_logps` (B,)
  fp32 besides;
- the policy's forward through TRL's own fused LM head (`trl.trainer.utils.add_fused_lm_head`,
  patched onto the fake model as `DPOTrainer.__init__` patches it, with the outputs it asks for:
  log-probs, entropy, mean logits, top-1), `labels` the ids with the prompt masked to -100;
- the reference's forward under `torch.no_grad()`: the frozen `ref_model` (its own fused head, log-
  probs only), or with PEFT and no `ref_model` the same model inside `model.disable_adapter()`
  (TRL's `use_adapter(model, None)`), or nothing with `precompute_ref_log_probs` (read from the
  batch);
- the per-token log-probs summed per sequence, split into chosen and rejected, the loss
  (`loss_type` "sigmoid", "hinge" or "ipo", each weighted) and the metrics' tensors, kept alive
  to the function's end as its locals are.

Mirrored, not called: `_compute_loss` reads values (`.item()` for every metric, boolean-mask
selects whose size is data) that a fake tensor cannot give. The metrics' boolean selects
(`chosen_mean_logits[chosen_mask.bool()]`, `chosen_is_top1 & chosen_mask.bool()`) are mirrored as
whole-row products (every position a completion's: the most they can select), and the value reads
themselves allocate nothing. Off Triton (the CPU) TRL's head scores every position
(`compact=False`); on CUDA its Triton kernel scores the completion positions only, which this
trace does not do (it plans every position, the most).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from trainer_memcb.plan.step.trl_step import TrlStep

__all__ = ["DpoStep", "DPO_LOSS_TYPES", "REFERENCES", "PreferenceBatch", "preference_batch", "dpo_loss",
           "dpo_step_from_config", "fused_lm_heads"]

# The loss types the trace runs, each mirrored from `DPOTrainer._compute_loss`'s branch of that name.
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")
# Where the reference log-probs come from: a frozen second model, the policy with its adapters
# disabled (PEFT without `ref_model`), or the batch (`precompute_ref_log_probs`).
REFERENCES = ("model", "adapters-disabled", "precomputed")
# The outputs `DPOTrainer.__init__` asks the policy's fused head for (without `use_weighting`).
_POLICY_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")


@dataclasses.dataclass(frozen=True)
class DpoStep(TrlStep):
    """The DPO settings that change the step's memory.

    Attributes:
        beta: `DPOConfig.beta`.
        loss_type, loss_weights: `DPOConfig.loss_type` (a tuple) and its weights (1.0 each by default).
        reference: one of `REFERENCES`.
    """

    beta: float = 0.1
    loss_type: Tuple[str, ...] = ("sigmoid",)
    loss_weights: Optional[Tuple[float, ...]] = None
    reference: str = "model"

    def __post_init__(self) -> None:
        if self.reference not in REFERENCES:
            raise ValueError(f"reference={self.reference!r}: expected one of {', '.join(REFERENCES)}")
        unplanned = [name for name in self.loss_type if name not in DPO_LOSS_TYPES]
        if unplanned or not self.loss_type:
            raise ValueError(f"loss_type {list(self.loss_type)!r}: the DPO step is planned for "
                             f"{', '.join(DPO_LOSS_TYPES)} (not yet for {', '.join(unplanned) or 'none'})")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(f"loss_weights {list(self.loss_weights)!r}: one per loss_type {list(self.loss_type)!r}")

    def fuse_lm_heads(self, model: torch.nn.Module, ref_model: Optional[torch.nn.Module]) -> None:
        fused_lm_heads(model, ref_model)

    def batch(self, model: torch.nn.Module, batch_size: int, seq_len: Optional[int],
              input_options: Dict[str, Any]) -> "PreferenceBatch":
        # DPO's collator: chosen and rejected rows of max_length tokens.
        return preference_batch(batch_size, seq_len, self.reference == "precomputed")

    def loss(self, model: torch.nn.Module, inputs: Any, ref_model: Optional[torch.nn.Module], kwargs: Dict[str, Any],
             accumulation: int, autocast: Any) -> torch.Tensor:
        # DPOTrainer.compute_loss: policy, reference, loss and metrics.
        with autocast if autocast is not None else contextlib.nullcontext():
            return dpo_loss(model, inputs, self, ref_model)


def dpo_step_from_config(config: Any, *, peft: bool, ref_model: Optional[bool] = None) -> DpoStep:
    """The `DpoStep` of a `trl.DPOConfig` (made already, so TRL's own `__post_init__` checks ran),
    after the checks `DPOTrainer.__init__` makes of the same fields, for a model trained with PEFT
    adapters or not; `ref_model` True for a `ref_model` passed to the trainer, None for TRL's choice
    (none with PEFT or `precompute_ref_log_probs`, else a copy of the policy).

    Raises:
        ValueError: naming the field, its value and what TRL allows.
    """
    loss_type = tuple(config.loss_type if isinstance(config.loss_type, (list, tuple)) else [config.loss_type])
    if config.f_divergence_type != "reverse_kl":
        raise ValueError(f"f_divergence_type {config.f_divergence_type!r}: the DPO step is planned for "
                         "'reverse_kl' (the default) only")
    if config.use_weighting or config.ld_alpha is not None or config.padding_free:
        # padding_free is turned off by TRL 1.16 itself (DPOTrainer.__init__), with a warning.
        if config.use_weighting or config.ld_alpha is not None:
            raise ValueError("use_weighting and ld_alpha: the DPO step is planned without them")
    if "robust" in loss_type and not 0.0 <= config.label_smoothing < 0.5:
        raise ValueError(f"label_smoothing {config.label_smoothing}: TRL requires 0 <= label_smoothing < 0.5 "
                         "with loss_type 'robust'")
    if config.sync_ref_model and config.precompute_ref_log_probs:
        raise ValueError("sync_ref_model and precompute_ref_log_probs: TRL refuses the two together")
    if config.beta is None or not config.beta > 0:
        raise ValueError(f"beta {config.beta!r}: expected a number above 0 (DPO's loss divides by it)")
    if config.max_length is None:
        raise ValueError("max_length None: the DPO step is planned at max_length tokens; give one")
    if config.precompute_ref_log_probs:
        reference = "precomputed"
    elif ref_model or not peft:
        reference = "model"
    else:
        reference = "adapters-disabled"
    weights = tuple(config.loss_weights) if config.loss_weights is not None else None
    return DpoStep(beta=float(config.beta), loss_type=loss_type, loss_weights=weights, reference=reference)


@dataclasses.dataclass
class PreferenceBatch:
    """The collator's batch (`trl.trainer.dpo_trainer.DataCollatorForPreference.torch_call`)."""

    batch: Dict[str, torch.Tensor]
    labels: Optional[torch.Tensor] = None  # no `num_items_in_batch` is passed to TRL's loss
    held: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def forward(self) -> Dict[str, torch.Tensor]:
        return self.batch

    def tensors(self) -> List[torch.Tensor]:
        return list(self.batch.values())


def preference_batch(batch_size: int, max_length: int, precomputed: bool, device: str = "cpu") -> PreferenceBatch:
    """B pairs at `max_length` tokens: (2B, max_length) int64 ids, attention and completion masks
    (the collator's `torch.tensor` of Python ints, then `pad`), and the precomputed reference
    log-probs (B,) fp32 where asked."""
    rows = 2 * batch_size
    batch = {name: torch.zeros(rows, max_length, dtype=torch.long, device=device)
             for name in ("input_ids", "attention_mask", "completion_mask")}
    if precomputed:
        batch["ref_chosen_logps"] = torch.zeros(batch_size, device=device)
        batch["ref_rejected_logps"] = torch.zeros(batch_size, device=device)
    return PreferenceBatch(batch)


def fused_lm_heads(model: torch.nn.Module, ref_model: Optional[torch.nn.Module],
                   policy_outputs: Tuple[str, ...] = _POLICY_OUTPUTS, **head: Any) -> None:
    """Patch TRL's fused LM head onto the policy (its base model under PEFT) with `policy_outputs`
    and onto the reference with its default outputs, each with the `head` keywords, as
    `DPOTrainer.__init__` does (KTO's and GRPO's trainers likewise, with their own outputs)."""
    from trl.trainer.utils import add_fused_lm_head

    base = model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model
    add_fused_lm_head(base, outputs=policy_outputs, **head)
    if ref_model is not None:
        add_fused_lm_head(ref_model, **head)


def dpo_loss(model: torch.nn.Module, inputs: PreferenceBatch, step: DpoStep,
             ref_model: Optional[torch.nn.Module]) -> torch.Tensor:
    """`DPOTrainer._compute_loss(model, inputs, return_outputs=False)` for `f_divergence_type`
    "reverse_kl", `ld_alpha` None, no weighting and no MoE auxiliary loss, its value reads left out
    (they allocate nothing) and its boolean selects run as whole-row products (module docstring).
    The comments name the lines of trl/trainer/dpo_trainer.py (TRL 1.16) each part mirrors."""
    batch = inputs.batch
    # model_kwargs = {k: v for k, v in inputs.items() if k not in _non_model_keys}; use_cache=False
    model_kwargs: Dict[str, Any] = {k: v for k, v in batch.items()
                                    if k not in ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")}
    model_kwargs["use_cache"] = False
    completion_mask = batch["completion_mask"]
    shift_completion_mask = completion_mask[..., 1:]
    labels = batch["input_ids"].masked_fill(completion_mask == 0, -100)
    outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)
    seq_len = shift_completion_mask.size(1)
    per_token_logps = outputs.log_probs[:, -seq_len:]
    logps = per_token_logps.sum(dim=1)
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)
    ref_outputs = None
    if step.reference == "precomputed":
        ref_chosen_logps, ref_rejected_logps = batch["ref_chosen_logps"], batch["ref_rejected_logps"]
    else:
        with torch.no_grad():
            if step.reference == "adapters-disabled":
                with model.disable_adapter():  # trl.trainer.utils.use_adapter(model, None)
                    ref_outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)
            else:
                ref_outputs = ref_model(**model_kwargs, labels=labels, fused_lm_head=True)
        ref_per_token_logps = ref_outputs.log_probs[:, -seq_len:]
        ref_logps = ref_per_token_logps.sum(dim=1)
        ref_chosen_logps, ref_rejected_logps = ref_logps.chunk(2, dim=0)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    chosen_scores, rejected_scores = chosen_logratios, rejected_logratios  # reverse_kl
    delta_score = chosen_scores - rejected_scores
    loss: Any = 0.0
    weights = step.loss_weights or (1.0,) * len(step.loss_type)
    for loss_type, loss_weight in zip(step.loss_type, weights):
        if loss_type == "sigmoid":
            per_sequence_loss = -F.logsigmoid(step.beta * delta_score)
        elif loss_type == "hinge":
            per_sequence_loss = torch.relu(1 - step.beta * delta_score)
        else:  # ipo
            chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
            chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
            rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
            ipo_delta = chosen_avg_score - rejected_avg_score
            per_sequence_loss = (ipo_delta - 1 / (2 * step.beta)) ** 2
        loss = loss + per_sequence_loss.mean() * loss_weight
    # The metrics (entropy, token counts, mean logits, top-1 accuracy, rewards, margins), each a
    # small tensor alive to the function's end; `.item()` reads allocate nothing.
    metrics = _metrics(outputs, shift_completion_mask, batch["attention_mask"], seq_len, step.beta,
                       chosen_logratios, rejected_logratios, chosen_logps, rejected_logps)
    del metrics, ref_outputs, outputs
    return loss


def _metrics(outputs: Any, mask: torch.Tensor, attention_mask: torch.Tensor, seq_len: int, beta: float,
             chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor, chosen_logps: torch.Tensor,
             rejected_logps: torch.Tensor) -> List[Any]:
    """The metrics' tensors of `_compute_loss` ("# Log the metrics" to its return), in its order;
    a single process's `gather` and `gather_for_metrics` return their input."""
    kept: List[Any] = []
    per_token_entropy = outputs.entropy[:, -seq_len:].detach()
    kept += [per_token_entropy, (per_token_entropy * mask).sum(), mask.sum()]
    entropy_sum, total_tokens = kept[-2], kept[-1]
    kept.append(entropy_sum / total_tokens)
    kept.append(attention_mask.sum())
    chosen_mean_logits, rejected_mean_logits = outputs.mean_logits[:, -seq_len:].chunk(2, dim=0)
    chosen_mask, rejected_mask = mask.chunk(2, dim=0)
    # chosen_mean_logits[chosen_mask.bool()].sum(): the select as a whole-row product
    kept += [(chosen_mean_logits * chosen_mask.bool()).sum(), chosen_mask.sum(),
             (rejected_mean_logits * rejected_mask.bool()).sum(), rejected_mask.sum()]
    chosen_is_top1, _ = outputs.is_top1[:, -seq_len:].chunk(2, dim=0)
    correct_predictions = chosen_is_top1 & chosen_mask.bool()
    kept += [correct_predictions, chosen_mask.sum(), correct_predictions.sum()]
    kept.append(kept[-1].sum() / kept[-2].sum())
    chosen_rewards = beta * chosen_logratios.detach()
    rejected_rewards = beta * rejected_logratios.detach()
    kept += [chosen_rewards, rejected_rewards, chosen_rewards.mean(), rejected_rewards.mean()]
    reward_accuracies = (chosen_rewards > rejected_rewards).float()
    kept += [reward_accuracies, reward_accuracies.mean()]
    margins = chosen_rewards - rejected_rewards
    kept += [margins, margins.mean(), chosen_logps.mean(), rejected_logps.mean()]
    return kept
