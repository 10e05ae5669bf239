"""The generation phase of TRL's GRPO step (`GRPOTrainer._prepare_inputs` on a step that
generates, TRL 1.16, transformers' generation without vLLM), under fake tensors.

What runs, in order (trl/trainer/grpo_trainer.py):

- `_generate_single_turn`'s regular path: the prompts as int64 tensors, left-padded into ids and
  an attention mask, then transformers' own `model.generate` under `torch.no_grad()` with the
  `GenerationConfig` `GRPOTrainer.__init__` builds (sampling: its logits processors, softmax,
  multinomial; the KV cache class generate picks, `DynamicCache` by default, whose layers grow by
  `torch.cat` at each token), gradient checkpointing off around it; then the completions cut at
  their first EOS (`torch.isin`, the masks), read back as lists;
- `_generate_and_score_completions`: the prompts and completions padded again into tensors, the
  number of completion tokens, the prompt-completion ids and mask, under `torch.no_grad()` the old
  policy's per-token log-probs (where TRL computes them) and the reference's (beta above 0: the
  frozen copy, or the policy inside `disable_adapter()` with PEFT), in chunks of
  `per_device_train_batch_size` rows through TRL's fused LM head; the rewards and advantages;
- the generation batch shuffled (`shuffle_sequence_dict`: each tensor indexed anew) and split into
  `steps_per_generation` micro-batches (views), kept until the next generation.

transformers' `generate` is called, not mirrored; where it reads values a fake tensor cannot give
(`aten._local_scalar_dense`), `answered_reads` answers as the plan's batch answers: every prompt
of the same length and every id valid (the expression that reads is found in its caller's source:
an `.all()` check, whether the mask is all ones, is true; every other read, `.any()` of padding or
of negative ids, is false), and no completion stopping before `max_completion_length` tokens (the
stop check answered by the length alone: the most a completion holds). transformers 5.25 reads
three values so (the right-padding check, the all-ones mask, the encoder ids' check), each answered
as a real unpadded batch answers it. Each decode step is traced: the trace's time grows with the
completion's tokens times the layers (a 24-layer 0.5B model's 128 tokens for 8 prompts of 256: about
a minute of one CPU core). The rewards are Python (the reward functions'), their
small tensors (a few bytes a completion) are mirrored as TRL makes them where they do not depend on
values.
"""

from __future__ import annotations

import contextlib
import linecache
from typing import Any, Dict, Iterator, List, Optional

import torch

from trainer_memcb.plan.step.grpo import GrpoBatch, GrpoStep, per_token_logps

__all__ = ["answered_reads", "grpo_generation"]


_NOT_THE_READER = ("/torch/", "/trainer_memcb/")


def _source_of(frame: Any) -> str:
    """The source of the expression a frame is reading a value in: its instruction's span where
    Python records it (3.11 on: a condition spread over lines is read whole), else its line."""
    code = frame.f_code
    positions = list(code.co_positions())[frame.f_lasti // 2] if hasattr(code, "co_positions") else None
    if positions is None or positions[0] is None or positions[1] is None:
        return linecache.getline(code.co_filename, frame.f_lineno)
    start, end, column, end_column = positions
    lines = [linecache.getline(code.co_filename, number) for number in range(start, end + 1)]
    if start == end and column is not None and end_column is not None:
        return lines[0][column:end_column]
    return "".join(lines)


def _answer_of(line: str) -> bool:
    """The answer of a value read at this source line, as an unpadded batch answers it."""
    return ".all()" in line or "torch.all(" in line


@contextlib.contextmanager
def answered_reads(max_length: int) -> Iterator[None]:
    """While active, a fake tensor's value read is answered (module docstring) and generate's stop
    check is answered by the length: done at `max_length` tokens, never before."""
    import sys

    from torch._subclasses import fake_impls
    from transformers.generation import utils as generation_utils

    op = torch.ops.aten._local_scalar_dense.default
    original_read = fake_impls.op_implementations_dict[op]
    original_stop = generation_utils.StopCheck.__call__

    def read(fake_mode: Any, func: Any, tensor: Any) -> Any:
        # The line that read: the first frame outside torch and this package (the step's own
        # dispatch modes are in between).
        frame = sys._getframe(1)
        while frame is not None and any(part in frame.f_code.co_filename for part in _NOT_THE_READER):
            frame = frame.f_back
        answer = _answer_of(_source_of(frame)) if frame is not None else False
        return answer if tensor.dtype == torch.bool else int(answer)

    def stop(self: Any, unfinished_sequences: Any, tokens: Any, length: int) -> bool:
        return length >= max_length

    fake_impls.op_implementations_dict[op] = read
    generation_utils.StopCheck.__call__ = stop
    try:
        yield
    finally:
        fake_impls.op_implementations_dict[op] = original_read
        generation_utils.StopCheck.__call__ = original_stop


def _pad(tensors: List[torch.Tensor], value: int, side: str) -> torch.Tensor:
    from trl.trainer.utils import pad

    return pad(tensors, padding_value=value, padding_side=side, pad_to_multiple_of=None)


def _generated(model: torch.nn.Module, step: GrpoStep, rows: int, prompt_len: int, tokens: Dict[str, Any]) -> None:
    """`_generate_single_turn`'s regular path: every storage it makes is gone when it returns
    (the completions leave it as lists)."""
    from transformers import GenerationConfig

    prompt_tensors = [torch.zeros(prompt_len, dtype=torch.long) for _ in range(rows)]  # torch.tensor(ids)
    padded_ids = _pad(prompt_tensors, tokens["pad_token_id"], "left")
    attention_mask = _pad([torch.ones_like(t) for t in prompt_tensors], 0, "left")
    config = GenerationConfig(**dict(step.generation_kwargs), pad_token_id=tokens["pad_token_id"],
                              bos_token_id=tokens["bos_token_id"], eos_token_id=tokens["eos_token_ids"],
                              disable_compile=True)
    # unwrap_model_for_generation turns checkpointing off around generate and back on with the
    # config's keywords: the layers' own switch is turned off and back, the keywords untouched.
    checkpointed = [module for module in model.modules() if getattr(module, "gradient_checkpointing", False) is True]
    for module in checkpointed:
        module.gradient_checkpointing = False
    try:
        with torch.no_grad(), answered_reads(prompt_len + step.max_completion_length):
            prompt_completion_ids = model.generate(input_ids=padded_ids, attention_mask=attention_mask,
                                                   generation_config=config)
    finally:
        for module in checkpointed:
            module.gradient_checkpointing = True
    completion_ids = prompt_completion_ids[:, prompt_len:]
    is_eos = torch.isin(completion_ids, torch.tensor(tokens["eos_token_ids"]))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
    # eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]: no row has an EOS
    # (the most tokens), so both selects are empty: their masks and the argmax are made, nothing else.
    is_eos.any(dim=1), is_eos.int().argmax(dim=1), is_eos.any(dim=1)
    sequence_indices = torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1)
    completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()
    del completion_mask, padded_ids, attention_mask


def grpo_generation(model: torch.nn.Module, ref_model: Optional[torch.nn.Module], step: GrpoStep, batch_size: int,
                    prompt_len: int, tokens: Dict[str, Any], autocast: Any = None) -> GrpoBatch:
    """The generation phase (module docstring) on fake tensors: `batch_size x steps_per_generation`
    prompts of `prompt_len` tokens, each completed to `max_completion_length`; returns the first
    micro-batch of the buffered generation batch, which holds the whole of it. `tokens` holds the
    tokenizer's `pad_token_id`, `bos_token_id` and `eos_token_ids`; `autocast` the context the
    log-prob forwards run in (`accelerator.autocast()`; generate runs outside it)."""
    rows, completion_len = step.generation_rows(batch_size), step.max_completion_length
    if not step.use_vllm:  # vLLM generates outside this process's fake step (not traced)
        _generated(model, step, rows, prompt_len, tokens)
    prompt_list = [torch.zeros(prompt_len, dtype=torch.long) for _ in range(rows)]
    prompt_mask_list = [torch.ones_like(ids, dtype=torch.long) for ids in prompt_list]
    prompt_ids = _pad(prompt_list, tokens["pad_token_id"], "left")
    prompt_mask = _pad(prompt_mask_list, 0, "left")
    del prompt_list, prompt_mask_list
    completion_list = [torch.zeros(completion_len, dtype=torch.long) for _ in range(rows)]
    completion_mask_list = [torch.ones_like(ids, dtype=torch.long) for ids in completion_list]
    completion_ids = _pad(completion_list, tokens["pad_token_id"], "right")
    completion_mask = _pad(completion_mask_list, 0, "right")
    del completion_list, completion_mask_list
    num_items_in_batch = completion_mask.sum().sum()  # gather(loss_mask.sum()).sum() on one process
    prompt_completion_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    output = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask}
    # Each chunk's forward in its own `accelerator.autocast()` (`_get_per_token_logps_and_entropies`):
    # the weights autocast casts are cached only while it is entered, not from one forward to the next.
    with torch.no_grad():
        if step.old_log_probs:
            output["old_per_token_logps"], _ = per_token_logps(model, prompt_completion_ids, attention_mask,
                                                               completion_len, batch_size, autocast=autocast)
        if step.reference == "model":
            output["ref_per_token_logps"], _ = per_token_logps(ref_model, prompt_completion_ids, attention_mask,
                                                               completion_len, batch_size, autocast=autocast)
        elif step.reference == "adapters-disabled":
            with model.disable_adapter():  # trl.trainer.utils.use_adapter(model, None)
                output["ref_per_token_logps"], _ = per_token_logps(model, prompt_completion_ids, attention_mask,
                                                                   completion_len, batch_size, autocast=autocast)
    del prompt_completion_ids, attention_mask
    output["advantages"] = _advantages(rows, step.num_generations)
    output["num_items_in_batch"] = num_items_in_batch
    return _buffered(output, step.steps_per_generation)


def _advantages(rows: int, num_generations: int) -> torch.Tensor:
    """`_calculate_rewards` and the advantages ("sum_then_normalize", `scale_rewards` "group") for
    one reward function on one process, the temporaries freed as TRL's locals are."""
    rewards_per_func = torch.zeros(rows, 1)
    rewards_per_func[:, 0] = torch.zeros(rows)  # torch.tensor(output_reward_func)
    torch.isnan(rewards_per_func).all(dim=1).any()
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    reward_weights = torch.ones(1)
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    # rewards[unscorable_mask] = nan: no row is unscorable, nothing written
    mean_grouped = torch.nanmean(rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    grouped = rewards.view(-1, num_generations)
    std = torch.sqrt(torch.nanmean((grouped - torch.nanmean(grouped, dim=1, keepdim=True)) ** 2, dim=1)
                     * (num_generations / (num_generations - 1))).repeat_interleave(num_generations, dim=0)
    advantages = (rewards - mean_grouped) / (std + 1e-4)
    torch.isclose(std, torch.zeros_like(std))
    advantages = torch.nan_to_num(advantages, nan=0.0)
    del unscorable_mask
    return advantages[slice(0, rows)]


def _buffered(output: Dict[str, torch.Tensor], steps_per_generation: int) -> GrpoBatch:
    """`shuffle_sequence_dict` then `split_tensor_dict`: each tensor of one dimension or more indexed
    by a permutation (a new tensor), the 0-dim count kept; the first micro-batch's views, the whole
    shuffled tensors held."""
    rows = output["prompt_ids"].size(0)
    permutation = torch.randperm(rows)
    shuffled = {key: value if value.ndim == 0 else value[permutation] for key, value in output.items()}
    del permutation, output
    chunk = rows // steps_per_generation
    first = {key: value if value.ndim == 0 else value[:chunk] for key, value in shuffled.items()}
    return GrpoBatch(first, held=shuffled)
