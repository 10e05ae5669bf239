"""TRL's KTO step, as `KTOTrainer` (TRL 1.16) runs it, for the step tracer.

`KTOTrainer._compute_loss` (trl/trainer/kto_trainer.py) is what the Trainer's `compute_loss` runs
for each micro-batch; this module runs the same tensor operations under fake tensors:

- the batch `DataCollatorForUnpairedPreference.torch_call` makes (`kto_batch`): `input_ids`,
  `attention_mask` and `completion_mask`, each (B, max_length) int64; where the loss estimates the
  KL term (every `loss_type` but "apo_zero_unpaired"), the same three for the mismatched
  prompt/completion pairs (`KL_input_ids`, ...); `label` (B,) bool; with
  `precompute_ref_log_probs`, `ref_logps` (and `ref_KL_logps`) (B,) fp32 besides;
- the policy's forward on the KL rows under `torch.no_grad()` (`_compute_kl_logps`), then its
  forward on the completion rows through TRL's fused LM head (patched onto the fake model as
  `KTOTrainer.__init__` patches it: log-probs, entropy and mean logits);
- the reference's forwards under `torch.no_grad()`, the KL rows' then the completion rows': the
  frozen `ref_model` (its own fused head, log-probs only), or with PEFT and no `ref_model` the same
  model inside `model.disable_adapter()` (TRL's `use_adapter(model, None)`), or nothing with
  `precompute_ref_log_probs` (read from the batch);
- the per-token log-probs summed per sequence, split into desirable and undesirable rows, the KL
  estimate, the loss of `loss_type` ("kto" or "apo_zero_unpaired") and the metrics' tensors.

Mirrored, not called: `_compute_loss` reads values (`.item()` for every metric) and splits the batch
by its labels (`torch.nonzero`, boolean-mask selects), whose sizes are data a fake tensor cannot
give. The plan takes half the rows as desirable (the larger half: `desirable_rows`): only tensors
of B elements, and metric rows whose two parts sum to the batch, depend on the split. The metrics'
boolean selects (`chosen_mean_logits[chosen_mask.bool()]`) are mirrored as whole-row products
(every position a completion's: the most they can select); the value reads allocate nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from trainer_memcb.plan.step.preference import PreferenceBatch, fused_lm_heads
from trainer_memcb.plan.step.trl_step import TrlStep

__all__ = ["KtoStep", "KTO_LOSS_TYPES", "KTO_REFERENCES", "kto_step_from_config", "kto_batch", "kto_loss",
           "kto_fused_lm_heads", "desirable_rows"]

# TRL 1.16's loss types (`KTOConfig.loss_type` choices), each mirrored from `_compute_loss`'s branch.
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
# Where the reference log-probs come from, as for DPO (`trainer_memcb.plan.step.preference.REFERENCES`).
KTO_REFERENCES = ("model", "adapters-disabled", "precomputed")
# The outputs `KTOTrainer.__init__` asks the policy's fused head for.
_POLICY_OUTPUTS = ("log_probs", "entropy", "mean_logits")


@dataclasses.dataclass(frozen=True)
class KtoStep(TrlStep):
    """The KTO settings that change the step's memory.

    Attributes:
        beta: `KTOConfig.beta`.
        loss_type: one of `KTO_LOSS_TYPES`.
        desirable_weight, undesirable_weight: the two losses' weights.
        reference: one of `KTO_REFERENCES`.
    """

    beta: float = 0.1
    loss_type: str = "kto"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    reference: str = "model"
    trainer: str = dataclasses.field(default="kto", init=False)

    def __post_init__(self) -> None:
        if self.reference not in KTO_REFERENCES:
            raise ValueError(f"reference={self.reference!r}: expected one of {', '.join(KTO_REFERENCES)}")
        if self.loss_type not in KTO_LOSS_TYPES:
            raise ValueError(f"loss_type {self.loss_type!r}: TRL's KTOTrainer takes {', '.join(KTO_LOSS_TYPES)}")

    @property
    def calculate_kl(self) -> bool:
        """Whether the loss estimates the KL term from mismatched pairs (`KTOTrainer.calculate_KL`)."""
        return self.loss_type != "apo_zero_unpaired"

    @staticmethod
    def desirable_rows(batch_size: int) -> int:
        """The desirable rows the plan takes of a micro-batch (`desirable_rows`)."""
        return desirable_rows(batch_size)

    def check_batch(self, batch_size: int) -> None:
        """`KTOTrainer.__init__`'s check of the micro-batch: the KL term needs more than one row.

        Raises:
            ValueError: naming the batch size and what TRL allows.
        """
        if self.calculate_kl and batch_size <= 1:
            raise ValueError(f"batch_size {batch_size}: TRL's KTOTrainer requires a micro-batch above 1 with loss_type "
                             f"{self.loss_type!r} (its KL term is estimated from the batch's other rows)")

    def fuse_lm_heads(self, model: torch.nn.Module, ref_model: Optional[torch.nn.Module]) -> None:
        kto_fused_lm_heads(model, ref_model)

    def batch(self, model: torch.nn.Module, batch_size: int, seq_len: Optional[int],
              input_options: Dict[str, Any]) -> PreferenceBatch:
        # KTO's collator: completion rows (and KL rows) of max_length tokens.
        return kto_batch(batch_size, seq_len, self)

    def loss(self, model: torch.nn.Module, inputs: Any, ref_model: Optional[torch.nn.Module], kwargs: Dict[str, Any],
             accumulation: int, autocast: Any) -> torch.Tensor:
        # KTOTrainer.compute_loss: KL rows, policy, reference, loss, metrics.
        with autocast if autocast is not None else contextlib.nullcontext():
            return kto_loss(model, inputs, self, ref_model)


def desirable_rows(batch_size: int) -> int:
    """The desirable rows the plan takes of a micro-batch of `batch_size`: the larger half (module
    docstring)."""
    return batch_size - batch_size // 2


def kto_step_from_config(config: Any, *, peft: bool) -> KtoStep:
    """The `KtoStep` of a `trl.KTOConfig`'s own fields (a namespace of them, or a config), after the
    checks `KTOTrainer.__init__` makes of the same fields, for a model trained with PEFT adapters or
    not (with PEFT TRL makes no `ref_model`: the reference is the model with its adapters disabled).

    Raises:
        ValueError: naming the field, its value and what TRL allows, or an option not planned.
    """
    if config.loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"loss_type {config.loss_type!r}: TRL's KTOTrainer takes {', '.join(KTO_LOSS_TYPES)}")
    sampling = getattr(config, "train_sampling_strategy", "sequential")
    if config.loss_type != "apo_zero_unpaired" and sampling != "sequential":
        raise ValueError(f"train_sampling_strategy {sampling!r}: TRL requires 'sequential' with loss_type "
                         f"{config.loss_type!r} (its KL completions are paired within a fixed-order batch)")
    for name in ("beta", "desirable_weight", "undesirable_weight"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} {value!r}: expected a number")
    if config.sync_ref_model and config.precompute_ref_log_probs:
        raise ValueError("sync_ref_model and precompute_ref_log_probs: TRL refuses the two together")
    if config.sync_ref_model and peft:
        raise ValueError("sync_ref_model with PEFT (--lora-r): TRL refuses it (no reference model to synchronize)")
    if config.max_length is None:
        raise ValueError("max_length None: the KTO step is planned at max_length tokens; give one")
    if config.router_aux_loss_coef:
        raise ValueError(f"router_aux_loss_coef {config.router_aux_loss_coef!r}: the KTO step is planned without "
                         "a Mixture-of-Experts auxiliary loss")
    if config.activation_offloading:
        raise ValueError("activation_offloading true: the KTO step is planned without offloading activations")
    if config.pad_to_multiple_of not in (None, "auto"):
        raise ValueError(f"pad_to_multiple_of {config.pad_to_multiple_of!r}: the KTO step is planned at "
                         "max_length tokens unpadded ('auto' or null)")
    if config.precompute_ref_log_probs:
        reference = "precomputed"
    else:
        reference = "adapters-disabled" if peft else "model"
    return KtoStep(beta=float(config.beta), loss_type=config.loss_type, desirable_weight=float(config.desirable_weight),
                   undesirable_weight=float(config.undesirable_weight), reference=reference)


def kto_batch(batch_size: int, max_length: int, step: KtoStep, device: str = "cpu") -> PreferenceBatch:
    """B rows at `max_length` tokens as the collator makes them: (B, max_length) int64 ids,
    attention and completion masks, the KL rows' three where the loss estimates the KL term, the
    precomputed reference log-probs (B,) fp32 where asked, and the labels (B,) bool last."""
    prefixes = ("", "KL_") if step.calculate_kl else ("",)
    batch = {f"{prefix}{name}": torch.zeros(batch_size, max_length, dtype=torch.long, device=device)
             for prefix in prefixes for name in ("input_ids", "attention_mask", "completion_mask")}
    if step.reference == "precomputed":
        batch["ref_logps"] = torch.zeros(batch_size, device=device)
        if step.calculate_kl:
            batch["ref_KL_logps"] = torch.zeros(batch_size, device=device)
    batch["label"] = torch.zeros(batch_size, dtype=torch.bool, device=device)
    return PreferenceBatch(batch)


def kto_fused_lm_heads(model: torch.nn.Module, ref_model: Optional[torch.nn.Module]) -> None:
    """Patch TRL's fused LM head onto the policy (its base model under PEFT) and the reference, as
    `KTOTrainer.__init__` does."""
    fused_lm_heads(model, ref_model, policy_outputs=_POLICY_OUTPUTS)


def _kl_logps(model: torch.nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """`KTOTrainer._compute_kl_logps`: the KL rows' forward under `torch.no_grad()`, summed per row."""
    kl_labels = batch["KL_input_ids"].masked_fill(batch["KL_completion_mask"] == 0, -100)
    with torch.no_grad():
        kl_per_token_logps = model(input_ids=batch["KL_input_ids"], attention_mask=batch["KL_attention_mask"],
                                   use_cache=False, labels=kl_labels, fused_lm_head=True).log_probs
    return kl_per_token_logps[:, -(kl_labels.size(1) - 1):].sum(-1)


def _row_indices(labels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """`torch.nonzero(bool_labels).view(-1)` and `torch.nonzero(~bool_labels).view(-1)`, at the
    plan's split (`desirable_rows`): (n, 1) int64 each, and the inverted labels."""
    chosen = desirable_rows(labels.size(0))
    chosen_idx = torch.zeros(chosen, 1, dtype=torch.long, device=labels.device).view(-1)
    inverted = ~labels
    rejected_idx = torch.zeros(labels.size(0) - chosen, 1, dtype=torch.long, device=labels.device).view(-1)
    del inverted
    return chosen_idx, rejected_idx


def kto_loss(model: torch.nn.Module, inputs: PreferenceBatch, step: KtoStep,
             ref_model: Optional[torch.nn.Module]) -> torch.Tensor:
    """`KTOTrainer._compute_loss(model, inputs, return_outputs=False)` for a text model without an
    auxiliary loss, its value reads left out and its data-sized selects at the plan's split (module
    docstring). The comments name the lines of trl/trainer/kto_trainer.py (TRL 1.16) each part mirrors."""
    batch = inputs.batch
    labels = batch["label"]
    num_chosen = labels.sum()
    num_rejected = len(labels) - num_chosen
    kl_logps = _kl_logps(model, batch) if step.calculate_kl else None
    model_kwargs: Dict[str, Any] = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                                    "use_cache": False}
    completion_labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    outputs = model(**model_kwargs, labels=completion_labels, fused_lm_head=True)
    seq_len = batch["input_ids"].size(1) - 1
    completion_logps = outputs.log_probs[:, -seq_len:].sum(-1)
    chosen_idx, rejected_idx = _row_indices(labels)
    chosen_logps = completion_logps.index_select(0, chosen_idx)
    rejected_logps = completion_logps.index_select(0, rejected_idx)
    ref_outputs = None
    if step.reference == "precomputed":
        ref_chosen_logps = batch["ref_logps"].index_select(0, chosen_idx)
        ref_rejected_logps = batch["ref_logps"].index_select(0, rejected_idx)
        ref_kl_logps = batch["ref_KL_logps"] if step.calculate_kl else None
    else:
        with torch.no_grad():
            if step.reference == "adapters-disabled":
                with model.disable_adapter():  # trl.trainer.utils.use_adapter(model, None)
                    ref_kl_logps = _kl_logps(model, batch) if step.calculate_kl else None
                    ref_outputs = model(**model_kwargs, labels=completion_labels, fused_lm_head=True)
            else:
                ref_kl_logps = _kl_logps(ref_model, batch) if step.calculate_kl else None
                ref_outputs = ref_model(**model_kwargs, labels=completion_labels, fused_lm_head=True)
        ref_completion_logps = ref_outputs.log_probs[:, -seq_len:].sum(-1)
        ref_chosen_logps = ref_completion_logps.index_select(0, chosen_idx)
        ref_rejected_logps = ref_completion_logps.index_select(0, rejected_idx)
    if step.calculate_kl:
        kl = (kl_logps - ref_kl_logps).mean().detach()
        kl = kl.mean().clamp(min=0)  # a single process's gather_for_metrics returns its input
    else:
        kl = torch.zeros(1, device=completion_logps.device)
    losses, rewards = _losses(step, kl, chosen_logps, ref_chosen_logps, rejected_logps, ref_rejected_logps)
    metrics = _metrics(outputs, batch, seq_len, chosen_idx, rejected_idx, rewards, chosen_logps, rejected_logps,
                       num_chosen, num_rejected)
    del metrics, ref_outputs, outputs
    return losses.nanmean()


def _losses(step: KtoStep, kl: torch.Tensor, chosen_logps: torch.Tensor, ref_chosen_logps: torch.Tensor,
            rejected_logps: torch.Tensor, ref_rejected_logps: torch.Tensor) -> Tuple[torch.Tensor, List[Any]]:
    """The desirable and undesirable rows' losses, weighted and concatenated ("# Chosen losses" to
    `torch.cat`), and the rewards; an empty side makes empty tensors, as TRL's does."""
    empty = torch.Tensor([]).to(kl.device)
    chosen_losses, chosen_rewards = empty, empty
    if chosen_logps.shape[0] != 0:
        chosen_logratios = chosen_logps - ref_chosen_logps
        shifted = chosen_logratios - kl if step.loss_type == "kto" else chosen_logratios
        chosen_losses = 1 - F.sigmoid(step.beta * shifted)
        chosen_rewards = step.beta * chosen_logratios.detach()
    rejected_losses, rejected_rewards = empty, empty
    if rejected_logps.shape[0] != 0:
        rejected_logratios = rejected_logps - ref_rejected_logps
        if step.loss_type == "kto":
            rejected_losses = 1 - F.sigmoid(step.beta * (kl - rejected_logratios))
        else:
            rejected_losses = F.sigmoid(step.beta * rejected_logratios)
        rejected_rewards = step.beta * rejected_logratios.detach()
    losses = torch.cat((step.desirable_weight * chosen_losses, step.undesirable_weight * rejected_losses), 0)
    return losses, [chosen_rewards, rejected_rewards]


def _metrics(outputs: Any, batch: Dict[str, torch.Tensor], seq_len: int, chosen_idx: torch.Tensor,
             rejected_idx: torch.Tensor, rewards: List[Any], chosen_logps: torch.Tensor,
             rejected_logps: torch.Tensor, num_chosen: torch.Tensor, num_rejected: torch.Tensor) -> List[Any]:
    """The metrics' tensors of `_compute_loss` ("# Entropy" to the loss), in its order; a single
    process's `gather_for_metrics` returns its input, and each `.item()` frees the tensor read."""
    kept: List[Any] = []
    per_token_entropy = outputs.entropy[:, -seq_len:].detach()
    mask = batch["completion_mask"][:, 1:]
    entropy_sum, total_tokens = (per_token_entropy * mask).sum(), mask.sum()
    entropy_sum, total_tokens = entropy_sum.sum(), total_tokens.sum()
    kept += [entropy_sum, total_tokens, total_tokens > 0, entropy_sum / total_tokens]
    kept.append(batch["attention_mask"].sum().sum())  # num_tokens_in_batch, read
    mean_logits = outputs.mean_logits[:, -seq_len:]
    chosen_mean_logits = mean_logits.index_select(0, chosen_idx)
    rejected_mean_logits = mean_logits.index_select(0, rejected_idx)
    chosen_mask = mask.index_select(0, chosen_idx)
    rejected_mask = mask.index_select(0, rejected_idx)
    # chosen_mean_logits[chosen_mask.bool()].sum(): the select as a whole-row product
    kept += [chosen_mean_logits, rejected_mean_logits, chosen_mask, rejected_mask,
             (chosen_mean_logits * chosen_mask.bool()).sum(), chosen_mask.sum(),
             (rejected_mean_logits * rejected_mask.bool()).sum(), rejected_mask.sum()]
    kept += [num_chosen.sum(), num_rejected.sum()]  # all_num_chosen, all_num_rejected, read
    chosen_rewards, rejected_rewards = rewards
    kept += [chosen_rewards.nansum().nansum(), chosen_logps.nansum().nansum(),
             rejected_rewards.nansum().nansum(), rejected_logps.nansum().nansum()]
    return kept
