"""The generation phase of TRL's RLOO step (`RLOOTrainer._prepare_inputs` on a step that generates,
TRL 1.16, transformers' generation without vLLM), under fake tensors.

The prompts, `generate` and the padded batch are GRPO's (`trainer_memcb.plan.step.grpo_generation`,
whose functions this module calls); then `RLOOTrainer._generate_and_score_completions`: under
`torch.no_grad()` the old policy's per-token log-probs (always), summed per sequence, and the
reference's where beta is above 0; the rewards (one reward function, no value unscorable), the
sequence-level KL penalty, the leave-one-out baselines and advantages, the metrics' tensors; the
generation batch shuffled and split into `steps_per_generation` micro-batches, kept until the next
generation.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from trainer_memcb.plan.step.grpo import GrpoBatch, per_token_logps
from trainer_memcb.plan.step.grpo_generation import _buffered, _generated, _pad
from trainer_memcb.plan.step.rloo import RlooStep

__all__ = ["rloo_generation"]


def rloo_generation(model: torch.nn.Module, ref_model: Optional[torch.nn.Module], step: RlooStep, batch_size: int,
                    prompt_len: int, tokens: Dict[str, Any], autocast: Any = None) -> GrpoBatch:
    """The generation phase (module docstring) on fake tensors: `batch_size x steps_per_generation`
    prompts of `prompt_len` tokens, each completed to `max_completion_length`; returns the first
    micro-batch of the buffered generation batch, which holds the whole of it."""
    rows, completion_len = step.generation_rows(batch_size), step.max_completion_length
    if not step.use_vllm:  # vLLM generates outside this process's fake step (not traced)
        _generated(model, step, rows, prompt_len, tokens)
    prompt_list = [torch.zeros(prompt_len, dtype=torch.long) for _ in range(rows)]
    prompt_ids = _pad(prompt_list, tokens["pad_token_id"], "left")
    prompt_mask = _pad([torch.ones_like(ids, dtype=torch.long) for ids in prompt_list], 0, "left")
    del prompt_list
    completion_list = [torch.zeros(completion_len, dtype=torch.long) for _ in range(rows)]
    completion_ids = _pad(completion_list, tokens["pad_token_id"], "right")
    completion_mask = _pad([torch.ones_like(ids, dtype=torch.long) for ids in completion_list], 0, "right")
    del completion_list
    if step.mask_truncated_completions:
        is_truncated = torch.zeros(rows, dtype=torch.bool)  # torch.tensor([...]) of Python bools
        completion_mask = completion_mask * (~is_truncated).unsqueeze(1).int()
        del is_truncated
    prompt_completion_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    ref_per_token_logps = None
    # Each chunk's forward in its own `accelerator.autocast()` (`_get_per_token_logps_and_entropies`):
    # the weights autocast casts are cached only while it is entered.
    with torch.no_grad():
        old_per_token_logps, _ = per_token_logps(model, prompt_completion_ids, attention_mask, completion_len,
                                                 batch_size, autocast=autocast)
        old_logps = (old_per_token_logps * completion_mask).sum(1)
        if step.reference == "model":
            ref_per_token_logps, _ = per_token_logps(ref_model, prompt_completion_ids, attention_mask,
                                                     completion_len, batch_size, autocast=autocast)
        elif step.reference == "adapters-disabled":
            with model.disable_adapter():  # trl.trainer.utils.use_adapter(model, None)
                ref_per_token_logps, _ = per_token_logps(model, prompt_completion_ids, attention_mask,
                                                         completion_len, batch_size, autocast=autocast)
    del prompt_completion_ids, attention_mask
    advantages = _advantages(step, rows, old_per_token_logps, ref_per_token_logps, completion_mask)
    del old_per_token_logps, ref_per_token_logps
    output = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "old_logps": old_logps, "advantages": advantages}
    return _buffered(output, step.steps_per_generation)


def _advantages(step: RlooStep, rows: int, old_per_token_logps: torch.Tensor,
                ref_per_token_logps: Optional[torch.Tensor], completion_mask: torch.Tensor) -> torch.Tensor:
    """`_calculate_rewards` for one reward function on one process, then the rewards, the KL
    penalty, the leave-one-out advantages and the metrics' tensors ("# Calculate rewards" to "# Log
    prompts and completions"), the temporaries freed as TRL's locals are."""
    from trl.trainer.utils import nanstd

    rewards_per_func = torch.zeros(rows, 1)
    rewards_per_func[:, 0] = torch.zeros(rows)  # torch.tensor(output_reward_func, dtype=torch.float32)
    torch.isnan(rewards_per_func).all(dim=1).any()
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    reward_weights = torch.ones(1)
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    # rewards[unscorable_mask] = nan: no row is unscorable, nothing written
    if step.reward_clip_range:
        rewards = rewards.clamp(min=step.reward_clip_range[0], max=step.reward_clip_range[1])
    per_token_kl = None
    if step.beta != 0.0:
        per_token_kl = old_per_token_logps - ref_per_token_logps
        kl = (per_token_kl * completion_mask).sum(-1)
        rewards = rewards - step.beta * kl
        del kl
    grouped_rewards = rewards.view(-1, step.num_generations)
    mean_grouped_rewards = torch.nanmean(grouped_rewards, dim=1)
    std_rewards = nanstd(grouped_rewards, dim=1)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    baselines = ((grouped_sum - grouped_rewards) / (scorable_counts - 1)).view(-1)
    advantages = rewards - baselines
    del scorable_counts, grouped_sum, baselines
    if step.normalize_advantages:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    advantages = torch.nan_to_num(advantages, nan=0.0)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    all_process_advantages = advantages.clone()  # kept for logging
    advantages = advantages[slice(0, rows)]
    if per_token_kl is not None:
        kl_stats = torch.stack([(per_token_kl * completion_mask).sum(), completion_mask.sum().float()]).clone()
        kl_stats[0] / kl_stats[1].clamp(min=1.0)
        del kl_stats
    torch.nanmean(rewards_per_func[:, 0]), nanstd(rewards_per_func[:, 0])
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    torch.nanmean(rewards), nanstd(rewards), is_std_zero.float().mean()
    del all_process_advantages, unscorable_mask, mean_grouped_rewards
    return advantages
