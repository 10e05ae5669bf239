"""TRL's GRPO step, as `GRPOTrainer` (TRL 1.16) runs it, for the step tracer: its settings and its
training phase.

A GRPO step has two phases (trl/trainer/grpo_trainer.py):

- the generation phase, `_prepare_inputs` on a step that generates (every `steps_per_generation x
  num_iterations` steps): the prompts' completions by transformers' `generate`, the old policy's
  and the reference's per-token log-probs under `torch.no_grad()`, the rewards and advantages, and
  the generation batch shuffled and split into `steps_per_generation` micro-batches kept to the
  next generation (`trainer_memcb.plan.step.grpo_generation`);
- the training phase, `compute_loss` over one micro-batch of `per_device_train_batch_size`
  completions (`grpo_loss`): the policy's per-token log-probs through TRL's fused LM head, the
  importance ratio, the KL to the reference's log-probs where `beta > 0`, the loss of `loss_type`,
  then the Trainer's backward and optimizer step.

`GrpoStep` holds what of a `GRPOConfig` changes the step's memory, and `grpo_step_from_config`
makes one after the checks `GRPOConfig.__post_init__` and `GRPOTrainer.__init__` make of those
fields. The plan's prompt length is the step's `seq_len` (the longest prompt, in tokens: TRL 1.16
does not truncate prompts), its completions are `max_completion_length` tokens (the most: a
completion stops early at its EOS).

Mirrored, not called: `_compute_loss` reads values (`.item()` for each metric) that a fake tensor
cannot give; the reads allocate nothing. vLLM cannot run here: with `use_vllm` the generation is
not traced, and its share of the device is a rule
(`trainer_memcb.plan.answers.grpo_answer.vllm_reserved_bytes`).
"""

from __future__ import annotations

import contextlib
import math
import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch

from trainer_memcb.plan.step.preference import fused_lm_heads
from trainer_memcb.plan.step.trl_step import TrlStep

__all__ = ["GrpoStep", "GRPO_LOSS_TYPES", "GRPO_REFERENCES", "VLLM_MODES", "GrpoBatch", "grpo_step_from_config",
           "grpo_loss", "grpo_fused_lm_heads", "per_token_logps", "checked_generations",
           "nan_extreme"]

# The loss types the trace runs, each mirrored from `GRPOTrainer._compute_loss`'s branch of that name:
# every one TRL 1.14 to 1.16 takes.
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
_TRL_LOSS_TYPES = GRPO_LOSS_TYPES
# The levels of the importance weights `_compute_loss` knows: a ratio per token, or one per sequence.
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# The loss types whose clipped ratios `_compute_loss` logs (`clip_ratio/...`).
_CLIPPED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
# Where the reference log-probs come from: none (beta 0), a frozen second model, or the policy with
# its adapters disabled (PEFT: TRL makes no `ref_model`).
GRPO_REFERENCES = ("none", "model", "adapters-disabled")
VLLM_MODES = ("colocate", "server")


@dataclasses.dataclass(frozen=True)
class GrpoStep(TrlStep):
    """The GRPO settings that change the step's memory.

    Attributes:
        beta: `GRPOConfig.beta` (the KL's weight; 0 computes no reference log-probs).
        num_generations: completions per prompt.
        steps_per_generation: micro-batches generated at once (the generation batch is
            `per_device_train_batch_size x steps_per_generation` completions on each process).
        max_completion_length: the completions' tokens (the most).
        loss_type: one of `GRPO_LOSS_TYPES`.
        reference: one of `GRPO_REFERENCES`.
        old_log_probs: whether the old policy's log-probs are computed after generation
            (`gradient_accumulation_steps` not a multiple of `steps_per_generation x num_iterations`).
        generation_kwargs: the `GenerationConfig` keywords `GRPOTrainer.__init__` builds (sorted pairs).
        temperature: the fused LM head's temperature (`GRPOConfig.temperature`).
        use_bias_correction_kl: the KL multiplied by the importance ratio.
        delta: the upper clamp of the ratio (two-sided clipping), or None.
        importance_sampling_level: one of `IMPORTANCE_SAMPLING_LEVELS`.
        use_vllm, vllm_mode, vllm_gpu_memory_utilization: generation by vLLM (not traced).
    """

    beta: float = 0.0
    num_generations: int = 8
    steps_per_generation: int = 1
    max_completion_length: int = 512
    loss_type: str = "dapo"
    reference: str = "none"
    old_log_probs: bool = False
    generation_kwargs: Tuple[Tuple[str, Any], ...] = ()
    temperature: float = 1.0
    use_bias_correction_kl: bool = True
    delta: Optional[float] = None
    use_vllm: bool = False
    vllm_mode: str = "colocate"
    vllm_gpu_memory_utilization: float = 0.3
    importance_sampling_level: str = "token"

    trainer = "grpo"
    loss_types = GRPO_LOSS_TYPES  # the loss types planned (RLOO's step has its own)
    generates = True
    folds = False

    def __post_init__(self) -> None:
        if self.reference not in GRPO_REFERENCES:
            raise ValueError(f"reference={self.reference!r}: expected one of {', '.join(GRPO_REFERENCES)}")
        if (self.reference == "none") != (self.beta == 0.0):
            raise ValueError(f"reference={self.reference!r} with beta {self.beta}: beta 0 takes reference 'none', "
                             "any other beta 'model' or 'adapters-disabled'")
        if self.loss_type not in self.loss_types:
            raise ValueError(f"loss_type {self.loss_type!r}: the {self.trainer.upper()} step is planned for "
                             f"{', '.join(self.loss_types)}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"importance_sampling_level {self.importance_sampling_level!r}: TRL takes one of "
                             f"{', '.join(IMPORTANCE_SAMPLING_LEVELS)}")
        if self.vllm_mode not in VLLM_MODES:
            raise ValueError(f"vllm_mode {self.vllm_mode!r}: expected one of {', '.join(VLLM_MODES)}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(f"vllm_gpu_memory_utilization {self.vllm_gpu_memory_utilization!r}: expected a share "
                             "above 0 and at most 1")
        for name in ("num_generations", "steps_per_generation", "max_completion_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r}: expected a whole number of at least 1")

    def generation_rows(self, batch_size: int) -> int:
        """The completions generated at once on one process: `batch_size x steps_per_generation`."""
        return batch_size * self.steps_per_generation

    def check_batch(self, batch_size: int) -> None:
        """Refuse a micro-batch whose generation batch TRL refuses: its completions
        (`batch_size x steps_per_generation`) must be whole groups of `num_generations` (a batch size
        given apart from the GRPOConfig, or searched, is checked here).

        Raises:
            ValueError: naming the batch size and what TRL allows.
        """
        rows = self.generation_rows(batch_size)
        if rows % self.num_generations:
            raise ValueError(f"batch_size {batch_size}: {self.trainer.upper()} generates batch_size x "
                             f"steps_per_generation ({self.steps_per_generation}) = {rows} completions, and TRL "
                             f"requires whole groups of num_generations ({self.num_generations})")

    def fuse_lm_heads(self, model: torch.nn.Module, ref_model: Optional[torch.nn.Module]) -> None:
        grpo_fused_lm_heads(model, ref_model, self.temperature)

    def batch(self, model: torch.nn.Module, batch_size: int, seq_len: Optional[int], input_options: Dict[str, Any]) -> Any:
        return None  # made by the generation phase, in the step

    def loss(self, model: torch.nn.Module, inputs: Any, ref_model: Optional[torch.nn.Module], kwargs: Dict[str, Any],
             accumulation: int, autocast: Any) -> torch.Tensor:
        # GRPOTrainer.compute_loss over the buffered micro-batch; each log-prob forward in its own
        # autocast, as TRL runs it.
        return grpo_loss(model, inputs, self, accumulation, autocast=autocast)

    def generates_before(self, number: int, accumulation: int) -> bool:
        """Before the first traced micro-batch, and where generations run inside the accumulation
        (`steps_per_generation` below it: TRL generates again every `steps_per_generation`
        micro-batches), before the second too, with the first's gradients alive as every later
        generation of the step holds them (the traced micro-batches are the first, the second and the
        last: the second stands for the one after the first generation's last)."""
        return number == 1 or (number == 2 and self.steps_per_generation < accumulation)

    def as_traced(self) -> "GrpoStep":
        # vLLM's share of the device is in the reserve, not in the step traced.
        return dataclasses.replace(self, vllm_gpu_memory_utilization=1.0)


def _whole(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} {value!r}: expected a whole number of at least {least}")
    return value


def _generation_batch(config: Any, world_size: int) -> Tuple[int, int]:
    """`generation_batch_size` and `steps_per_generation` as `GRPOConfig.__post_init__` resolves them."""
    batch = _whole("per_device_train_batch_size", config.per_device_train_batch_size, 1)
    accumulation = _whole("gradient_accumulation_steps", config.gradient_accumulation_steps, 1)
    generation, steps = config.generation_batch_size, config.steps_per_generation
    if generation is not None and steps is not None:
        # A GRPOConfig made (and its JSON, `to_json_string()`) holds both, resolved by its
        # `__post_init__`; given by hand, TRL refuses the two together.
        if generation != batch * world_size * _whole("steps_per_generation", steps, 1):
            raise ValueError(f"generation_batch_size {generation} and steps_per_generation {steps}: TRL refuses "
                             "both at once; give one")
        generation = None
    if generation is None and steps is None:
        steps = accumulation
    if steps is not None:
        steps = _whole("steps_per_generation", steps, 1)
        return batch * world_size * steps, steps
    generation = _whole("generation_batch_size", generation, 1)
    if generation % (batch * world_size):
        raise ValueError(f"generation_batch_size {generation}: TRL requires a multiple of the global batch size "
                         f"({batch} x {world_size} processes)")
    return generation, generation // (batch * world_size)


def _refuse_unplanned(config: Any) -> None:
    """The GRPO options whose step is not planned yet, each refused by name."""
    unplanned = {"top_entropy_quantile": config.top_entropy_quantile != 1.0,
                 "off_policy_mask_threshold": config.off_policy_mask_threshold is not None,
                 "entropy_coef": bool(config.entropy_coef) or bool(config.use_adaptive_entropy),
                 "use_transformers_continuous_batching": bool(config.use_transformers_continuous_batching
                                                              or config.use_transformers_paged),
                 "cast_lm_head_to_fp32": bool(config.cast_lm_head_to_fp32)}
    for name, asked in unplanned.items():
        if asked:
            raise ValueError(f"{name} {getattr(config, name)!r}: the GRPO step is planned with its default so far")


def checked_generations(config: Any, world_size: int, trainer: str) -> Tuple[int, int, int]:
    """(generation batch, steps_per_generation, num_generations) of a generating trainer's config
    (`trainer`: "GRPO" or "RLOO"), after the checks TRL makes of them and of `beta` alike in both.

    Raises:
        ValueError: naming the field, its value and what TRL allows.
    """
    generation, steps = _generation_batch(config, world_size)
    generations = _whole("num_generations", config.num_generations, 1)
    if generations < 2:
        raise ValueError(f"num_generations {generations}: {trainer} requires at least 2 generations per prompt")
    if generation % generations:
        raise ValueError(f"generation_batch_size {generation}: TRL requires a multiple of num_generations "
                         f"({generations})")
    if isinstance(config.beta, bool) or not isinstance(config.beta, (int, float)) or config.beta < 0:
        raise ValueError(f"beta {config.beta!r}: expected a number of at least 0")
    if config.sync_ref_model and config.beta == 0.0:
        raise ValueError("sync_ref_model with beta 0: TRL makes no reference model to synchronize; set beta above 0")
    return generation, steps, generations


def grpo_step_from_config(config: Any, *, peft: bool, world_size: int = 1) -> GrpoStep:
    """The `GrpoStep` of a `trl.GRPOConfig` (or a namespace of its fields), after the checks
    `GRPOConfig.__post_init__` and `GRPOTrainer.__init__` make of the fields that change memory,
    for a model trained with PEFT adapters or not, on `world_size` processes.

    Raises:
        ValueError: naming the field, its value and what TRL allows (or what is planned).
    """
    generation, steps, generations = checked_generations(config, world_size, "GRPO")
    if config.loss_type not in _TRL_LOSS_TYPES:
        raise ValueError(f"loss_type {config.loss_type!r}: TRL takes one of {', '.join(_TRL_LOSS_TYPES)}")
    _refuse_unplanned(config)
    iterations = _whole("num_iterations", config.num_iterations, 1)
    use_vllm = bool(config.use_vllm)
    old = config.gradient_accumulation_steps % (steps * iterations) != 0 or (
        use_vllm and bool(config.vllm_importance_sampling_correction))
    reference = "none" if config.beta == 0.0 else ("adapters-disabled" if peft else "model")
    return GrpoStep(beta=float(config.beta), num_generations=generations, steps_per_generation=steps,
                    max_completion_length=_whole("max_completion_length", config.max_completion_length, 1),
                    loss_type=config.loss_type, reference=reference, old_log_probs=old,
                    generation_kwargs=tuple(sorted(_generation_kwargs(config).items())),
                    temperature=float(config.temperature), use_bias_correction_kl=bool(config.use_bias_correction_kl),
                    delta=config.delta, use_vllm=use_vllm, vllm_mode=config.vllm_mode,
                    vllm_gpu_memory_utilization=float(config.vllm_gpu_memory_utilization),
                    importance_sampling_level=config.importance_sampling_level)


def _generation_kwargs(config: Any) -> Dict[str, Any]:
    """The sampling keywords of `GRPOTrainer.__init__`'s `GenerationConfig` (the tokens' ids are the
    tokenizer's, given when the phase is traced), with `generation_kwargs` over them."""
    kwargs = {"max_new_tokens": config.max_completion_length, "do_sample": True, "temperature": config.temperature,
              "top_p": config.top_p, "top_k": config.top_k, "min_p": config.min_p,
              "repetition_penalty": config.repetition_penalty, "cache_implementation": config.cache_implementation}
    kwargs.update(config.generation_kwargs or {})
    return kwargs


@dataclasses.dataclass
class GrpoBatch:
    """One micro-batch of the buffered generation batch (`GRPOTrainer._prepare_inputs`): views of
    the shuffled generation batch's tensors, which `held` keeps whole (the other micro-batches')."""

    batch: Dict[str, torch.Tensor]
    held: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    labels: Optional[torch.Tensor] = None

    @property
    def forward(self) -> Dict[str, torch.Tensor]:
        return self.batch

    def tensors(self) -> List[torch.Tensor]:
        return list(self.held.values())


def grpo_fused_lm_heads(model: torch.nn.Module, ref_model: Optional[torch.nn.Module], temperature: float) -> None:
    """Patch TRL's fused LM head onto the policy (its base model under PEFT) and the reference, as
    `GRPOTrainer.__init__` does."""
    fused_lm_heads(model, ref_model, policy_outputs=("log_probs", "entropy"), temperature=temperature)


def per_token_logps(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    logits_to_keep: int, batch_size: int, entropy: bool = False,
                    autocast: Any = None) -> Tuple[torch.Tensor, Any]:
    """`GRPOTrainer._get_per_token_logps_and_entropies` for a text model: the rows in chunks of
    `batch_size`, each through the fused head with its labels, the chunks' log-probs (and entropies)
    concatenated; `autocast` the context each chunk's forward runs in alone (RLOO's
    `accelerator.autocast()`, whose cast weights are dropped after each chunk), None where the
    caller holds one around the whole."""
    all_logps, all_entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        end = min(start + batch_size, input_ids.size(0))
        input_ids_batch, attention_mask_batch = input_ids[start:end], attention_mask[start:end]
        labels = input_ids_batch.masked_fill(attention_mask_batch == 0, -100)
        labels[:, :-logits_to_keep] = -100
        with autocast if autocast is not None else contextlib.nullcontext():
            outputs = model(input_ids=input_ids_batch, attention_mask=attention_mask_batch, labels=labels,
                            fused_lm_head=True)
        all_logps.append(outputs.log_probs[:, -logits_to_keep:])
        if entropy:
            all_entropies.append(outputs.entropy[:, -logits_to_keep:])
    logps = torch.cat(all_logps, dim=0)
    return logps, torch.cat(all_entropies, dim=0) if entropy else None


def grpo_loss(model: torch.nn.Module, inputs: GrpoBatch, step: GrpoStep, accumulation: int = 1,
              autocast: Any = None) -> torch.Tensor:
    """`GRPOTrainer._compute_loss(model, inputs)` for a text model, each loss type and importance
    sampling level, no entropy mask, bonus or off-policy mask, no vLLM importance ratio, its value reads
    (the metrics' `.item()`) left out; the metrics' tensors are made as it makes them, and
    `accumulation` is `current_gradient_accumulation_steps`. `autocast`: the context each log-prob
    forward runs in alone (`accelerator.autocast()`; the loss's own operations run outside it)."""
    batch = inputs.batch
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_mask"]
    completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits_to_keep = completion_ids.size(1)
    mask = completion_mask
    logps, entropies = per_token_logps(model, input_ids, attention_mask, logits_to_keep, input_ids.size(0),
                                       entropy=True, autocast=autocast)
    advantages = batch["advantages"].unsqueeze(1)
    old = batch.get("old_per_token_logps")
    old = logps.detach() if old is None else old
    log_ratio = logps - old
    if step.importance_sampling_level == "sequence":
        weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        weights = log_ratio
    coef_1 = torch.exp(weights)
    per_token_kl = None
    if step.beta != 0.0:
        ref = batch["ref_per_token_logps"]
        per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
        if step.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
    per_token_loss, coef_1, held = _per_token_loss(step, coef_1, log_ratio, logps, advantages, mask)
    if per_token_kl is not None:
        per_token_loss = per_token_loss + step.beta * per_token_kl
    loss, reduced = _reduced(per_token_loss, mask, step, batch["num_items_in_batch"], accumulation)
    held += reduced
    held += _metrics(step.loss_type, per_token_kl, entropies, mask, coef_1, advantages, held)
    del held
    return loss


# The ratios' bounds and the loss types' coefficients, TRL's defaults: their values change no bytes.
_EPSILON_LOW, _EPSILON_HIGH = 0.2, 0.2
_SAPO_TEMPERATURES = (1.0, 1.05)
_VESPO_K, _VESPO_LAMBDA = (2.0, 3.0), (3.0, 2.0)


def _per_token_loss(step: GrpoStep, coef_1: torch.Tensor, log_ratio: torch.Tensor, logps: torch.Tensor,
                    advantages: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Any]:
    """(the per-token loss of `step.loss_type`, the ratio the metrics read, the branch's other
    tensors: `_compute_loss` holds them, as locals, until it returns), as its branches make them."""
    if step.loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=_EPSILON_HIGH).detach()
        return -clamped_ratios * advantages * logps, coef_1, [clamped_ratios]
    if step.loss_type == "sapo":
        temperatures = torch.where(advantages > 0, *_SAPO_TEMPERATURES)
        soft_coef_1 = torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures
        return -soft_coef_1 * advantages, coef_1, [temperatures, soft_coef_1]
    if step.loss_type == "vespo":
        phi_seq = _gamma_weights(advantages, log_ratio, mask)
        return -phi_seq * advantages * logps, coef_1, [phi_seq]
    # grpo, bnpo, dr_grpo, dapo, luspo: two-sided clipping
    coef_2 = torch.clamp(coef_1, 1 - _EPSILON_LOW, 1 + _EPSILON_HIGH)
    if step.delta is not None:
        coef_1 = torch.clamp(coef_1, max=step.delta)
    per_token_loss1, per_token_loss2 = coef_1 * advantages, coef_2 * advantages
    return -torch.min(per_token_loss1, per_token_loss2), coef_1, [coef_2, per_token_loss1, per_token_loss2]


@torch.no_grad()
def _gamma_weights(advantages: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`GRPOTrainer.get_gamma_weights` without vLLM's importance ratio: VESPO's per-sequence weights."""
    # TRL's locals, in its order: each lives until the function returns, and they are freed in it.
    lower_clamp = math.log(1e-8)
    log_ratio_clamped = torch.clamp(log_ratio, -20.0, 20.0)
    seq_log_ratio = torch.sum(log_ratio_clamped * mask, dim=-1, keepdim=True)
    log_w_seq = torch.clamp(seq_log_ratio, lower_clamp, 20.0)
    w_seq = torch.exp(log_w_seq)
    is_nonneg_adv = advantages >= 0
    k_seq = torch.where(is_nonneg_adv, *_VESPO_K)
    lambda_seq = torch.where(is_nonneg_adv, *_VESPO_LAMBDA).clamp(min=1e-4)
    log_phi = lambda_seq + k_seq * log_w_seq - lambda_seq * w_seq
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _reduced(per_token_loss: torch.Tensor, mask: torch.Tensor, step: GrpoStep, num_items: torch.Tensor,
             accumulation: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """(the loss of `step.loss_type` over the micro-batch, divided for gradient accumulation; what
    `_compute_loss` holds as locals until it returns: the undivided loss detached, `policy_loss`,
    and the normalizer it made)."""
    if step.loss_type in ("dapo", "cispo", "vespo"):  # num_items_in_batch spans the generation batch
        normalizer = num_items.clamp(min=1.0) / 1  # / accelerator.num_processes: one process
        normalizer = normalizer * accumulation / step.steps_per_generation
        loss = (per_token_loss * mask).sum() / normalizer
        return loss, [normalizer, loss.detach()]
    if step.loss_type in ("grpo", "sapo"):
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif step.loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif step.loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * step.max_completion_length)
    else:  # luspo
        loss = (per_token_loss * mask).sum(-1).mean()
    return loss / accumulation, [loss.detach()]


def nan_extreme(tensor: torch.Tensor, extreme: Any) -> torch.Tensor:
    """`trl.trainer.utils.nanmin` / `nanmax`: its `.all()` read answered false and its boolean select
    as every element (no value is NaN: the flags are 0 or 1)."""
    torch.isnan(tensor).all()
    selected = ~torch.isnan(tensor)
    values = tensor[torch.arange(selected.size(0))]
    del selected  # freed before the extreme, as the expression's temporary is
    return extreme(values)


def _metrics(loss_type: str, per_token_kl: Optional[torch.Tensor], entropies: torch.Tensor, mask: torch.Tensor,
             coef_1: torch.Tensor, advantages: torch.Tensor, held: List[torch.Tensor]) -> List[Any]:
    """The metrics' tensors of `_compute_loss` ("# Log the metrics" to its return), each freed after
    its `.item()` (`global_masked_mean`, `masked_seq_mean`); a single process's reduce clones its
    input and its gather returns it. The ones `_compute_loss` holds as locals are returned."""
    def global_masked_mean(x: torch.Tensor) -> None:
        if x.shape[1] == 1:  # one value per sequence (sequence-level weights, VESPO's)
            local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            local_sum, local_count = (x * mask).sum(), mask.sum().float()
        totals = torch.stack([local_sum, local_count]).clone()  # accelerator.reduce clones on one process
        totals[0] / totals[1].clamp(min=1.0)

    def masked_seq_mean(x: torch.Tensor) -> torch.Tensor:
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    if per_token_kl is not None:
        global_masked_mean(per_token_kl)
    global_masked_mean(entropies)
    if loss_type == "cispo":
        is_cispo_clipped = (coef_1 > _EPSILON_HIGH) & (advantages > 0)
        global_masked_mean(is_cispo_clipped.float())
        return [is_cispo_clipped]
    if loss_type == "vespo":
        global_masked_mean(held[0])  # phi_seq
        return []
    if loss_type not in _CLIPPED_LOSS_TYPES:
        return []
    is_low_clipped = (coef_1 < 1 - _EPSILON_LOW) & (advantages < 0)
    is_high_clipped = (coef_1 > 1 + _EPSILON_HIGH) & (advantages > 0)
    is_region_clipped = is_low_clipped | is_high_clipped
    for clipped in (is_low_clipped, is_high_clipped, is_region_clipped):
        global_masked_mean(clipped.float())
    gathered_low_clip = masked_seq_mean(is_low_clipped.float())  # accelerator.gather returns it on one process
    nan_extreme(gathered_low_clip, torch.min)
    gathered_high_clip = masked_seq_mean(is_high_clipped.float())
    nan_extreme(gathered_high_clip, torch.max)
    return [is_low_clipped, is_high_clipped, is_region_clipped, gathered_low_clip, gathered_high_clip]
