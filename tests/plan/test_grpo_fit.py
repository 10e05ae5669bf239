"""`trainer_memcb.plan.answers.grpo_fit`: GRPO's rules for --fit, each from TRL 1.16's own
(`GRPOConfig.__post_init__`'s generation batch, `GRPOTrainer`'s old log-probs) and vLLM's floor;
the search through them is `tests/cli/test_cli_grpo_fit.py`'s."""

from __future__ import annotations

import pytest
import torch

from trainer_memcb.plan.answers.grpo_fit import settle_grpo_args, smaller_generation_batches, vllm_floor_bytes
from trainer_memcb.plan.step.grpo import GrpoStep


def test_the_batch_changed_keeps_the_generation_batch_and_one_generation_key() -> None:
    step = GrpoStep(num_generations=4, steps_per_generation=2)  # micro-batches of 4: a generation of 8
    settle = settle_grpo_args(step, 4)
    both = {"per_device_train_batch_size": 4, "generation_batch_size": 8, "steps_per_generation": 2}
    assert settle(both) == {"per_device_train_batch_size": 4, "generation_batch_size": 8}
    assert settle({"per_device_train_batch_size": 2, "steps_per_generation": 2}) == {
        "per_device_train_batch_size": 2, "generation_batch_size": 8}
    assert settle({"per_device_train_batch_size": 4, "steps_per_generation": 2}) == {
        "per_device_train_batch_size": 4, "steps_per_generation": 2}  # the user's own, as given
    # TRL refuses a generation batch that is no whole number of micro-batches, or of groups.
    assert settle({"per_device_train_batch_size": 3}) is None
    assert settle({"per_device_train_batch_size": 4, "generation_batch_size": 6}) is None


@pytest.mark.parametrize("batch,steps,accumulation,iterations,sizes", [
    (4, 8, 8, 1, [4, 8, 16]),    # on policy: each divisor of 8 micro-batches a generation
    (8, 4, 4, 1, [8, 16]),       # whole groups of 8 completions
    (2, 8, 8, 1, [8]),           # 2 and 4 completions are no whole group of 8
    (4, 4, 2, 1, []),            # off policy (generated for two steps): a smaller one would be on policy
    (4, 4, 8, 2, [4, 8]),        # on policy over 2 iterations: steps x iterations divide 8
    (4, 4, 4, 2, []),            # 2 iterations of 4 steps span two optimizer steps: off policy
])
def test_the_smaller_generation_batches_are_those_trl_takes_as_on_policy_as_the_users(
        batch: int, steps: int, accumulation: int, iterations: int, sizes: list) -> None:
    step = GrpoStep(num_generations=8 if batch == 8 or batch == 2 else 4, steps_per_generation=steps)
    assert smaller_generation_batches(step, batch, accumulation, iterations) == sizes


def test_vllms_floor_is_the_weights_and_one_contexts_kv_cache() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained("examples/models/qwen2-7b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    step = GrpoStep(use_vllm=True)
    weights = 7_615_616_512 * 2
    per_token = 2 * 28 * 4 * 128 * 2  # keys and values, 28 layers, 4 KV heads of 128, bf16
    assert vllm_floor_bytes(model, step, {}) == weights + per_token * 32_768  # max_position_embeddings
    assert vllm_floor_bytes(model, step, {"vllm_max_model_length": 4096}) == weights + per_token * 4096
